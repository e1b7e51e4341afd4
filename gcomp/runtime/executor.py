"""Execute a plan with compiled kernels.  Needs the TVM runtime only.

``Executor(plan, lib, params, store)`` owns (or shares, through ``store``) the
tensors that outlive a graph: parameters, constants and plan ``state``
(optimizer moments, step counters).  A training executor and its evaluation
executor share one store, so both see the same parameters with no copies.

``bind(graph)`` prepares everything that depends on one graph, once: graph
arrays, buffers sized for its node and edge counts (intermediates share storage
by liveness: ``gcomp/runtime/memory.py``), views, edge inputs, and the
bind-phase kernels (degrees, normalizations); the last binding is cached.
``feed(binding, values)`` checks node inputs and copies them in, or, on the CPU,
points the kernels at the caller's float32 array itself where they can read it
there (no reordering; C order; an alignment every reader accepts): the binding then
reads that array until the next feed.  It runs the feed-phase kernels (values
computed from node inputs alone, e.g. a training step's aggregated features), and
binds again where features (or values computed from them) no longer hold the
nonzeros the sparse-feature kernels were bound with (changed in place).
``execute(binding)`` calls the run-phase kernels in order; no allocation and no
numpy arithmetic happens there.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import tvm
import tvm_ffi

from gcomp.errors import InputError
from gcomp.runtime.data import (GraphData, check_edge_values, check_features, check_graph,
                                check_sparse)
from gcomp.runtime import formats as fmts
from gcomp.runtime.features import SparseFeatures, sparse_enough
from gcomp.runtime.graph import GraphStructure, from_csr_order
from gcomp.runtime.cuda_graph import CudaGraph, key_of
from gcomp.runtime.host_heap import release_free_heap
from gcomp.runtime.memory import ITEMSIZE, plan_memory
from gcomp.runtime.plan import FEED_PARTS, NONFINITE, Plan
from gcomp.runtime.reorder import (choose_order, first_rows, inverse, mask_first, rcm_order,
                                   relabel)

# increasing runs of the caller's rows in a node order up to which a training binding
# reads the features in the caller's order (``caller_order.py``): arxiv-size 128 -> 32
# products, AMD EPYC Zen 4, the mask's 60% first (2 runs) 6.9 ms either way, a random
# order 6.9 -> 8.8 ms (rows of the output written at random)
ORDER_SWEEPS = 8


def _feature_arrays(features: dict | None, n: int, ranks: dict) -> dict | None:
    """Node inputs as arrays (a list: numpy's view of it) of a row per node and the rank
    ``ranks`` gives their name, before the graph's layout and variants read their
    statistics (values are checked when fed)."""
    if not features:
        return features
    out = {}
    for k, v in features.items():
        a = v if sp.issparse(v) or isinstance(v, np.ndarray) else np.asarray(v)
        if a.shape[:1] != (n,) or a.ndim != ranks.get(k, a.ndim):
            want = "[N, F]" if ranks.get(k) == 2 else "a row per node"
            raise InputError(f"input {k!r} must be {want} with N = {n} (the graph's nodes), "
                             f"got shape {tuple(a.shape)}")
        out[k] = a
    return out


def _edge_arrays(graph: GraphData) -> tuple:
    return graph.edge_index, graph.edge_weight


@dataclass
class Binding:
    graph: GraphData
    # graph value -> its edges' canonical ids in CSR order, for the edge outputs alone: the
    # bound structures' other arrays (argsorts, self-loop origins) only derive the kernels'
    # arrays, and kept they would be live at the first steps' peak
    edge_perm: dict[str, np.ndarray]
    dims: dict[str, int]
    buffers: dict[str, object]
    steps: list = field(default_factory=list)  # (function, args) in order
    feed_steps: list = field(default_factory=list)  # (plan step, function, args), per feed
    bind_time_s: float = 0.0
    memory: dict = field(default_factory=dict)  # gcomp.runtime.memory.MemoryPlan.summary()
    variants: set = field(default_factory=set)  # active kernel variants (plan.variants)
    features_src: dict = field(default_factory=dict)  # ids of the features bound with
    order: np.ndarray | None = None  # node order[i] of the user's graph is row i (reorder.py)
    reorder: dict = field(default_factory=dict)  # the cost model's numbers
    formats: dict = field(default_factory=dict)  # graph value -> format report (formats.py)
    plan_steps: list = field(default_factory=list)  # the plan step of each entry of steps
    reads: set = field(default_factory=set)  # buffers the bound steps use (feed skips others)
    choices: tuple = ()  # the executor's reorder, formats and forced variants when bound
    # the graph's node count and edge arrays when bound (held: their ids stay theirs): a
    # GraphData given new arrays is bound again
    arrays: tuple = ()
    # node input -> {"need": alignment, "uses": [(list, index, arg, shape, own tensor)]}:
    # where the kernels may read it in the caller's array (Executor._in_place_uses)
    in_place: dict = field(default_factory=dict)
    # node inputs the kernels read in the caller's node order, through ``order``
    # (codegen/caller_order.py): fed as given, never permuted
    caller_order: set = field(default_factory=set)
    # values (an input or a feed step's result) -> the SparseFeatures their sparse-feature
    # kernels read, and those arrays as kernel arguments (Executor._moved)
    sparse: dict = field(default_factory=dict)
    sparse_args: dict = field(default_factory=dict)
    runs: int = 0  # execute() calls; a CUDA graph is captured at the second
    cuda_graph: object = None  # gcomp.runtime.cuda_graph.CudaGraph of the steps

    def reads_callers(self, name: str) -> bool:
        """Whether the kernels read node input ``name`` in the caller's array (last feed)."""
        uses = self.in_place.get(name, {}).get("uses", ())
        return bool(uses) and all(getattr(self, seq)[k][-1][i] is not own
                                  for seq, k, i, _, own in uses)


def _aligned_bytes(nbytes: int, align: int = 4096) -> np.ndarray:
    """A uint8 array of ``nbytes`` starting on an ``align``-byte boundary."""
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes]


