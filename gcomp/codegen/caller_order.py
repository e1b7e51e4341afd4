"""Node features read where the caller keeps them, in the caller's node order.

The runtime may number a graph's nodes anew when it binds it (an order for locality,
the training mask's nodes first: ``runtime/executor.py``, ``decide_layout``); every
node tensor is then in that order, and node features the kernels would have read in
the caller's own array were copied into it row by row (87 MB for arxiv-size 128-wide
features).  The kernels that read the features in most models can read them in the
caller's order instead: a product ``x @ w`` or weight gradient ``x.T @ dy`` reads x in
its own order and writes the narrower output's rows (reads ``dy``'s) at the bound row
of each (``cpu_kernels``: ``x_order``), and an aggregation gathers source rows at
indices mapped through the order once per bound graph.

Expects: lowered CPU plans whose node inputs have their ``check_kernel``
(``compiler._add_feed_kernels``), after the precision pass, and the specs of their
kernels; ``target`` the target they are compiled for.
Guarantees: a feed or run step that reads a float32 node input ``x`` once, with a
kernel that can read it in the caller's order, carries ``"caller_order"``:

* ``{"kernel": K, "arg": i, "via": "rows"}``: kernel K computes what the step's kernel
  does, with argument i, x, whole and in the caller's order, and one more argument: the
  int64 bound row of each of x's rows (the order's inverse); rows bound at or past the
  step's row count (where it runs on the loss's rows) are skipped;
* ``{"arg": i, "via": "indices"}``: the step's own kernel, an aggregation over CSR
  arrays, with its ``indices`` (argument 1) mapped through the order.

Only float32 products without a second product, the bfloat16 copy of the features
(``round_rows``, --precision bf16) and aggregations that no adjacency format may
replace; the runtime uses the forms where every step that reads an input
has one (reading it in the caller's array or copying it in unpermuted), and the steps
as they are otherwise.
"""

from __future__ import annotations

from gcomp.codegen.kernels import KernelSpec, target_definition
from gcomp.runtime.plan import Plan

_PRODUCTS = ("matmul", "matmul_tn")  # x is their first argument


def offer_caller_order(plans, specs: dict, target: dict) -> None:
    """Mark the steps of ``plans`` (module docstring), adding the kernels to ``specs``."""
    for plan in plans:
        if plan is not None:
            _offer(plan, specs, target)


def _offer(plan: Plan, specs: dict, target: dict) -> None:
    inputs = {i["name"] for i in plan.inputs
              if i["role"] == "node" and "check_kernel" in i
              and plan.buffers[i["name"]]["dtype"] == "float32"}
    for step in plan.feed_steps + plan.steps:
        roots = [plan.buffers[a["buf"]].get("alias", a["buf"]) if "buf" in a else None
                 for a in step["args"]]
        found = [i for i, r in enumerate(roots) if r in inputs]
        if len(found) != 1:  # an input read twice (x and an epilogue's x) keeps the copy
            continue
        i, spec = found[0], specs[step["kernel"]]
        a, dims = step["args"][i], plan.buffers[roots[i]]["dims"]
        stored = spec.p.get("bf16", ())
        if "x" in stored or a["buf"] != roots[i] or a.get("view", dims)[1:] != dims[1:]:
            continue  # bfloat16 copies, and reshaped views, are no rows of the caller's
        if (spec.kind in _PRODUCTS and i == 0 and not stored and not spec.p.get("K2")
                or spec.kind == "round_rows"):
            ordered = KernelSpec.make(spec.kind, **spec.p, x_order=True)
            if target_definition(ordered, target) is not None:  # else the scheduled kernel
                specs[ordered.name] = ordered
                step["caller_order"] = {"kernel": ordered.name, "arg": i, "via": "rows"}
        elif (spec.kind == "csr_agg" and "formats" not in step
              and step["args"][1].get("array") in ("indices", "csc_indices")
              and i == _gathered_arg(step, spec)):
            step["caller_order"] = {"arg": i, "via": "indices"}


def _gathered_arg(step: dict, spec: KernelSpec) -> int:
    """The position of x, the gathered rows, among an aggregation's arguments: before
    its epilogue's extras and its output (as lowering's ``formats["tail"]``)."""
    return len(step["args"]) - len(spec.p.get("extras", ())) - 2
