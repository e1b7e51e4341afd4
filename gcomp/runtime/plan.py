"""The execution plan: what the runtime does, as plain JSON-able data.

Code generation writes a plan; the runtime (which imports nothing from the
compiler) reads it.  Dimensions are ``"N"`` (nodes), ``"E:<graph>"`` (edges of
a graph value) or ints.

* ``inputs``: name, role (``node``, ``graph``, ``edge``), dims, and for edge
  inputs the graph they belong to; ``feed_kernel`` (CPU, float features): the kernel
  that checks and copies them in one pass (``feed_rows``); ``check_kernel``: the one that
  only checks them, when the kernels read the caller's array in place (``check_rows``).
* ``graphs``: graph values in definition order; a derived graph names its
  parent and the self-loop mode that makes it.
* ``buffers``: every tensor the plan touches: dims and, for views, the buffer
  they alias (a reshape costs nothing).
* ``bind_steps`` run once per bound graph, ``feed_steps`` each time node inputs
  are fed (values computed from them alone, e.g. the aggregated input features of
  a training step), ``steps`` on every run.  A step is
  a kernel name, the IR node and op it implements (``node``, ``op``, ``attrs``:
  for the distributed runtime and profiling), and its arguments:
  ``{"buf": name, "view": dims?}`` or
  ``{"graph": name, "array": <one of GRAPH_ARRAYS>}`` or ``{"nodes": "ids"}`` (int64,
  the user's id of each node row: the runtime may reorder or shard nodes).
* ``params``: parameter names (buffers of the same name); ``consts``: constant
  buffers and their values (a number or a list); ``state``: buffers that live
  as long as the executor, not a graph binding (optimizer moments, step
  counters); they start at zero and checkpoints save them.
* ``outputs``: name, buffer, role, and for edge outputs their graph.
* ``variants``: kernel variants the runtime chooses between for each bound graph.
  ``sparse:<input>`` (``{"input", "threshold"}``): when the fraction of zeros in
  those node features reaches the threshold (calibrated on the target at compile
  time), steps marked ``"when": key`` run and steps marked ``"unless": key`` do not;
  ``match_kernel`` (CPU) tells whether the values still hold the nonzeros bound.
  Their arguments may name ``{"features": input, "array": ...}``: the features'
  nonzeros (``indptr``, ``indices``, ``rows``, ``values``, ``csc_indptr``,
  ``csc_indices``, ``csc_eid``), sized by the dimension ``NNZ:<input>``.  A variant
  of values computed by feed steps names their ``sources`` (node inputs); the
  runtime measures them once fed.
* ``formats``: ``{"costs": {width: per-unit costs in ns}}`` measured on the target, for
  the run steps that carry ``"formats"``: the dense and banded kernels that may replace
  a CSR aggregation (``kernels``, ``pack``: layout packing kernels), the graph value,
  the weights argument (or None), the feature ``width``, ``transpose`` (aggregation over
  out-edges) and ``tail`` (index of the first argument, x, the replacement keeps);
  ``gcomp/runtime/formats.py`` chooses (the banded block size comes from the bound graph).
* ``alignment`` (CPU): kernel -> the byte alignment it assumes of each argument; the
  runtime passes the caller's own feature array only to kernels it suffices for.
* ``precision``: with ``--precision bf16``, the buffers stored as ``bfloat16`` and the
  node-sized ones kept float32 with the reason (``gcomp/codegen/precision.py``).
* ``specialized``: for a plan compiled for one graph (``gcomp/codegen/specialize.py``),
  the graph's name and sizes and the decisions made for it; empty otherwise.
* training plans: ``loss`` (buffer of the scalar loss) and ``grads``
  (parameter -> gradient buffer); their ``steps`` end with the optimizer
  updates, so one pass over ``steps`` is one whole training step.
* ``caller_order`` on a step (CPU): the form of it that reads a node input in the caller's
  node order where the runtime numbers nodes anew (``gcomp/codegen/caller_order.py``).
* ``loss_rows`` (CPU training plans): ``{"mask": input}`` when steps may run on the rows
  of that mask alone, numbered first (``gcomp/codegen/loss_rows.py``): the dimension
  ``"L"`` is their count (N when the runtime does not order them first), a step marked
  ``"rows": "L"`` runs on rows [0, L), graph arguments with ``"rows": "L"`` are
  ``indptr``'s first L + 1 entries or the CSC arrays of the edges into those rows
  (``"E:<graph>|L"`` of them), and ``"tail"`` steps zero rows [L, N) of a gradient;
  the runtime skips them when L is N.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PLAN_VERSION = 4  # 2: feed_steps, feed kernels, variants of computed values (1 still runs)
#                    3: the GPU's hub tasks carry their row (t x 3; 2 still runs on the CPU)
#                    4: loss rows (dimension "L", restricted CSC arrays, tail steps)
HUB_TASKS_VERSION = 3  # the first plan version whose kernels read t x 3 hub tasks
FEED_PARTS = 64  # row ranges of an input's feed kernel, each with a flag in its output
NONFINITE = 0x7F800000  # a flag whose range holds a NaN or an infinity (float exponent bits)
GRAPH_ARRAYS = ("indptr", "indices", "rows", "perm", "csc_indptr", "csc_indices", "csc_eid",
                "origin")


def kernel_kind(name: str) -> str:
    """The kind of a plan's kernel from its symbol, as ``KernelSpec.name`` writes it
    (``gc_<kind>_<digest>``)."""
    return name[len("gc_"):].rsplit("_", 1)[0]


@dataclass
class Plan:
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    graphs: list[dict] = field(default_factory=list)
    buffers: dict[str, dict] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)
    consts: dict[str, float | list] = field(default_factory=dict)
    state: list[str] = field(default_factory=list)
    loss: str | None = None
    grads: dict[str, str] = field(default_factory=dict)
    variants: dict[str, dict] = field(default_factory=dict)
    formats: dict = field(default_factory=dict)
    specialized: dict = field(default_factory=dict)
    alignment: dict[str, list[int]] = field(default_factory=dict)
    precision: dict = field(default_factory=dict)
    loss_rows: dict = field(default_factory=dict)
    bind_steps: list[dict] = field(default_factory=list)
    feed_steps: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    version: int = PLAN_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Plan":
        return Plan(**d)

    def kernels(self) -> list[str]:
        seen = {}
        for s in self.bind_steps + self.feed_steps + self.steps:
            seen.setdefault(s["kernel"], None)
            if "kernel" in s.get("caller_order", {}):
                seen.setdefault(s["caller_order"]["kernel"], None)
            for alt in ("kernels", "pack"):
                for k in s.get("formats", {}).get(alt, {}).values():
                    seen.setdefault(k, None)
        for d in self.inputs + list(self.variants.values()):
            for key in ("feed_kernel", "check_kernel", "match_kernel"):
                if key in d:
                    seen.setdefault(d[key], None)
        return list(seen)