class _ReadOnly:
    """A read-only array's memory, exported as writeable (below); holds the array."""

    def __init__(self, a: np.ndarray):
        self.array = a
        face = a.__array_interface__
        self.__array_interface__ = {**face, "data": (face["data"][0], False)}


def _dlpack(a: np.ndarray, **kw):
    """A tensor over ``a``'s memory.  numpy does not export a read-only array (an
    ``np.load(..., mmap_mode="r")`` file, a frozen buffer) through DLPack; the kernels
    given these arrays only read them (features read in place, graph arrays), so such an
    array goes as a writeable view of the same memory, which keeps it alive."""
    if not a.flags.writeable:
        a = np.asarray(_ReadOnly(a))
    return tvm_ffi.from_dlpack(a, **kw)


def _view(storage: np.ndarray, offset: int, shape: tuple, dtype: str):
    """A tensor of ``shape`` and ``dtype`` over ``storage`` bytes from ``offset``
    (bfloat16 through a uint16 view: numpy's DLPack export has no bfloat16)."""
    size = int(np.prod(shape)) * ITEMSIZE[dtype]
    view = storage[offset:offset + size].view("uint16" if dtype == "bfloat16" else dtype)
    t = tvm_ffi.from_dlpack(view.reshape(shape))
    return t._create_view(shape, dtype) if dtype == "bfloat16" else t


def _alignment(a: np.ndarray) -> int:
    """The largest power of two dividing the address of ``a``'s first element."""
    addr = a.ctypes.data
    return addr & -addr if addr else 1 << 62


def _rows(a, order):
    return a[order] if a is not None and hasattr(a, "shape") and len(a.shape) >= 1 else a


def _resolve(dims: list, sizes: dict[str, int]) -> tuple:
    return tuple(sizes[d] if isinstance(d, str) else int(d) for d in dims)


def row_bytes(plan: Plan) -> int:
    """Bytes of the widest node-tensor row (the gathered working set per node)."""
    widths = [int(np.prod([d for d in b["dims"][1:]])) * 4 for b in plan.buffers.values()
              if b["dims"] and b["dims"][0] == "N"]
    return max(widths, default=4)


@dataclass
class Layout:
    """Where a bound graph's rows go and how its adjacency is stored."""
    order: np.ndarray | None  # order[i]: the user's node at row i (None: as given)
    graph: GraphData  # in that order, without its features (fed in that order: Executor._put)
    features: dict | None
    structures: dict[str, GraphStructure]
    sizes: dict[str, int]  # N, E:<graph>
    reorder: dict  # the node-order cost model's numbers (reorder.py)
    chosen: dict[str, str]  # graph value -> adjacency format
    formats: dict  # the format cost model's numbers (formats.py)
    block: int  # rows per block of the banded format in this order


def structures_of(plan: Plan, graph: GraphData, order) -> dict[str, GraphStructure]:
    """CSR/CSC structure of every graph value of the plan, for the (reordered) graph."""
    structures: dict[str, GraphStructure] = {}
    for gspec in plan.graphs:
        if gspec["parent"] is None:
            structures[gspec["name"]] = GraphStructure.from_edge_index(graph.edge_index,
                                                                      graph.num_nodes)
        else:
            structures[gspec["name"]] = structures[gspec["parent"]].derive(gspec["mode"], order)
    return structures


def decide_layout(plan: Plan, graph: GraphData, features: dict | None = None,
                  reorder: str = "auto", formats: str = "auto", structures=None,
                  gpu: bool = False, loss_rows: np.ndarray | None = None) -> Layout:
    """The node order and adjacency formats for ``graph`` (numpy only, no device):
    the order by the gather-distance model, then the formats by theirs; when the banded
    format is wanted, or would be the fastest in a band as narrow as the degrees allow,
    reverse Cuthill-McKee is tried and kept if it narrows the band.
    ``structures(graph, order)`` builds the graph values (default ``structures_of``; the
    distributed runtime builds shards); ``gpu``: the order for CUDA's kernels.
    ``loss_rows``: the training mask of a plan with ``loss_rows`` (the user's node order):
    its nodes are numbered first, each part in the chosen order, and the size ``"L"`` is
    their count where every aggregation stays CSR (N otherwise: the other formats'
    kernels compute every row)."""
    structures = structures or (lambda g, o: structures_of(plan, g, o))

    def arrange(order):
        g, f = graph, features
        if order is not None:  # every node-indexed array below uses the new numbering
            g = relabel(graph, order, x=False)  # choose_variants takes x in the given order
            f = {k: _rows(v, order) for k, v in (features or {}).items()}
        st = structures(g, order)
        sizes = {"N": g.num_nodes, "L": g.num_nodes}
        sizes.update({f"E:{k}": v.num_edges for k, v in st.items()})
        sizes.update({f"E:{k}|L": v.num_edges for k, v in st.items()})
        if use_formats:
            sizes.update(fmts.graph_sizes(plan, st))
        return g, f, st, sizes, fmts.band_block(g.edge_index) if use_formats else 0

    steps = fmts.format_steps(plan)
    use_formats = formats != "csr" and bool(plan.formats) and bool(steps)
    if formats not in ("auto", "csr") and not use_formats:
        if plan.specialized:  # compiling for one graph left the kernels out
            raise InputError(f"format {formats!r}: this artifact has only CSR kernels (it "
                             f"was compiled for graph {plan.specialized['graph']!r}, whose "
                             "formats were chosen then; compile without --graph to keep "
                             "every format)")
        # a forced format nothing can run in is an error, not a silent CSR run
        raise InputError(f"format {formats!r}: no aggregation of this artifact has kernels "
                         "for it (GAT's fused attention has one layout, CSR, and CUDA "
                         "artifacts aggregate in CSR); use --format auto or csr")

    def choose(sizes, block, mode, narrowest=None):
        if not use_formats:
            return {}, {}
        return fmts.choose(plan, sizes, block, narrowest, mode)

    made: dict = {}  # the orders the node-order model computed
    order, reorder_report = choose_order(graph, row_bytes(plan), reorder, gpu, made)
    if loss_rows is not None and reorder != "none":
        order = mask_first(order, loss_rows)
    # before the structures exist: the symmetrized graph (RCM's, if the order model made
    # one) and they are not held at once
    pattern = made.pop("pattern", None)
    narrowest = (fmts.narrowest_block(graph.edge_index, graph.num_nodes, pattern)
                 if use_formats else None)
    del pattern
    g, f, st, sizes, block = arrange(order)
    chosen, report = choose(sizes, block, "auto", narrowest)
    if (reorder in ("auto", "rcm") and reorder_report["chosen"] != "rcm"
            and fmts.band_would_pay(report, formats)):
        rcm = made["rcm"] if "rcm" in made else rcm_order(graph)  # RCM narrows the band
        # of graphs that have one.  Its band is measured on the renumbered edges before the
        # structures are built in its order, and kept only where the banded format fits
        # in it: a graph without a band, the common case, was built in both orders and
        # kept in RCM's, however little it narrowed (with the rest of this binding's
        # changes, a GCN training plan on 20M random edges: 19.0 -> 5.3 s, peak 2,270 ->
        # 1,318 MB above the process; README, Graph preparation at bind time)
        band = fmts.band_block(graph.edge_index, inverse(rcm))
        if band < block and fmts.feasible("banded", graph.num_nodes, band) is None:
            order, (g, f, st, sizes, block) = rcm, arrange(rcm)
            reorder_report.update(chosen="rcm", reason="narrows the band of the banded format")
            chosen, report = choose(sizes, block, "auto")
    if formats != "auto":
        chosen, report = choose(sizes, block, formats)
    in_csr = all(fmt == "csr" for fmt in chosen.values())
    count = first_rows(order, loss_rows) if loss_rows is not None and in_csr else None
    if count is None and loss_rows is not None and in_csr and reorder != "none":
        # RCM, tried for the banded format, came out CSR: the mask's nodes go first in it
        order = mask_first(order, loss_rows)
        g, f, st, sizes, block = arrange(order)
        count = first_rows(order, loss_rows)
    if count is not None:
        sizes["L"] = count
        sizes.update({f"E:{k}|L": v.into_first(count).num_edges for k, v in st.items()})
        reorder_report["loss_rows"] = count
    return Layout(order, g, f, st, sizes, reorder_report, chosen, report, block)


