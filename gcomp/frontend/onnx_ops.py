"""Transfer functions of the ONNX importer: what each ONNX op does to abstract values.

``Interp.run(nodes)`` walks an ONNX graph in order and gives every tensor an
abstract value (``gcomp.frontend.onnx_values``).  Shape and index plumbing
folds to ``Known`` arrays whose entries may be symbolic sizes; edge-index
manipulation (self-loop removal and insertion, row extraction, masks) becomes
``GraphIndex`` / ``Row`` / ``EdgeIds`` values; float computation becomes lazy
``Tensor`` values whose patterns the emitter turns into Graph IR.

Recognition happens here, on meanings rather than node sequences:

* ``ScatterElements`` of ones (or of a 1-D edge tensor) keyed by a ``Row`` is a
  degree; of an edge tensor it is a scatter (sum/max), later fused by the
  compiler into sparse aggregation;
* ``Pow(deg, -1/2)`` with its ``inf`` masked and gathered at both ends of each
  edge multiplies into ``sym_norm`` (``onnx_values.Product``);
* ``scatter_sum / clamp(count, 1)`` is a mean aggregation;
* ``exp(e - m[dst]) / (sum_dst exp(e - m[dst]) + eps)[dst]`` is an edge
  softmax of ``e``, for any per-destination ``m`` (softmax is shift invariant,
  so how the exporter spelled PyG's scatter-max does not matter).

Every function takes ``(interp, node, inputs)`` and returns the output values.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from gcomp.errors import ModelImportError
from gcomp.frontend.onnx_dims import Lin, broadcast, decide_equal, fmt, is_static, norm, numel
from gcomp.frontend.onnx_dims import reshape_target, same
from gcomp.frontend.onnx_values import (Adjacency, Bcast, DegreeExpr, DenseAggregate, EdgeIds,
                                        EdgeMask, EdgeSoftmax, Emitter, ExpShifted, Fill,
                                        Gathered, Generic, GraphIndex, InfMask, Known, LoopFill,
                                        LoopNodes, LoopVals, NodeIds, Product, Remap, Reshape,
                                        Row, ScatterRed, Shifted, SumExp, Tensor, Unavailable,
                                        Value, unview)
from gcomp.ir.ops import Op

_ONNX_DTYPE = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64",
               9: "bool", 10: "float16", 11: "float64", 16: "bfloat16"}


class Interp:
    """Abstract interpreter state: ONNX tensor name -> value, and the IR emitter."""

    def __init__(self, emitter: Emitter, opset: int | None = None):
        self.em = emitter
        self.env: dict[str, Value] = {}
        self.opset = opset  # the model's default-domain opset, for messages

    @property
    def n(self) -> Lin:
        return self.em.n

    def run(self, nodes) -> None:
        for node in nodes:
            fn = TRANSFER.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            where = f"ONNX node {node.name or '(unnamed)'!r} ({node.op_type})"
            if fn is None:
                dom = f" in domain {node.domain!r}" if node.domain not in ("", "ai.onnx") else ""
                at = f" at opset {self.opset}" if self.opset else ""
                raise ModelImportError(f"{where}: op {node.op_type}{dom}{at} is not supported "
                                       f"by gcomp's ONNX importer; supported: "
                                       f"{', '.join(sorted(TRANSFER))}")
            ins = [self.env[i] if i else None for i in node.input]
            try:
                outs = fn(self, node, ins)
            except ModelImportError as e:
                if str(e).startswith("ONNX node"):
                    raise
                raise ModelImportError(f"{where}: {e}") from None
            for name, v in zip(node.output, outs):
                if name:
                    v.origin = v.origin or name
                    self.env[name] = v


# ====================================================================== helpers
def attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def dims_array(dims) -> np.ndarray:
    """Sizes as an int64 array, or an object array while some are symbolic."""
    dims = [norm(d) for d in dims]
    if all(is_static(d) for d in dims):
        return np.array(dims, dtype=np.int64)
    return np.array(dims, dtype=object)


def want_known(v: Value | None, what: str) -> Known:
    if not isinstance(v, Known):
        desc = v.describe() if v is not None else "missing"
        raise ModelImportError(f"{what} must be a constant the importer can fold, got {desc}")
    return v


def int_list(v: Value | None, what: str) -> list:
    arr = want_known(v, what).arr
    return [norm(d) for d in arr.reshape(-1).tolist()]


def static_ints(v: Value | None, what: str) -> list[int]:
    out = int_list(v, what)
    for d in out:
        if not is_static(d):
            raise ModelImportError(f"{what} must be static, got the symbolic size {d}")
    return [int(d) for d in out]


def scalar_of(v: Value) -> float | None:
    """The single value of a constant or fill, else None."""
    if isinstance(v, Fill):
        return float(v.value)
    if isinstance(v, Known) and v.param is None and v.arr.dtype != object and v.arr.size >= 1:
        u = v.uniform()
        return None if u is None else float(u)
    return None


def norm_axis(axis: int, rank: int) -> int:
    ax = axis + rank if axis < 0 else axis
    if not 0 <= ax < max(rank, 1):
        raise ModelImportError(f"axis {axis} is out of range for rank {rank}")
    return ax


def is_node_shape(interp: Interp, shape: tuple) -> bool:
    return bool(shape) and same(shape[0], interp.n)


def tensor(pat, shape, tag=None, view_of=None) -> Tensor:
    return Tensor(pat, tuple(norm(d) for d in shape), tag=tag, view_of=view_of)


def _foldable(*vs) -> bool:
    return all(isinstance(v, Known) and v.param is None for v in vs)


# ====================================================================== constants, shapes
def t_constant(interp, node, ins):
    for a in node.attribute:
        if a.name == "value":
            return [Known(numpy_helper.to_array(a.t))]
        if a.name in ("value_float", "value_int"):
            return [Known(np.array(helper.get_attribute_value(a),
                                   np.float32 if a.name == "value_float" else np.int64))]
        if a.name in ("value_floats", "value_ints"):
            return [Known(np.array(helper.get_attribute_value(a),
                                   np.float32 if a.name == "value_floats" else np.int64))]
    raise ModelImportError("Constant without a supported value attribute")


def t_shape(interp, node, ins):
    shape = ins[0].shape
    r = len(shape)
    start = attr(node, "start", 0)
    end = attr(node, "end", r)
    start = max(0, min(r, start + r if start < 0 else start))
    end = max(0, min(r, end + r if end < 0 else end))
    return [Known(dims_array(shape[start:end]), dtype="int")]


def t_size(interp, node, ins):
    return [Known(np.array(numel(ins[0].shape), dtype=object if not is_static(numel(ins[0].shape))
                           else np.int64), dtype="int")]


def t_identity(interp, node, ins):
    return [ins[0]]


def t_cast(interp, node, ins):
    x = ins[0]
    to = _ONNX_DTYPE.get(attr(node, "to"), "?")
    if isinstance(x, Known):
        if x.arr.dtype == object:
            if to.startswith("int"):
                return [Known(x.arr, dtype="int")]
            raise ModelImportError(f"cannot cast the symbolic sizes {x.arr.tolist()} to {to}")
        return [Known(x.arr.astype(to), param=x.param)]
    kind = "float" if to.startswith(("float", "bfloat")) else "bool" if to == "bool" else "int"
    if isinstance(x, Fill):
        return [Fill({"float": float, "bool": bool, "int": int}[kind](x.value), x.shape, kind)]
    if kind != x.dtype:
        raise ModelImportError(f"cannot cast {x.describe()} ({x.dtype}) to {to}")
    return [x]


def t_constant_of_shape(interp, node, ins):
    dims = int_list(ins[0], "the shape of ConstantOfShape")
    val = attr(node, "value")
    arr = numpy_helper.to_array(val) if val is not None else np.zeros(1, np.float32)
    if all(is_static(d) for d in dims):
        return [Known(np.full(tuple(int(d) for d in dims), arr.reshape(-1)[0], arr.dtype))]
    kind = "float" if arr.dtype.kind == "f" else "bool" if arr.dtype.kind == "b" else "int"
    return [Fill(arr.reshape(-1)[0].item(), tuple(dims), kind)]


def t_range(interp, node, ins):
    start, limit, delta = (int_list(v, "Range's bounds")[0] for v in ins)
    if all(is_static(d) for d in (start, limit, delta)):
        return [Known(np.arange(int(start), int(limit), int(delta), dtype=np.int64))]
    if same(start, 0) and same(delta, 1) and same(limit, interp.n):
        return [NodeIds((interp.n,), 0)]
    raise ModelImportError(f"Range({start}, {limit}, {delta}) is not arange(num_nodes)")


# ====================================================================== layout
def reshape_value(interp, x: Value, shape: tuple) -> Value:
    """``x`` laid out as ``shape`` (same elements in the same order)."""
    shape = tuple(norm(d) for d in shape)
    if isinstance(x, Known):
        if not all(is_static(d) for d in shape):
            raise ModelImportError(f"cannot reshape a constant to the symbolic shape {fmt(shape)}")
        param = (x.param[0], x.param[1] + (("reshape", shape),)) if x.param else None
        return Known(x.arr.reshape(tuple(int(d) for d in shape)), dtype=x.dtype, param=param)
    if isinstance(x, Fill):
        return Fill(x.value, shape, x.dtype)
    old_big = [d for d in x.shape if not same(d, 1)]
    new_big = [d for d in shape if not same(d, 1)]
    unit_only = len(old_big) == len(new_big) and all(same(a, b) for a, b in zip(old_big, new_big))
    if isinstance(x, (NodeIds, EdgeIds)):
        if not unit_only:
            raise ModelImportError(f"cannot reshape an index {fmt(x.shape)} to {fmt(shape)}")
        ax = next(i for i, d in enumerate(shape) if same(d, x.shape[x.axis]))
        return (NodeIds(shape, ax) if isinstance(x, NodeIds)
                else EdgeIds(x.gd, x.loop, shape, ax))
    if isinstance(x, LoopNodes):
        if not unit_only:
            raise ModelImportError(f"cannot reshape loop node ids {fmt(x.shape)} to {fmt(shape)}")
        return LoopNodes(x.gd, shape)
    if isinstance(x, Row):
        if not (shape and same(shape[0], x.shape[0]) and same(numel(shape), numel(x.shape))):
            raise ModelImportError(f"cannot reshape an edge-index row {fmt(x.shape)} to "
                                   f"{fmt(shape)}")
        return Row(x.gd, x.side, shape)
    if isinstance(x, Tensor):
        if len(shape) == len(x.shape) and all(same(a, b) for a, b in zip(shape, x.shape)):
            return x
        return tensor(Reshape(x), shape, view_of=x if unit_only else None)
    raise ModelImportError(f"cannot reshape {x.describe()}")


def t_reshape(interp, node, ins):
    target = int_list(ins[1], "Reshape's target shape")
    shape = reshape_target(ins[0].shape, target, bool(attr(node, "allowzero", 0)))
    return [reshape_value(interp, ins[0], shape)]


def _axes(node, ins, what) -> list[int] | None:
    if len(ins) > 1 and ins[1] is not None:
        return static_ints(ins[1], f"{what} axes")
    a = attr(node, "axes")
    return list(a) if a is not None else None


def t_squeeze(interp, node, ins):
    x = ins[0]
    axes = _axes(node, ins, "Squeeze")
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if same(d, 1)]
    axes = {norm_axis(a, x.rank) for a in axes}
    for a in axes:
        if not same(x.shape[a], 1):
            raise ModelImportError(f"Squeeze of axis {a} of size {x.shape[a]}")
    return [reshape_value(interp, x, tuple(d for i, d in enumerate(x.shape) if i not in axes))]


def t_unsqueeze(interp, node, ins):
    x = ins[0]
    axes = _axes(node, ins, "Unsqueeze")
    r = x.rank + len(axes)
    axes = sorted(norm_axis(a, r) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return [reshape_value(interp, x, tuple(shape))]


def t_flatten(interp, node, ins):
    x = ins[0]
    ax = norm_axis(attr(node, "axis", 1), x.rank + 1)
    return [reshape_value(interp, x, (numel(x.shape[:ax]), numel(x.shape[ax:])))]


def t_transpose(interp, node, ins):
    x = ins[0]
    perm = list(attr(node, "perm", list(range(x.rank))[::-1]))
    shape = tuple(x.shape[p] for p in perm)
    if isinstance(x, Known):
        param = (x.param[0], x.param[1] + (("transpose", tuple(perm)),)) if x.param else None
        return [Known(np.transpose(x.arr, perm), dtype=x.dtype, param=param)]
    if isinstance(x, GraphIndex) and perm == [1, 0]:
        return [GraphIndex(x.gd, not x.transposed)]
    big = [p for p in perm if not same(x.shape[p], 1)]
    if big == sorted(big):  # only unit axes move: a reshape
        return [reshape_value(interp, x, shape)]
    raise ModelImportError(f"Transpose{perm} of {x.describe()} is not supported (the IR has "
                           "no transpose of computed tensors)")


def t_expand(interp, node, ins):
    x = ins[0]
    target = int_list(ins[1], "Expand's shape")
    shape = broadcast(x.shape, tuple(target))
    if len(shape) == x.rank and all(same(a, b) for a, b in zip(shape, x.shape)):
        return [x]
    if isinstance(x, Known):
        if all(is_static(d) for d in shape) and x.param is None and x.arr.dtype != object:
            return [Known(np.broadcast_to(x.arr, tuple(int(d) for d in shape)).copy())]
        u = scalar_of(x)
        if u is not None:
            return [Fill(x.arr.reshape(-1)[0].item(), shape, x.dtype)]
    if isinstance(x, Fill):
        return [Fill(x.value, shape, x.dtype)]
    if isinstance(x, Row):
        if not same(shape[0], x.shape[0]):
            raise ModelImportError(f"cannot expand an edge-index row to {fmt(shape)}")
        return [Row(x.gd, x.side, shape)]
    if isinstance(x, NodeIds):
        return [NodeIds(shape, x.axis + len(shape) - x.rank)]
    if isinstance(x, Tensor):
        trailing = len(shape) == x.rank and (not x.shape or same(shape[0], x.shape[0]))
        return [tensor(Bcast(x), shape, tag=x.tag, view_of=x if trailing else None)]
    raise ModelImportError(f"cannot expand {x.describe()} to {fmt(shape)}")


def t_tile(interp, node, ins):
    x = ins[0]
    reps = int_list(ins[1], "Tile's repeats")
    if isinstance(x, Known) and all(is_static(r) for r in reps) and x.param is None:
        return [Known(np.tile(x.arr, [int(r) for r in reps]))]
    if isinstance(x, NodeIds) and same(reps[x.axis], 1):
        return [NodeIds(tuple(norm(d * r) for d, r in zip(x.shape, reps)), x.axis)]
    raise ModelImportError(f"Tile of {x.describe()} by {reps} is not supported")


def t_concat(interp, node, ins):
    axis = attr(node, "axis")
    r = ins[0].rank
    ax = norm_axis(axis, r)
    if all(isinstance(v, Known) for v in ins):
        if any(v.param for v in ins):
            return [_generic_concat(interp, ins, ax)]
        arrs = [v.arr for v in ins]
        obj = any(a.dtype == object for a in arrs)
        return [Known(np.concatenate([a.astype(object) if obj else a for a in arrs], axis=ax))]
    if len(ins) == 2 and isinstance(ins[0], GraphIndex) and isinstance(ins[1], NodeIds):
        g, loops = ins
        edge_ax = 0 if g.transposed else 1
        if ax == edge_ax and loops.axis == edge_ax and same(loops.shape[1 - edge_ax], 2):
            return [GraphIndex(interp.em.add_loops(g.gd), g.transposed)]
    if len(ins) == 2 and ax == 0 and all(isinstance(v, Tensor) for v in ins):
        a, b = ins[0].pat, ins[1].pat
        if (isinstance(a, Remap) and isinstance(b, LoopFill) and a.w is b.w
                and a.gd.kind == "remove" and a.gd.parent is b.gd):
            ar = interp.em.add_loops(a.gd)  # edge values of add_remaining_self_loops
            return [tensor(Remap(ar, a.w, b.fill), (ar.num_edges,) + ins[0].shape[1:])]
    if all(isinstance(v, (Tensor, Known, Fill)) for v in ins):
        return [_generic_concat(interp, ins, ax)]
    raise ModelImportError("Concat of " + ", ".join(v.describe() for v in ins) +
                           " is not supported")


def _generic_concat(interp, ins, ax):
    shape = list(ins[0].shape)
    shape[ax] = norm(sum(v.shape[ax] for v in ins))
    return tensor(Generic(Op.CONCAT, list(ins), {"axis": ax}, full_args=True), shape)


def t_slice(interp, node, ins):
    x = ins[0]
    starts = int_list(ins[1], "Slice's starts")
    ends = int_list(ins[2], "Slice's ends")
    axes = (static_ints(ins[3], "Slice's axes") if len(ins) > 3 and ins[3] is not None
            else list(range(len(starts))))
    steps = (static_ints(ins[4], "Slice's steps") if len(ins) > 4 and ins[4] is not None
             else [1] * len(starts))
    shape = list(x.shape)
    cuts = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(a, x.rank)
        d = shape[a]
        full = (same(s, 0) and st == 1 and (same(e, d) or (is_static(e) and int(e) >= 2**31 - 1)))
        if full:
            continue
        if not all(is_static(v) for v in (s, e, d)):
            raise ModelImportError(f"slice [{s}:{e}] of the symbolic axis {a} ({d}) is not "
                                   "supported")
        idx = range(*slice(int(s), int(e), st).indices(int(d)))
        cuts.append((a, idx))
        shape[a] = len(idx)
    return [_cut(x, cuts, shape, "Slice")]


def _cut(x: Value, cuts: list, shape: list, op_type: str) -> Value:
    """x restricted to the index ranges ``cuts`` ((axis, range) each; result ``shape``)."""
    if not cuts:
        return x
    if isinstance(x, Known):
        arr = x.arr
        for a, idx in cuts:
            arr = np.take(arr, list(idx), axis=a)
        return Known(arr, dtype=x.dtype)
    if isinstance(x, Tensor) and len(cuts) == 1 and cuts[0][1].step == 1:
        a, idx = cuts[0]
        return tensor(Generic(Op.SLICE, [x], {"axis": a, "start": idx.start, "stop": idx.stop},
                              full_args=True), shape)
    raise ModelImportError(f"{op_type} of {x.describe()} is not supported")


def t_split(interp, node, ins):
    """Consecutive pieces along a static axis (a GRU's three gates), each a Slice."""
    x = ins[0]
    ax = norm_axis(attr(node, "axis", 0), x.rank)
    d = x.shape[ax]
    if not is_static(d):
        raise ModelImportError(f"Split along the symbolic axis {ax} ({d}) is not supported")
    d, k = int(d), len(node.output)
    if len(ins) > 1 and ins[1] is not None:
        sizes = static_ints(ins[1], "Split's sizes")
    else:  # equal pieces, the last smaller (opset 18's num_outputs)
        sizes = [-(-d // k)] * (k - 1)
        sizes.append(d - sum(sizes))
    if len(sizes) != k or sum(sizes) != d or min(sizes) < 0:
        raise ModelImportError(f"Split of axis {ax} ({d}) into {sizes} for {k} outputs")
    outs, start = [], 0
    for size in sizes:
        shape = list(x.shape)
        shape[ax] = size
        cut = [] if size == d else [(ax, range(start, start + size))]
        outs.append(_cut(x, cut, shape, "Split"))
        start += size
    return outs


# ====================================================================== indexing
def t_gather(interp, node, ins):
    x, idx = ins
    axis = norm_axis(attr(node, "axis", 0), x.rank)
    if isinstance(x, Known) and isinstance(idx, Known) and x.param is None:
        return [Known(np.take(x.arr, idx.arr.astype(np.int64) if idx.arr.dtype != object
                              else idx.arr, axis=axis), dtype=x.dtype)]
    if isinstance(x, GraphIndex):
        row_axis, edge_axis = (1, 0) if x.transposed else (0, 1)
        if axis == row_axis and isinstance(idx, Known) and idx.arr.ndim == 0:
            k = int(idx.arr) % 2
            return [Row(x.gd, "src" if k == 0 else "dst", (x.gd.num_edges,))]
        if axis == edge_axis and isinstance(idx, EdgeIds) and idx.rank == 1:
            return [_select_edges(interp, x, idx)]
    if isinstance(x, Tensor) and isinstance(idx, Row) and axis == 0 and idx.rank == 1:
        return [_gathered(interp, x, idx)]
    if isinstance(x, (Tensor, Row)) and isinstance(idx, EdgeIds) and axis == 0 and idx.rank == 1:
        return [_edge_subset(interp, x, idx)]
    raise ModelImportError(f"Gather(axis={axis}) of {x.describe()} at {idx.describe()} is not "
                           "supported")


def t_gather_nd(interp, node, ins):
    x, idx = ins
    if attr(node, "batch_dims", 0) != 0 or not idx.shape or not same(idx.shape[-1], 1):
        raise ModelImportError("only GatherND with batch_dims=0 along the first axis is supported")
    if isinstance(x, GraphIndex) and x.transposed and isinstance(idx, EdgeIds) and idx.rank == 2:
        return [_select_edges(interp, x, idx)]
    if isinstance(x, Tensor) and isinstance(idx, Row) and idx.rank == 2:
        return [_gathered(interp, x, Row(idx.gd, idx.side, idx.shape[:1]))]
    if isinstance(x, (Tensor, Row)) and isinstance(idx, EdgeIds) and idx.rank == 2:
        return [_edge_subset(interp, x, idx)]
    raise ModelImportError(f"GatherND of {x.describe()} at {idx.describe()} is not supported")


def _select_edges(interp, g: GraphIndex, ids: EdgeIds) -> GraphIndex:
    if ids.gd is not g.gd or ids.loop:
        raise ModelImportError("selecting the self-loop edges of a graph is not supported "
                               "(only removing them)")
    return GraphIndex(interp.em.remove_loops(g.gd), g.transposed)


def _edge_subset(interp, x: Tensor | Row, ids: EdgeIds) -> Value:
    """Per-edge values (or an edge-index row) restricted to the (non-)self-loop edges."""
    gd = ids.gd
    if not (x.shape and same(x.shape[0], gd.num_edges)) or (isinstance(x, Row) and x.gd is not gd):
        raise ModelImportError(f"selecting edges of {x.describe()} by ids of another graph")
    count = ids.shape[ids.axis]
    if not ids.loop:
        kept = interp.em.remove_loops(gd)
        if isinstance(x, Row):
            return Row(kept, x.side, (kept.num_edges,) + x.shape[1:])
        return tensor(Remap(kept, x), (kept.num_edges,) + x.shape[1:])
    if isinstance(x, Row):
        return LoopNodes(gd, (count,))
    return tensor(LoopVals(gd, x), (count,) + x.shape[1:])


def t_scatter_nd(interp, node, ins):
    """PyG's add_remaining_self_loops: fill[loop node] = w[loop edge] (the last loop wins)."""
    data, idx, upd = ins
    if attr(node, "reduction", "none") != "none":
        raise ModelImportError("ScatterND with a reduction is not supported")
    c = scalar_of(data)
    if (isinstance(idx, LoopNodes) and idx.rank == 2 and isinstance(upd, Tensor)
            and isinstance(upd.pat, LoopVals) and upd.pat.gd is idx.gd and c is not None
            and data.rank == 1 and same(data.shape[0], interp.n)):
        return [tensor(LoopFill(idx.gd, upd.pat.w, c), data.shape)]
    raise ModelImportError(f"ScatterND of {upd.describe()} into {data.describe()} at "
                           f"{idx.describe()} is not supported (only PyG's self-loop values)")


def _gathered(interp, x: Tensor, row: Row) -> Tensor:
    if not is_node_shape(interp, x.shape):
        raise ModelImportError(f"gathering {fmt(x.shape)} by an edge-index row needs a node "
                               "tensor [num_nodes, ...]")
    return tensor(Gathered(x, row.gd, row.side), (row.gd.num_edges,) + x.shape[1:])


def t_equal(interp, node, ins):
    a, b = ins
    if isinstance(a, Row) and isinstance(b, Row) and a.gd is b.gd and a.side != b.side:
        return [EdgeMask(a.gd, loop=True)]
    for t, c in ((a, b), (b, a)):
        if isinstance(t, Tensor) and scalar_of(c) == np.inf:
            return [InfMask(t)]
    if isinstance(a, Known) and isinstance(b, Known):
        if a.arr.dtype == object or b.arr.dtype == object:
            fa, fb = np.broadcast_arrays(a.arr, b.arr)
            out = np.array([decide_equal(x, y) for x, y in zip(fa.reshape(-1), fb.reshape(-1))],
                           dtype=bool).reshape(fa.shape)
            return [Known(out)]
        return [Known(np.equal(a.arr, b.arr))]
    raise ModelImportError(f"Equal of {a.describe()} and {b.describe()} is not supported")


def t_not(interp, node, ins):
    x = ins[0]
    if isinstance(x, EdgeMask):
        return [EdgeMask(x.gd, not x.loop)]
    if isinstance(x, Known):
        return [Known(np.logical_not(x.arr))]
    raise ModelImportError(f"Not of {x.describe()} is not supported")


def t_nonzero(interp, node, ins):
    x = ins[0]
    if isinstance(x, EdgeMask):
        count = (interp.em.remove_loops(x.gd).num_edges if not x.loop
                 else Lin.atom(f"L[{x.gd.key}]"))  # the number of self-loop edges
        return [EdgeIds(x.gd, x.loop, (1, count), 1)]
    raise ModelImportError(f"NonZero of {x.describe()} is not supported")


def t_where(interp, node, ins):
    c, a, b = ins
    if isinstance(c, InfMask) and scalar_of(a) == 0.0 and b is c.t:
        if isinstance(b.pat, DegreeExpr):
            return [tensor(b.pat.but(masked=True), b.shape)]
        raise ModelImportError("replacing inf by 0 is only supported for PyG's degree powers")
    if _foldable(c, a, b):
        return [Known(np.where(c.arr, a.arr, b.arr))]
    raise ModelImportError(f"Where({c.describe()}, {a.describe()}, {b.describe()}) is not "
                           "supported")


def t_scatter_elements(interp, node, ins):
    data, idx, upd = ins
    red = attr(node, "reduction", "none")
    if norm_axis(attr(node, "axis", 0), data.rank) != 0:
        raise ModelImportError("only ScatterElements along axis 0 is supported")
    if not isinstance(idx, Row):
        raise ModelImportError(f"ScatterElements indices must be a row of the edge index, got "
                               f"{idx.describe()}")
    if red not in ("add", "max"):
        raise ModelImportError(f"ScatterElements reduction {red!r} is not supported "
                               "(add and max are)")
    if not is_node_shape(interp, data.shape) or len(data.shape) != len(upd.shape) or \
            not all(same(a, b) for a, b in zip(data.shape[1:], upd.shape[1:])):
        raise ModelImportError(f"scattering {fmt(upd.shape)} into {fmt(data.shape)}: the target "
                               "must be a node tensor with the updates' feature axes")
    gd, side = idx.gd, idx.side
    if not (upd.shape and same(upd.shape[0], gd.num_edges)):
        raise ModelImportError(f"the updates {fmt(upd.shape)} are not one row per edge of the "
                               "graph whose row indexes them")
    zero_init = scalar_of(data) == 0.0
    # the sum of a softmax's exponentials, not a weighted degree, even over 1-D scores
    exps = isinstance(upd, Tensor) and isinstance(upd.tag, ExpShifted) and upd.tag.gd is gd
    if red == "add" and upd.rank == 1 and not exps and isinstance(upd, (Fill, Known, Tensor)):
        if isinstance(upd, Tensor):
            pat = DegreeExpr(gd, upd, "in" if side == "dst" else "out")
        else:
            c = scalar_of(upd)
            if c is None:
                raise ModelImportError("scattering a non-uniform constant is not supported")
            pat = DegreeExpr(gd, None, "in" if side == "dst" else "out", scale=c)
        out = tensor(pat, data.shape)
        if not zero_init:
            out = tensor(Generic(Op.ADD, [data, out]), data.shape)
        return [out]
    if not isinstance(upd, Tensor):
        raise ModelImportError(f"scattering {upd.describe()} is not supported")
    if side != "dst":
        raise ModelImportError("aggregating at the source of each edge (flow target_to_source) "
                               "is not supported")
    tag = SumExp(gd, upd.tag.e, upd.tag.s) if red == "add" and exps else None
    if red == "add":
        out = tensor(ScatterRed(gd, "sum", upd), data.shape, tag=tag if zero_init else None)
        if not zero_init:
            out = tensor(Generic(Op.ADD, [data, out]), data.shape)
        return [out]
    return [tensor(ScatterRed(gd, "max", upd, init=data), data.shape)]


# ====================================================================== float math
_UNARY = {"Relu": Op.RELU, "Exp": Op.EXP, "Log": Op.LOG, "Sigmoid": Op.SIGMOID, "Tanh": Op.TANH,
          "Neg": Op.NEG, "Sqrt": Op.SQRT}
_NP_UNARY = {"Relu": lambda a: np.maximum(a, 0), "Exp": np.exp, "Log": np.log,
             "Sigmoid": lambda a: 1 / (1 + np.exp(-a)), "Tanh": np.tanh, "Neg": np.negative,
             "Sqrt": np.sqrt}


def t_unary(interp, node, ins):
    x = ins[0]
    if _foldable(x):
        return [Known(_NP_UNARY[node.op_type](x.arr))]
    if isinstance(x, Fill) and x.dtype == "float":
        return [Fill(float(_NP_UNARY[node.op_type](np.float64(x.value))), x.shape, "float")]
    tag = None
    if node.op_type == "Exp" and isinstance(x, Tensor) and isinstance(x.tag, Shifted):
        tag = ExpShifted(x.tag.gd, x.tag.e, x.tag.s)
    return [tensor(Generic(_UNARY[node.op_type], [x]), x.shape, tag=tag)]


def t_leaky_relu(interp, node, ins):
    x = ins[0]
    return [tensor(Generic(Op.LEAKY_RELU, [x], {"alpha": float(attr(node, "alpha", 0.01))}),
                   x.shape)]


def t_elu(interp, node, ins):
    x = ins[0]
    return [tensor(Generic(Op.ELU, [x], {"alpha": float(attr(node, "alpha", 1.0))}), x.shape)]


def t_softmax(interp, node, ins):
    x = ins[0]
    op = Op.SOFTMAX if node.op_type == "Softmax" else Op.LOG_SOFTMAX
    ax = norm_axis(attr(node, "axis", -1), x.rank)
    if ax != x.rank - 1:
        raise ModelImportError(f"{node.op_type} over axis {ax} (not the last) is not supported")
    return [tensor(Generic(op, [x], {"axis": -1}), x.shape)]


def t_pow(interp, node, ins):
    x, y = ins
    e = scalar_of(y)
    if _foldable(x, y):
        return [Known(np.power(x.arr, y.arr))]
    if e is None:
        raise ModelImportError("Pow needs a constant scalar exponent")
    if isinstance(x, Tensor) and isinstance(x.pat, DegreeExpr) and x.pat.exponent == 1.0 \
            and not x.pat.masked:
        return [tensor(x.pat.but(exponent=e), x.shape)]
    return [tensor(Generic(Op.POW, [x], {"exponent": e}), x.shape)]


def t_clip(interp, node, ins):
    x = ins[0]
    lo = ins[1] if len(ins) > 1 else None
    hi = ins[2] if len(ins) > 2 else None
    if lo is None and attr(node, "min") is not None:
        lo = Known(np.float32(attr(node, "min")))
    if hi is None and attr(node, "max") is not None:
        hi = Known(np.float32(attr(node, "max")))
    out = x
    if lo is not None:
        out = _min_max(interp, Op.MAXIMUM, out, lo)
    if hi is not None:
        out = _min_max(interp, Op.MINIMUM, out, hi)
    return [out]


def _min_max(interp, op, a, b):
    if _foldable(a, b):
        return Known(np.maximum(a.arr, b.arr) if op == Op.MAXIMUM else np.minimum(a.arr, b.arr))
    lo = scalar_of(b)
    if (op == Op.MAXIMUM and lo is not None and isinstance(a, Tensor)
            and isinstance(a.pat, DegreeExpr) and a.pat.clamp is None and a.pat.exponent == 1.0):
        return tensor(a.pat.but(clamp=lo), a.shape)
    return tensor(Generic(op, [a, b]), broadcast(a.shape, b.shape))


def t_max_min(interp, node, ins):
    out = ins[0]
    for b in ins[1:]:
        out = _min_max(interp, Op.MAXIMUM if node.op_type == "Max" else Op.MINIMUM, out, b)
    return [out]


_BINARY = {"Add": Op.ADD, "Sub": Op.SUB, "Mul": Op.MUL, "Div": Op.DIV}
_NP_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": None}


def _fold_binary(op_type, a: Known, b: Known) -> Known:
    if op_type == "Div":
        if a.dtype == "float" or b.dtype == "float":
            return Known(np.divide(a.arr, b.arr).astype(np.result_type(a.arr, b.arr)))
        fa, fb = np.broadcast_arrays(a.arr, b.arr)
        out = [norm(x // y) if not (is_static(x) and is_static(y)) else int(x) // int(y)
               for x, y in zip(fa.reshape(-1), fb.reshape(-1))]
        return Known(dims_array(out).reshape(fa.shape), dtype="int")
    out = _NP_BINARY[op_type](a.arr, b.arr)
    if not isinstance(out, np.ndarray):  # 0-d object arrays give back the bare size
        out = np.array(out, dtype=object if isinstance(out, Lin) else None)
    if out.dtype == object:
        flat = [norm(v) for v in out.reshape(-1)]
        return Known(dims_array(flat).reshape(out.shape), dtype="int")
    return Known(out)


def t_binary(interp, node, ins):
    a, b = ins
    op = node.op_type
    if _foldable(a, b):
        return [_fold_binary(op, a, b)]
    shape = broadcast(a.shape, b.shape)
    ca, cb = scalar_of(a), scalar_of(b)
    if isinstance(a, Fill) and isinstance(b, Fill) or (isinstance(a, Fill) and cb is not None) \
            or (isinstance(b, Fill) and ca is not None):
        if ca is not None and cb is not None:
            v = _fold_binary(op, Known(np.float64(ca)), Known(np.float64(cb))).arr
            return [Fill(float(v), shape, a.dtype if isinstance(a, Fill) else b.dtype)]
    # identities: x * 1, x + 0, x - 0, x / 1 (PyG multiplies by a ones edge weight)
    same_shape = lambda t: len(t.shape) == len(shape) and all(
        same(p, q) for p, q in zip(t.shape, shape))
    if isinstance(a, Tensor) and same_shape(a) and (
            (op in ("Mul", "Div") and cb == 1.0) or (op in ("Add", "Sub") and cb == 0.0)):
        return [a]
    if isinstance(b, Tensor) and same_shape(b) and (
            (op == "Mul" and ca == 1.0) or (op == "Add" and ca == 0.0)):
        return [b]
    if op == "Mul":
        prod = _product(interp, a, b)
        if prod is not None:
            return [prod]
    if op == "Sub" and isinstance(a, Tensor) and isinstance(b, Tensor):
        s = _shift_of(b)
        if s is not None and a.shape and same(a.shape[0], s[0].num_edges):
            return [tensor(Generic(Op.SUB, [a, b]), shape, tag=Shifted(s[0], a, s[1]))]
    if op == "Add" and isinstance(a, Tensor) and isinstance(a.tag, SumExp) \
            and cb is not None and 0.0 <= cb <= 1e-6:
        return [tensor(Generic(Op.ADD, [a, b]), shape, tag=a.tag)]
    if op == "Div" and isinstance(a, Tensor) and isinstance(b, Tensor):
        r = _softmax(a, b) or _mean(a, b)
        if r is not None:
            return [r]
    return [tensor(Generic(_BINARY[op], [a, b]), shape)]


def _product(interp, a, b) -> Tensor | None:
    """Products of 1-D edge tensors of one graph, kept flat so sym_norm can be found."""
    def edge_gd(t):
        if isinstance(t, Tensor) and t.rank == 1:
            return interp.em.graph_of_dim(t.shape[0])
        return None
    ga, gb = edge_gd(a), edge_gd(b)
    if ga is None or ga is not gb:
        return None
    fs = []
    for t in (a, b):
        fs += t.pat.factors if isinstance(t.pat, Product) else [t]
    return tensor(Product(fs), a.shape)


def _shift_of(b: Tensor):
    """(graph, m) if ``b`` is m[dst] for a node tensor m (possibly viewed)."""
    u = unview(b)
    if isinstance(u.pat, Gathered) and u.pat.side == "dst":
        return u.pat.gd, u.pat.x
    return None


def _softmax(a: Tensor, b: Tensor) -> Tensor | None:
    t = a.tag
    s = _shift_of(b)
    if not isinstance(t, ExpShifted) or s is None or s[0] is not t.gd:
        return None
    z = s[1].tag
    if isinstance(z, SumExp) and z.gd is t.gd and z.e is t.e and z.s is t.s:
        return tensor(EdgeSoftmax(t.gd, t.e), a.shape)
    return None


def _mean(a: Tensor, b: Tensor) -> Tensor | None:
    """scatter_sum(msg) / clamp(count, 1) (broadcast) is a mean aggregation."""
    d = unview(b).pat
    p = a.pat
    if (isinstance(p, ScatterRed) and p.reduce == "sum" and isinstance(d, DegreeExpr)
            and d.gd is p.gd and d.is_count_clamped()):
        return tensor(ScatterRed(p.gd, "mean", p.msg), a.shape)
    return None


def t_reduce(interp, node, ins):
    x = ins[0]
    axes = _axes(node, ins, node.op_type)
    keep = bool(attr(node, "keepdims", 1))
    if node.op_type == "ReduceMin" and axes in (None, list(range(x.rank))) and not keep:
        # PyG's scatter-max starts from the global minimum: only a softmax shift reads it
        return [tensor(Unavailable("the global minimum of a tensor is not supported"), ())]
    if axes is None or len(axes) != 1:
        raise ModelImportError(f"{node.op_type} over axes {axes} is not supported (one axis)")
    ax = norm_axis(axes[0], x.rank)
    op = {"ReduceSum": Op.SUM, "ReduceMean": Op.MEAN, "ReduceMax": Op.MAX}.get(node.op_type)
    if op is None or (ax == 0 and not is_static(x.shape[0])):
        raise ModelImportError(f"{node.op_type} over axis {ax} of {fmt(x.shape)} is not "
                               "supported")
    shape = list(x.shape)
    if keep:
        shape[ax] = 1
    else:
        del shape[ax]
    return [tensor(Generic(op, [x], {"axis": ax, "keepdims": keep}, full_args=True), shape)]


def t_matmul(interp, node, ins):
    a, b = ins
    if isinstance(a, Adjacency) and isinstance(b, Tensor) and is_node_shape(interp, b.shape):
        return [tensor(DenseAggregate(a.gd, b), b.shape)]
    if isinstance(b, Known) and b.rank == 2 and isinstance(a, Tensor):
        if not same(a.shape[-1], b.shape[0]):
            raise ModelImportError(f"MatMul of {fmt(a.shape)} by {fmt(b.shape)}")
        return [tensor(Generic(Op.MATMUL, [a, b], full_args=True), a.shape[:-1] + b.shape[1:])]
    raise ModelImportError(f"MatMul of {a.describe()} by {b.describe()} is not supported (the "
                           "right side must be a weight, or the left a dense adjacency input)")


def t_gemm(interp, node, ins):
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if attr(node, "transA", 0):
        raise ModelImportError("Gemm with transA=1 is not supported")
    tb = bool(attr(node, "transB", 0))
    if not (isinstance(a, Tensor) and isinstance(b, Known) and b.rank == 2):
        raise ModelImportError(f"Gemm of {a.describe()} by {b.describe()} is not supported")
    m = b.shape[0] if tb else b.shape[1]
    out = tensor(Generic(Op.MATMUL, [a, b], {"trans_b": tb}, full_args=True),
                 a.shape[:-1] + (m,))
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    if alpha != 1.0:
        out = tensor(Generic(Op.MUL, [out, Known(np.float32(alpha))]), out.shape)
    if c is not None:
        if beta != 1.0:
            c = tensor(Generic(Op.MUL, [c, Known(np.float32(beta))]), c.shape)
        out = tensor(Generic(Op.ADD, [out, c]), broadcast(out.shape, c.shape))
    return [out]


def t_dropout(interp, node, ins):
    """Identity, as in the eval-mode export gcomp imports (no training_mode, or False);
    a model trained by gcomp gets its dropout from the bundled models' --dropout."""
    if len(ins) > 2 and ins[2] is not None:
        mode = want_known(ins[2], "Dropout's training_mode")
        if bool(mode.arr.reshape(-1)[0]):
            raise ModelImportError("exported in training mode (training_mode=True: random "
                                   "masks); export after model.eval()")
    return [ins[0], Fill(True, ins[0].shape, "bool")]


def t_if(interp, node, ins):
    cond = want_known(ins[0], "the If condition")
    branch = attr(node, "then_branch" if bool(cond.arr.reshape(-1)[0]) else "else_branch")
    interp.run(branch.node)
    return [interp.env[o.name] for o in branch.output]


TRANSFER = {
    "Constant": t_constant, "Shape": t_shape, "Size": t_size, "Identity": t_identity,
    "Cast": t_cast, "ConstantOfShape": t_constant_of_shape, "Range": t_range,
    "Reshape": t_reshape, "Squeeze": t_squeeze, "Unsqueeze": t_unsqueeze, "Flatten": t_flatten,
    "Transpose": t_transpose, "Expand": t_expand, "Tile": t_tile, "Concat": t_concat,
    "Slice": t_slice, "Split": t_split, "Gather": t_gather, "GatherND": t_gather_nd, "Equal": t_equal,
    "Not": t_not, "NonZero": t_nonzero, "Where": t_where, "ScatterElements": t_scatter_elements,
    "ScatterND": t_scatter_nd,
    **{k: t_unary for k in _UNARY}, "LeakyRelu": t_leaky_relu, "Elu": t_elu,
    "Softmax": t_softmax, "LogSoftmax": t_softmax, "Pow": t_pow, "Clip": t_clip,
    "Max": t_max_min, "Min": t_max_min, **{k: t_binary for k in _BINARY},
    "ReduceSum": t_reduce, "ReduceMean": t_reduce, "ReduceMax": t_reduce,
    "ReduceMin": t_reduce, "MatMul": t_matmul, "Gemm": t_gemm, "Dropout": t_dropout,
    "If": t_if,
}