def edge_input_values(graph: GraphData, inp: dict) -> np.ndarray:
    """``graph``'s edge_weight, checked, as the plan's edge input ``inp`` takes it."""
    if graph.edge_weight is None:
        raise InputError(f"the model needs edge values {inp['name']!r}, and graph "
                         f"{graph.name!r} has no edge_weight")
    w = check_edge_values(graph.edge_weight, graph.num_edges, f"{graph.name}: edge_weight")
    want = tuple(inp["dims"][1:])
    if w.shape[1:] != want:
        raise InputError(f"edge values {inp['name']!r} must have shape (E, "
                         f"{', '.join(map(str, want))}), got {w.shape}")
    return w


class Executor:
    feeds_in_place = True  # runtimes that rewrite the bound steps (distributed) turn it off

    def __init__(self, plan: Plan, lib, params: dict[str, np.ndarray], store: dict | None = None,
                 device=None):
        self.plan = plan
        self.lib = lib
        self.device = device or tvm.cpu()
        # run() from several threads (a service's request handlers) takes turns: an executor
        # holds one binding at a time, and its buffers are that binding's
        self._lock = threading.RLock()
        self.on_cpu = self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        self.functions = {}
        for k in plan.kernels():
            try:
                self.functions[k] = lib[k]
            except Exception as e:  # noqa: BLE001 - a library without a kernel is corrupt
                raise InputError(f"compiled library lacks kernel {k}: {e}") from None
        self.store = store if store is not None else {}
        for name in plan.params:
            if name not in self.store:
                self.store[name] = self.tensor(params[name])
        for name, value in plan.consts.items():
            if name not in self.store:
                self.store[name] = self.tensor(np.asarray(value, np.float32))
        for name in plan.state:
            if name not in self.store:
                b = plan.buffers[name]
                self.store[name] = self.tensor(np.zeros(_resolve(b["dims"], {}), b["dtype"]))
        self._binding: Binding | None = None
        # node inputs whose every reading step has a form reading them through the order
        readers: dict[str, list] = {}
        for s in plan.feed_steps + plan.steps:
            for a in s["args"]:
                if "buf" in a:
                    readers.setdefault(plan.buffers[a["buf"]].get("alias", a["buf"]), []).append(s)
        self._caller_order_inputs = {i["name"] for i in self.node_inputs()
                                     if readers.get(i["name"]) and all(
                                         "caller_order" in s for s in readers[i["name"]])}
        self._feed_flags = tvm.runtime.empty((FEED_PARTS,), "int32", self.device)
        self._match_flags = tvm.runtime.empty((2 * FEED_PARTS,), "int32", self.device)
        self.force_variants: dict[str, bool] = {}  # variant key -> on/off, overriding the choice
        self.reorder = "auto"  # node order when binding: auto (cost model), none, rcm, degree
        self.formats = "auto"  # adjacency format: auto (cost model) or one of formats.FORMATS
        # a training plan's mask (the user's node order), whose rows a binding numbers first
        # so that the steps the loss alone needs run on them (codegen/loss_rows.py)
        self.loss_rows: np.ndarray | None = None
        # on a GPU, replay each binding's steps as one CUDA graph (runtime/cuda_graph.py)
        self.cuda_graphs = os.environ.get("GCOMP_CUDA_GRAPHS") == "1"

    def tensor(self, a: np.ndarray):
        a = np.array(a, order="C")  # np.array keeps 0-d shapes (ascontiguousarray does not)
        t = tvm.runtime.empty(a.shape, str(a.dtype), self.device)
        t.copyfrom(a)
        return t

    def set(self, name: str, value) -> None:
        """Overwrite a stored tensor (a parameter, state or scalar input) in place."""
        t = self.store[name]
        t.copyfrom(np.array(value, dtype=t.dtype, order="C").reshape(t.shape))

    def get(self, name: str) -> np.ndarray:
        return self.store[name].numpy()

    # ------------------------------------------------------------------ binding
    def choose_variants(self, x_given, features: dict | None, order) -> tuple[set, dict]:
        """Active variants for this graph, and the sparse features they need: node inputs
        ``features`` (in the bound ``order``), else the graph's ``x_given`` (in the user's
        order: its rows are put in ``order`` only where a variant needs its nonzeros, so
        that a bound order costs no copy of dense features here)."""
        active, sparse = set(), {}
        for key, v in self.plan.variants.items():
            if "sources" in v:  # computed by feed steps: _computed_variants measures them
                continue
            fed = v["input"] in (features or {})
            x = features[v["input"]] if fed else x_given
            forced = self.force_variants.get(key)
            on = forced if forced is not None else sparse_enough(x, v["threshold"])
            if on and x is not None:
                active.add(key)
                sparse[v["input"]] = SparseFeatures(x if fed or order is None
                                                    else _rows(x, order))
        return active, sparse

    def bind(self, graph: GraphData, features: dict | None = None,
             again: bool = False) -> Binding:
        """Prepare ``graph`` (and, for sparse-feature variants, ``features``; default the
        graph's own ``x``); the last binding is reused for the same objects and the same
        choices (``reorder``, ``formats``, ``force_variants``) unless ``again``."""
        b = self._binding
        choices = (self.reorder, self.formats, tuple(sorted(self.force_variants.items())),
                   None if self.loss_rows is None else id(self.loss_rows))
        if (not again and b is not None and b.graph is graph and b.choices == choices
                and len(b.arrays) == 3 and b.arrays[0] == graph.num_nodes
                and all(x is y for x, y in zip(b.arrays[1:], _edge_arrays(graph)))
                and all(b.features_src.get(k) == id(v) for k, v in (features or {}).items()
                        if k in b.features_src)):
            return b
        b = self._bind_new(graph, features, choices)
        # the preparation's scratch (argsorts, relabelled edges, the structures they built)
        # is free once it returns, but the C heap keeps what it freed between live blocks;
        # handed back before the buffers are first written (arxiv-size GCN's training
        # peak RSS above the imports 384 -> 296 MB with the structures freed then, not at
        # the collector's next pass)
        release_free_heap()
        return b

    def _bind_new(self, graph: GraphData, features: dict | None, choices: tuple) -> Binding:
        t0 = time.perf_counter()
        user_graph, user_features = graph, features
        graph = check_graph(graph)
        features = _feature_arrays(features, graph.num_nodes,
                                   {i["name"]: len(i["dims"]) for i in self.plan.inputs
                                    if i["role"] == "node"})
        x_given = graph.x
        lay = decide_layout(self.plan, graph, features, self.reorder, self.formats,
                            self._structures, gpu=not self.on_cpu,
                            loss_rows=self.loss_rows if self.plan.loss_rows else None)
        order, graph, features, structures, sizes = (lay.order, lay.graph, lay.features,
                                                     lay.structures, lay.sizes)
        active, sparse = self.choose_variants(x_given, features, order)
        sizes.update({f"NNZ:{k}": f.nnz for k, f in sparse.items()})
        sizes.update({f"NNZ:{v['input']}": 0 for v in self.plan.variants.values()
                      if v["input"] not in sparse})
        buffers: dict[str, object] = dict(self.store)
        # slots carved out of a larger one are views at an offset, which the kernels take
        # only as tensors of their own (byte_offset 0): numpy views, on the CPU
        memory = plan_memory(self.plan, sizes, self.store, carve=self.on_cpu)
        if self.on_cpu:
            storage = [_aligned_bytes(nb) for nb in memory.storage_bytes]
        else:
            storage = [tvm.runtime.empty(((nb + 7) // 8,), "int64", self.device)
                       for nb in memory.storage_bytes]
        for name, b in self.plan.buffers.items():  # roots first, then views of them
            if name not in buffers and "alias" not in b:
                shape = _resolve(b["dims"], sizes)
                if name in memory.slots:  # shares storage with buffers it never overlaps
                    st, offset = memory.slot_at[memory.slots[name]]
                    if self.on_cpu:
                        buffers[name] = _view(storage[st], offset, shape, b["dtype"])
                    else:
                        buffers[name] = storage[st]._create_view(shape, b["dtype"])
                else:
                    buffers[name] = tvm.runtime.empty(shape, b["dtype"], self.device)
        for name, b in self.plan.buffers.items():
            if "alias" in b:
                buffers[name] = buffers[b["alias"]]._create_view(_resolve(b["dims"], sizes))
        arrays: dict[tuple, object] = {}
        # tensors that are node inputs, or views of them: id -> (input, tensor)
        roots = {i["name"] for i in self.node_inputs() if "check_kernel" in i
                 and self.feeds_in_place}
        root_of = {n: b.get("alias", n) for n, b in self.plan.buffers.items()
                   if b.get("alias", n) in roots}
        derived = {id(buffers[n]): (r, buffers[n]) for n, r in root_of.items()}

        first = sizes["L"] if sizes["L"] < sizes["N"] else None  # loss rows, numbered first

        into_first: dict[str, GraphStructure] = {}  # edges into the loss rows alone

        def graph_array(gname: str, array: str, rows: str | None = None, through=None):
            key = (gname, array, rows, through is not None)
            if key not in arrays:
                a = structures[gname].array(array)
                if rows is not None and first is not None:  # codegen/loss_rows.py
                    if array != "indptr" and gname not in into_first:
                        into_first[gname] = structures[gname].into_first(first)
                    a = (a[:first + 1] if array == "indptr"
                         else into_first[gname].array(array))
                if through is not None:  # rows numbered as the caller's (caller_order.py)
                    a = through[a].astype(a.dtype)
                # on the CPU the kernels read the structure's own arrays (a copy would
                # double the graph's memory: 20 MB of CSR and CSC on arxiv-size); not
                # empty ones, whose numpy strides TVM calls non-compact
                arrays[key] = (_dlpack(np.ascontiguousarray(a))
                               if self.on_cpu and a.size else tvm.runtime.tensor(a, self.device))
            return arrays[key]

        def args_of(step):
            out = []
            for a in step["args"]:
                if "graph" in a:
                    out.append(graph_array(a["graph"], a["array"], a.get("rows")))
                elif "nodes" in a:  # the user's id of each row
                    key = ("nodes", a.get("rows"))
                    if key not in arrays:
                        ids = self._node_ids(graph, order).astype(np.int64)
                        arrays[key] = tvm.runtime.tensor(
                            ids[:_resolve([a["rows"]], sizes)[0]] if "rows" in a else ids,
                            self.device)
                    out.append(arrays[key])
                elif "features" in a:
                    key = ("features", a["features"], a["array"])
                    if key not in arrays:
                        arrays[key] = tvm.runtime.tensor(sparse[a["features"]].array(a["array"]),
                                                         self.device)
                    out.append(arrays[key])
                elif "view" in a:
                    out.append(buffers[a["buf"]]._create_view(_resolve(a["view"], sizes)))
                    if a["buf"] in root_of:
                        derived[id(out[-1])] = (root_of[a["buf"]], out[-1])
                else:
                    out.append(buffers[a["buf"]])
            return tuple(out)

        bound_from = {src: id((user_features or {}).get(src, user_graph.x))
                      for v in self.plan.variants.values()
                      for src in v.get("sources", [v["input"]])}
        edge_perm = {o["graph"]: structures[o["graph"]].perm
                     for o in self.plan.outputs if o["role"] == "edge"}
        b = Binding(user_graph, edge_perm, sizes, buffers, memory=memory.summary(),
                    variants=active, features_src=bound_from, order=order,
                    arrays=(user_graph.num_nodes, *_edge_arrays(user_graph)),
                    reorder=lay.reorder, formats=lay.formats, choices=choices)
        for inp in self.plan.inputs:
            if inp["role"] == "edge":
                w = self._edge_input(graph, inp)
                buffers[inp["name"]].copyfrom(structures[inp["graph"]].to_csr_order(w))
        self._run_bind_steps(b, [(s, self.functions[s["kernel"]], args)
                                 for s in self.plan.bind_steps
                                 for args in [args_of(s)] if self._launchable(args)])
        self._check_degrees(b)

        def selected(steps):
            return [(s, args) for s in steps
                    if s.get("when", None) in active | {None} and s.get("unless") not in active
                    and not (s.get("tail") and first is None)  # no rows past the loss's
                    for args in [args_of(s)] if self._launchable(args)]
        # with the nodes numbered anew, kernels read the features in the caller's order:
        # where inputs are fed for every run, or the order sweeps the caller's rows in a
        # few increasing runs (the training mask's rows first); a training step reading
        # them in a scattered order would pay each step for what a copy pays once
        sweeps = 1 + int(np.count_nonzero(np.diff(order) < 0)) if order is not None else 0
        b.caller_order = (self._caller_order_inputs & roots
                          if order is not None and self.on_cpu
                          and (self.plan.loss is None or sweeps <= ORDER_SWEEPS) else set())

        def through_order(s, args):
            g = s.get("caller_order")
            root = root_of.get(s["args"][g["arg"]]["buf"]) if g else None
            if root not in b.caller_order:
                return s, args
            args = list(args)
            if g["via"] == "indices":
                a = s["args"][1]
                args[1] = graph_array(a["graph"], a["array"], a.get("rows"), through=order)
                return s, tuple(args)
            if "rows" not in arrays:  # the bound row of each of the caller's rows
                arrays["rows"] = _dlpack(inverse(order).astype(np.int64))
            args[g["arg"]] = buffers[root]
            return {**s, "kernel": g["kernel"]}, (*args, arrays["rows"])
        b.feed_steps = [(s, self.functions[s["kernel"]], args) for s, args in
                        (through_order(*e) for e in selected(self.plan.feed_steps))]
        b.sparse = sparse  # _computed_variants adds the values it measures
        b.in_place = self._in_place_uses(b, derived, root_of)  # the feed steps' uses
        self._computed_variants(b, user_features, active, sparse)
        run = selected(self.plan.steps)
        run, layouts = self._in_formats(run, lay, graph_array, args_of)
        run = [through_order(*e) for e in run]
        b.memory["layout_bytes"] = sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
                                       for t in layouts)
        b.memory["total_bytes"] += b.memory["layout_bytes"]
        b.steps = [(self.functions[s["kernel"]], args) for s, args in run]
        b.plan_steps = [s for s, _ in run]
        used = {a["buf"] for s, _ in run + [f[::2] for f in b.feed_steps]
                for a in s["args"] if "buf" in a}
        used |= {o["buffer"] for o in self.plan.outputs}
        b.reads = used | {self.plan.buffers[u].get("alias", u) for u in used
                          if u in self.plan.buffers}
        b.in_place = self._in_place_uses(b, derived, root_of)
        b.bind_time_s = time.perf_counter() - t0
        self._binding = b  # one binding at a time: buffers are sized per graph
        return b

    def _in_place_uses(self, b: Binding, derived: dict, root_of: dict) -> dict:
        """Where each node input in ``derived`` is a kernel argument, and the alignment
        those kernels need (``plan.alignment``; 64, the largest, when not recorded).
        Not for an input that is also an output (outputs() reads the buffers)."""
        out_roots = {root_of[o["buffer"]] for o in self.plan.outputs if o["buffer"] in root_of}
        found: dict[str, dict] = {}
        for seq, kernels in (("steps", [s["kernel"] for s in b.plan_steps]),
                             ("feed_steps", [s["kernel"] for s, _, _ in b.feed_steps])):
            for k, entry in enumerate(getattr(b, seq)):
                need = self.plan.alignment.get(kernels[k], [])
                for i, a in enumerate(entry[-1]):
                    root, t = derived.get(id(a), (None, None))
                    if t is a and root not in out_roots:
                        use = found.setdefault(root, {"need": 4, "uses": []})
                        use["need"] = max(use["need"], need[i] if i < len(need) else 64)
                        use["uses"].append((seq, k, i, tuple(a.shape), a))
        return found

    def _read_from(self, b: Binding, name: str, value: np.ndarray | None) -> None:
        """Point the kernels reading node input ``name`` at the caller's ``value``, or
        back at the binding's own buffer (None)."""
        flat = value.reshape(-1) if value is not None else None
        for seq, k, i, shape, own in b.in_place.get(name, {}).get("uses", ()):
            steps = getattr(b, seq)
            if value is None:
                t = own
            else:
                view = flat[:int(np.prod(shape))].reshape(shape)
                t = _dlpack(view, require_alignment=0)
            args = list(steps[k][-1])
            args[i] = t
            steps[k] = (*steps[k][:-1], tuple(args))

    def _computed_variants(self, b: Binding, features: dict | None, active: set,
                           sparse: dict) -> None:
        """Decide the sparse variants of values the feed steps compute from the features
        (``plan.variants`` with ``sources``): their sparsity is known once computed, so
        feed the sources bound with, run the feed steps and measure."""
        inputs = {i["name"]: i for i in self.node_inputs()}
        # the graph's own x feeds the first float matrix input
        default = next((k for k, i in inputs.items()
                        if i.get("dtype", "float32") == "float32" and len(i["dims"]) == 2), None)
        todo = {k: v for k, v in self.plan.variants.items() if "sources" in v
                and self.force_variants.get(k) is not False
                and all(s in (features or {}) or s == default for s in v["sources"])}
        if not todo:
            return
        sources = {s for v in todo.values() for s in v["sources"]}
        for src in sources:
            x = (features or {}).get(src, b.graph.x)
            # the feed steps read them (in place where they can) before the run steps
            # are known
            self._put(b, inputs[src], x if x is not None else b.graph.dense_x(), read=True)
        self._run_feed_steps(b)
        for src in sources:  # back to the own buffers: bind() finds the uses again
            self._read_from(b, src, None)
        for key, v in todo.items():
            t = b.buffers[v["input"]]
            # measured where it lies: a copy (87 MB for GraphSAGE's arxiv-size mean of x)
            # would set the bind's peak; numpy has no bfloat16 to view it as
            z = np.from_dlpack(t) if self.on_cpu and t.dtype == "float32" else t.numpy()
            forced = self.force_variants.get(key)
            if forced if forced is not None else sparse_enough(z, v["threshold"]):
                active.add(key)
                sparse[v["input"]] = SparseFeatures(z)

    def _in_formats(self, run: list, lay: Layout, graph_array, args_of) -> tuple[list, list]:
        """The run steps with aggregations in their chosen formats, and the layouts they
        read: each is packed once here when its weights are fixed for the graph, else by a
        step before its first use on every run."""
        if not any(f != "csr" for f in lay.chosen.values()):
            return run, []
        dynamic = fmts.dynamic_weights(self.plan)
        layouts, out = {}, []
        for s, args in run:
            f = s.get("formats")
            fmt = lay.chosen.get(f["graph"], "csr") if f else "csr"
            if fmt == "csr":
                out.append((s, args))
                continue
            wbuf = f["weights"]["buf"] if f["weights"] else None
            if fmt == "ell":
                key = (f["graph"], wbuf, fmt, f["transpose"])
                if key not in layouts:
                    layouts[key] = self._pack_ell(lay.structures[f["graph"]], f, args_of)
                out.append(({**s, "kernel": f["kernels"][fmt]},
                            layouts[key] + (args[0],) + tuple(args[f["tail"]:])))
                continue
            key = (f["graph"], wbuf, fmt)
            if key not in layouts:
                g = lay.structures[f["graph"]]
                layouts[key] = tvm.runtime.empty(fmts.layout_shape(fmt, g.num_nodes, lay.block),
                                                 "float32", self.device)
                weights = args_of({"args": [f["weights"]]}) if wbuf else ()
                pack_args = (graph_array(f["graph"], "indptr"), graph_array(f["graph"], "indices"),
                             *weights, layouts[key])
                pack = {"kernel": f["pack"][fmt], "node": s["node"], "op": "format_pack",
                        "attrs": {"format": fmt}, "args": []}
                if wbuf in dynamic:
                    out.append((pack, pack_args))
                else:
                    self.functions[pack["kernel"]](*pack_args)
            out.append(({**s, "kernel": f["kernels"][fmt]},
                        (layouts[key], args[0]) + tuple(args[f["tail"]:])))
        return out, [t for v in layouts.values() for t in (v if isinstance(v, tuple) else (v,))]

    def _pack_ell(self, st: GraphStructure, f: dict, args_of) -> tuple:
        """The ELL layout of a graph value's A (or A.T: from the CSC arrays, the weights
        permuted into CSC order), from weights fixed for the bound graph."""
        w = args_of({"args": [f["weights"]]})[0].numpy().reshape(-1) if f["weights"] else None
        if f["transpose"]:
            eid = st.array("csc_eid")
            arrays = fmts.pack_ell(st.array("csc_indptr"), st.array("csc_indices"),
                                   w[eid] if w is not None else None)
        else:
            arrays = fmts.pack_ell(st.indptr, st.indices, w)
        return tuple(tvm.runtime.tensor(a, self.device) for a in arrays)

    # hooks for runtimes that shard the graph (gcomp/distributed/halo.py overrides them)
    def _structures(self, graph: GraphData, order) -> dict[str, GraphStructure]:
        return structures_of(self.plan, graph, order)

    def _node_ids(self, graph: GraphData, order) -> np.ndarray:
        """The user's id of each node row (dropout masks hash it)."""
        return order if order is not None else np.arange(graph.num_nodes)

    def _run_bind_steps(self, binding: Binding, steps: list) -> None:
        """Run the bind-phase kernels: ``steps`` holds (plan step, function, args)."""
        for _, fn, args in steps:
            fn(*args)

    def _check_degrees(self, b: Binding) -> None:
        """GCN's normalization takes deg^-1/2 of each node's weighted degree: a negative one
        (negative edge weights) would make the outputs NaN; name the node instead."""
        for s in self.plan.bind_steps:
            if s["op"] == "sym_norm" and len(s["args"]) == 5:  # weighted: its degrees
                deg = b.buffers[s["args"][2]["buf"]].numpy()
                neg = np.flatnonzero(deg < 0)
                if neg.size:
                    i = int(neg[0])
                    node = int(b.order[i]) if b.order is not None else i
                    raise InputError(
                        f"graph {b.graph.name!r}: edge_weight gives node {node} the weighted "
                        f"degree {float(deg[i]):.4g} (its in-edge weights and self loop "
                        "summed); GCN's normalization deg^-1/2 needs it >= 0")

    def _run_feed_steps(self, binding: Binding) -> None:
        """Run the feed-phase kernels (``binding.feed_steps``) on the inputs just fed."""
        for _, fn, args in binding.feed_steps:
            fn(*args)

    def _launchable(self, args) -> bool:
        """False for a GPU kernel whose output (its last argument) is empty: its grid would
        have no blocks, which CUDA refuses (a graph without edges has empty edge tensors)."""
        if self.on_cpu or not args:
            return True
        shape = getattr(args[-1], "shape", None)
        return shape is None or all(int(d) > 0 for d in shape)

    def sync(self) -> None:
        """Wait for the device (GPU kernels run asynchronously; outputs() waits by itself)."""
        self.device.sync()

    @staticmethod
    def _edge_input(graph: GraphData, inp: dict) -> np.ndarray:
        return edge_input_values(graph, inp)

    # ------------------------------------------------------------------ running
    def node_inputs(self) -> list[dict]:
        return [i for i in self.plan.inputs if i["role"] == "node"]

    def feed(self, binding: Binding, values: dict[str, np.ndarray]) -> Binding:
        """Check node inputs (features; labels and masks for training) and copy them into
        their buffers, or have the kernels read them in place (``_put``).

        Returns the binding to execute: a new one when sparse-feature kernels were bound
        to other feature values, or to values since changed in place (their nonzero
        arrays belong to the binding).
        """
        names = [inp["name"] for inp in self.node_inputs()]
        unknown = sorted(set(values) - set(names))
        if unknown:  # a misspelt name would leave its values unused, silently
            raise InputError(f"unknown node input{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; the model's node inputs: "
                             f"{', '.join(map(repr, names)) or 'none'}")
        for k, v in values.items():
            if sp.issparse(v):  # scipy trusts the index arrays it holds
                check_sparse(v, k)
        bound = {k: v for k, v in values.items() if k in binding.features_src}
        if any(binding.features_src[k] != id(v) for k, v in bound.items()):
            binding = self.bind(binding.graph, bound)  # the last one, if bound with these
        if self._outside_loss_rows(binding, values):
            # the steps of the loss's rows were bound for another mask: number this one's first
            self.loss_rows = np.asarray(values[self.plan.loss_rows["mask"]]) != 0
            binding = self.bind(binding.graph, bound, again=True)
        checked: set = set()  # inputs _moved checked for NaN and Inf
        if any(k in binding.sparse and self._moved(binding, k, v, checked)
               for k, v in bound.items()):
            binding = self.bind(binding.graph, bound, again=True)  # changed in place
            checked.clear()
        self._feed_into(binding, values, checked)
        computed = [v["input"] for k, v in self.plan.variants.items()
                    if "sources" in v and k in binding.variants]
        if any(self._moved(binding, c, binding.buffers[c], set()) for c in computed):
            # values computed from features changed in place: measure and bind them again
            binding = self.bind(binding.graph, bound, again=True)
            self._feed_into(binding, values, set())
        return binding

    def _outside_loss_rows(self, b: Binding, values: dict) -> bool:
        """Whether the training mask in ``values`` marks a row past the first L, the rows
        ``b`` runs the loss's steps on (``codegen/loss_rows.py``)."""
        name = self.plan.loss_rows.get("mask")
        n, first = b.dims["N"], b.dims.get("L", b.dims["N"])
        if name not in values or first == n:
            return False
        m = np.asarray(values[name])
        if m.shape != (n,):
            return False  # _checked names the shape
        return bool(np.any((m if b.order is None else m[b.order])[first:] != 0))

    def _feed_into(self, binding: Binding, values: dict, checked: set) -> None:
        """Put every node input (those in ``checked`` only where a kernel reads them) and
        run the feed steps."""
        for inp in self.node_inputs():
            if inp["name"] not in values:
                raise InputError(f"missing node input {inp['name']!r}")
            if inp["name"] not in checked or inp["name"] in binding.reads:
                self._put(binding, inp, values[inp["name"]])
        self._run_feed_steps(binding)

    def _moved(self, b: Binding, name: str, value, checked: set) -> bool:
        """Whether ``value`` (node input or feed-step result ``name``) no longer holds the
        nonzeros its sparse-feature kernels were bound with, compared exactly by the
        variant's ``match_kernel`` in one read, which also checks features for NaN and
        Inf (a non-finite entry is named here; ``checked`` gets ``name``).
        Without that kernel, or for another layout of the features, it answers True:
        binding again extracts them anew."""
        kernel = next((v.get("match_kernel") for v in self.plan.variants.values()
                       if v["input"] == name), None)
        sf = b.sparse[name]
        if isinstance(value, np.ndarray):
            if (kernel is None or value.dtype != np.float32 or value.ndim != 2
                    or value.shape[1] != sf.num_features or len(value) != len(sf.indptr) - 1
                    or not value.flags.c_contiguous):
                return True
            array = value if b.order is None else np.ascontiguousarray(value[b.order])
            t = _dlpack(array, require_alignment=0)
        elif sp.issparse(value):  # compared as the CSR arrays they were bound as
            csr = sp.csr_matrix(value if b.order is None else value[b.order], dtype=np.float32)
            csr.sort_indices()
            return not (csr.shape == (len(sf.indptr) - 1, sf.num_features)
                        and np.array_equal(csr.indptr, sf.indptr)
                        and np.array_equal(csr.indices, sf.indices)
                        and np.array_equal(csr.data, sf.values.reshape(-1)))
        elif kernel is None or not isinstance(value, tvm_ffi.Tensor):
            return True
        else:
            t = value
        if name not in b.sparse_args:
            b.sparse_args[name] = tuple(
                _dlpack(a, require_alignment=0) if a.size
                else tvm.runtime.tensor(a, self.device)
                for a in (sf.indptr, sf.indices, sf.values))
        flags = self._match_flags
        self.functions[kernel](t, *b.sparse_args[name], flags)
        f = flags.numpy()
        if isinstance(value, np.ndarray):
            if f[:FEED_PARTS].max() == NONFINITE:
                check_features(value, b.graph.num_nodes, name)  # names the entry
            checked.add(name)
        return bool(f[FEED_PARTS:].max())

    def _checked(self, binding: Binding, inp: dict, value) -> np.ndarray:
        """Node input ``inp`` as a checked, C-ordered array of its dtype."""
        name = inp["name"]
        want = _resolve(inp["dims"], binding.dims)
        dtype = inp.get("dtype", "float32")
        if dtype == "float32" and len(want) == 2:
            x = check_features(value, binding.graph.num_nodes, name)
            if hasattr(x, "todense"):
                x = np.asarray(x.todense(), dtype=np.float32)
            if x.shape != want:
                raise InputError(f"input {name!r}: the model expects {want[1]} features per "
                                 f"node, got {x.shape[1]}")
            return x
        x = np.asarray(value)
        if x.shape != want:
            raise InputError(f"input {name!r} must have shape {want}, got {x.shape}")
        return np.ascontiguousarray(x, dtype=dtype)

    def _put(self, binding: Binding, inp: dict, value, read: bool | None = None) -> None:
        """Check node input ``inp`` and copy it in (in the binding's node order), or point
        the kernels at the caller's array where they can read it there; an input that no
        bound kernel reads (``read``, default: by ``binding.reads``; dense features when
        sparse-feature kernels run) is only checked."""
        name = inp["name"]
        want = _resolve(inp["dims"], binding.dims)
        read = name in binding.reads if read is None else read
        place = binding.in_place.get(name)
        # rows in the user's order
        as_given = binding.order is None or name in binding.caller_order
        kernel = None
        if (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.shape == want
                and want[0] > 0 and value.flags.c_contiguous):
            # one kernel reads the caller's array (alignment: any) and checks it, and
            # copies it in unless every kernel reading it can read it where it is
            in_place = (read and as_given and place is not None
                        and _alignment(value) >= place["need"])
            if "check_kernel" in inp and (in_place or not read):
                kernel, out = inp["check_kernel"], ()
            elif "feed_kernel" in inp and read and as_given:
                kernel, out = inp["feed_kernel"], (binding.buffers[name],)
        if kernel is not None:
            self.functions[kernel](_dlpack(value, require_alignment=0), *out,
                                   self._feed_flags)
            if self._feed_flags.numpy().max() == NONFINITE:
                check_features(value, binding.graph.num_nodes, name)  # names the entry
            self._read_from(binding, name, value if in_place else None)
            return
        self._read_from(binding, name, None)
        x = self._checked(binding, inp, value)
        if read:
            dest = binding.buffers[name]
            if as_given:
                dest.copyfrom(x)
            elif self.on_cpu and str(dest.dtype) == str(x.dtype):
                # the rows in the bound order, straight into the buffer (no copy between)
                np.take(x, binding.order, axis=0, out=np.from_dlpack(dest))
            else:
                dest.copyfrom(np.ascontiguousarray(x[binding.order]))

    def execute(self, binding: Binding) -> None:
        if binding is not self._binding:
            # its inputs were not fed: feed() may return a new binding (other features for
            # sparse-feature kernels), and a later bind() replaces this one
            raise InputError("this binding was replaced by a later bind() or feed(); run the "
                             "binding that feed() returned")
        binding.runs += 1
        if self.cuda_graphs and not self.on_cpu and binding.runs > 1:
            # the first run is eager, so TVM's workspace pool holds every kernel's scratch
            # before the capture takes its pointers
            g = binding.cuda_graph
            if g is None or g.key != key_of(binding.steps):
                if g is not None:
                    g.close()
                g = binding.cuda_graph = CudaGraph(self.device, binding.steps)
            g.launch()
            return
        for fn, args in binding.steps:
            fn(*args)

    def outputs(self, binding: Binding) -> list[np.ndarray]:
        outs = []
        for o in self.plan.outputs:
            v = binding.buffers[o["buffer"]].numpy()
            if o["role"] == "edge":
                v = from_csr_order(v, binding.edge_perm[o["graph"]])
            elif o["role"] == "node" and binding.order is not None:
                v = v[inverse(binding.order)]  # back to the user's node order
            outs.append(v)
        return outs

    def run(self, graph: GraphData, features: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """Bind ``graph`` (cached), feed node inputs (default: the graph's own ``x``), run.
        Safe to call from several threads, which take turns (bind, feed and execute
        themselves are not: one thread drives them)."""
        with self._lock:
            binding = self.bind(graph, features)
            if features is None:
                features = {i["name"]: graph.x if graph.x is not None else graph.dense_x()
                            for i in self.node_inputs()}
            binding = self.feed(binding, features)
            self.execute(binding)
            return self.outputs(binding)
