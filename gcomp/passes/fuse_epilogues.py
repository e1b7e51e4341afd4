"""Fuse elementwise work into the kernel that produces its input.

Expects: the graph after every pass that changes values (autodiff included: a
value the backward pass still needs has two users and stays materialized).
Guarantees (analysis only, values unchanged): fusion groups in ``meta``.  A group
has an anchor and a chain of members; each member's chain input is used by that
member alone and is not a graph output, so no intermediate of the group needs to
exist in memory.  ``anchor.meta["fused"]`` lists the members in order;
``member.meta["fused_into"]`` names the anchor.  Lowering emits one kernel for the
whole group, at the position of its last member, writing the last member's value.

Anchors and what they absorb:
* ``aggregate``, ``attention_aggregate`` and ``matmul`` (``x @ w`` or ``x @ w.T``): an
  epilogue of ``bias_add`` with a bias over the flat features, unary activations, and
  binary ops with a scalar, a column of one value per row or a tensor shaped like the
  result (e.g. GIN's
  ``(1 + eps) * x`` added after the sum); a ``reshape`` between them is a free view.
  A matmul also absorbs an activation's gradient applied to it (``dy @ W.T`` times
  relu'(y), the backward of a layer), the activation's output or input read per
  element; so does an aggregation that gathers (GIN's backward ``(A.T dz + (1 + eps)
  * dz) * relu'(h)``: the gradient is linear in what it scales, so the distributed
  runtime's partial sums of halo rows, each scaled by the same h, still add up).
  Aggregations over out-edges gather over the transposed graph unless the compiler
  scatters them with atomics (``PassContext.scatters_out_edges``: CUDA with
  ``prefer=memory`` and not ``deterministic``): an epilogue there must only add
  (``codegen/scatter_kernel.py``), so those take in nothing over out-edges.
  A binary member's other operand may itself be a binary op of such extra inputs that
  only this member uses (GIN's ``sum_j x_j + (1 + eps) * x``): it is computed per
  element in the epilogue (``meta["operand"]``), not stored and read back.  For an
  aggregation over out-edges (whose extras the distributed runtime zeroes on halo rows)
  only a product with a tensor shaped like the result, added, which vanishes there:
  GIN's backward ``A.T dy + (1 + eps) * dy`` (where it gathers).
  A matmul ``x @ w`` also takes in a second product ``x2 @ w2`` that an ``add`` of its
  epilogue adds (GraphSAGE's ``lin_l(mean) + lin_r(x)``; the parts of a concat's
  product, ``split_concat_products``: GGNN's gate gradients times the GRU weights):
  the kernel sums both products in the same registers (``meta["product"]`` on the second
  product), so neither is stored and read back, when the members before the add only
  add (a bias), the second product is read by that add alone, and neither x is node
  features or computed from them once per feed (those products have sparse-feature
  variants).  On CPUs only, and not where bfloat16 products run on AMX tiles
  (``PassContext.tile_products``): the tile kernel takes one product; lowering runs
  the two apart where the target's row-group kernel does not take their shapes
  (``codegen/lower.py``).
* any elementwise op (``elementwise_grad`` included): the elementwise ops it reads
  whose value only it uses, of its shape, and theirs in turn: a tree evaluated per
  element in one kernel (autodiff's gradient sums, ``dy + ds_dst * a_dst + ds_src *
  a_src``).  A ``slice`` of a static axis or a ``reshape`` keeping the node axis in
  the tree is read through by mapping indices, so no copy of it is made (d x sliced
  out of fused attention's [N, H*C + H] gradient).
* a ``sum``, ``mean`` or ``max`` over one axis: such a tree as its input, reduced
  while it is computed (GAT's scores ``sum(h * a, -1)``; a parameter's gradient
  ``sum(dy * x, axis=0)``), so the product is never stored.

    Before:  %a = aggregate(%g, %h, %norm) : f32[N,16]
             %b = bias_add(%a, %bias)      : f32[N,16]
             %r = relu(%b)                 : f32[N,16]
    After:   same values; %a.meta["fused"] = ["b", "r"]: one kernel computes %r

    Before:  %p = matmul(%m, %wl)    : f32[N,32]
             %b = bias_add(%p, %bl)  : f32[N,32]
             %q = matmul(%h, %wr)    : f32[N,32]
             %s = add(%b, %q)        : f32[N,32]
             %r = relu(%s)           : f32[N,32]
    After:   same values; %p.meta["fused"] = ["b", "q", "s", "r"], %q.meta["product"]:
             one kernel computes %r from %m, %wl, %h, %wr and %bl

    Before:  %m = mul(%h, %att) : f32[N,4,32]
             %s = sum(%m)       : f32[N,4]
    After:   same values; %m.meta["fused"] = ["s"]: one kernel computes %s
"""

from __future__ import annotations

from math import prod

from gcomp.ir.ops import Op, OpGroup
from gcomp.ir.types import TensorType
from gcomp.passes.fuse_bias_grads import per_feed
from gcomp.passes.manager import Pass

UNARY = OpGroup.Unary
CHAINABLE = OpGroup.Elementwise | {Op.ELEMENTWISE_GRAD}


def _flat(t: TensorType) -> int:
    return int(prod(t.shape[1:]))


def _extra_ok(v, out: TensorType) -> bool:
    """Can ``v`` be an extra input of an epilogue producing ``out``?"""
    t = v.ty
    if not isinstance(t, TensorType) or t.dtype != "float32":
        return False
    if t.rank == 0:
        return True
    if t.is_static and t.rank == 1 and t.shape[0] == _flat(out):
        return True  # a bias over the flat features
    if out.rank == 2 and t.shape == (out.shape[0], 1) and not isinstance(out.shape[0], int):
        return True  # a value per node or edge row (a mean's 1 / degree in its gradient)
    return t.shape == out.shape  # a tensor of the same shape


def _materialized(v) -> bool:
    """Does ``v`` have its own buffer?  (Anchors and inner members of groups do not.)"""
    if "fused" in v.meta:
        return False
    return "fused_into" not in v.meta or v.meta.get("tail", False)


def _absorbable_after_kernel(n, prev, anchor, gathers: bool) -> bool:
    if n.op == Op.RESHAPE:
        return True
    if n.op in UNARY:
        return True
    if n.op == Op.ELEMENTWISE_GRAD:
        return ((anchor.op == Op.MATMUL or anchor.op == Op.AGGREGATE and gathers)
                and len(n.inputs) == 2 and n.inputs[0] is prev
                and n.inputs[1] is not prev and n.ty.shape == prev.ty.shape
                and _extra_ok(n.inputs[1], n.ty) and _materialized(n.inputs[1]))
    if n.op in OpGroup.Binary:
        other = n.inputs[1] if n.inputs[0] is prev else n.inputs[0]
        return (other is not prev and n.ty.shape == prev.ty.shape
                and (_extra_ok(other, n.ty) and _materialized(other)
                     or _computed_operand(other, n, anchor, gathers)))
    return False


def _computed_operand(v, user, anchor, gathers: bool) -> bool:
    """Can operand ``v`` of epilogue member ``user`` be computed in the epilogue: a binary
    op of extra inputs, shaped like the result, that only ``user`` reads?  Over out-edges
    only a product with a tensor shaped like the result, added (``_vanishes_on_halo``)."""
    if (anchor.op == Op.AGGREGATE and anchor.attrs["flow"] == "out"
            and not (gathers and user.op == Op.ADD and _vanishes_on_halo(v, user))):
        return False
    return (v.op in OpGroup.Binary and v.ty == user.ty and len(v.users) == 1
            and v not in v.graph.outputs and sum(i is v for i in user.inputs) == 1
            and not {"fused", "fused_into"} & v.meta.keys()
            and v.meta.get("phase") == user.meta.get("phase")
            and all(_extra_ok(i, user.ty) and _materialized(i) for i in v.inputs))


def _second_product(v, user, anchor, members: list) -> bool:
    """Can matmul ``v``, added by epilogue member ``user``, be summed with ``anchor``'s
    product in its kernel (see the module docstring)?"""
    return (anchor.op == Op.MATMUL and not anchor.attrs["trans_a"] and user.op == Op.ADD
            and all(m.op in (Op.BIAS_ADD, Op.ADD) and not m.meta.get("product")
                    for m in members)
            and v.op == Op.MATMUL and not v.attrs["trans_a"] and v.ty == user.ty
            and len(v.users) == 1 and v not in v.graph.outputs
            and sum(i is v for i in user.inputs) == 1
            and not {"fused", "fused_into"} & v.meta.keys()
            and v.meta.get("phase") == anchor.meta.get("phase")
            and not per_feed(v.inputs[0]) and not per_feed(anchor.inputs[0]))


def _vanishes_on_halo(v, user) -> bool:
    """Is ``v`` a product with a tensor shaped like ``user``?  The distributed runtime
    zeroes the halo rows of an out-edge aggregation's row extras before it runs, so such
    a product is zero there and the halo rows' partial sums, which their owners add up,
    stay exact (GIN's backward ``A.T dy + (1 + eps) * dy``; the aggregation reads dy only
    at the rows a rank owns)."""
    return v.op == Op.MUL and any(i.ty == user.ty for i in v.inputs)


def _sole_user(v, graph):
    if len(v.users) != 1 or v in graph.outputs:
        return None
    return next(iter(v.users))


def _index_map(v) -> bool:
    """A view the tree can read through by mapping indices: a column range (``slice``
    of a static axis) or a regrouping of the static axes (``reshape`` keeping the node
    or edge axis), e.g. d x sliced out of fused attention's [N, H*C + H] gradient."""
    x = v.inputs[0].ty if v.inputs else None
    if not isinstance(x, TensorType) or isinstance(x.shape[0], int) or x.rank == 0:
        return False
    if v.op == Op.SLICE:
        return v.attrs["axis"] % x.rank != 0
    return v.op == Op.RESHAPE and v.ty.rank >= 1 and v.ty.shape[0] == x.shape[0]


def _tree_member(v, user, graph) -> bool:
    """Can input ``v`` of tree member ``user`` be computed inside the tree's kernel?
    Elementwise ops and views read through, of their elementwise user's shape (a value
    broadcast into its user is read per element from memory, not recomputed)."""
    if not isinstance(v.ty, TensorType) or v.ty.dtype != "float32":
        return False
    ok = (v.op in CHAINABLE or v.op in (Op.SLICE, Op.RESHAPE) and _index_map(v)) and (
        user.op not in CHAINABLE or v.ty.shape == user.ty.shape)
    return (ok and "fused" not in v.meta and "fused_into" not in v.meta
            and _sole_user(v, graph) is user and sum(i is v for i in user.inputs) == 1
            and v.meta.get("phase") == user.meta.get("phase"))


def _tree(root, graph) -> list:
    """The elementwise ops and views ``root`` reads that can be evaluated inside its
    kernel, with what they read in turn (``root`` itself excluded)."""
    found, stack = [], [root]
    while stack:
        user = stack.pop()
        for v in user.inputs:
            if v not in found and _tree_member(v, user, graph):
                found.append(v)
                stack.append(v)
    return found


def _tree_root(t) -> bool:
    """Can ``t`` end a tree (write the tree kernel's result)?"""
    if not isinstance(t.ty, TensorType):
        return False
    if t.op in OpGroup.Reduce:
        x = t.inputs[0].ty
        return isinstance(x, TensorType) and not x.is_static
    return t.op in CHAINABLE and not t.ty.is_static


class FuseEpilogues(Pass):
    name = "fuse_epilogues"

    def run(self, graph, ctx) -> bool:
        for n in graph:
            for key in ("fused", "fused_into", "tail", "operand", "product"):
                n.meta.pop(key, None)
        changed = False
        # out-edge aggregations gather (see the module docstring) unless they scatter
        gathers = ctx is None or not ctx.scatters_out_edges()
        products = ctx is None or ctx.target != "cuda" and not ctx.tile_products
        for n in graph:  # kernels, with the elementwise ops after them
            if n.op in (Op.AGGREGATE, Op.ATTENTION_AGGREGATE) or (n.op == Op.MATMUL
                                                                  and not n.attrs["trans_a"]):
                changed |= _group(n, self._epilogue(n, graph, gathers, products))
        order = {n: k for k, n in enumerate(graph)}
        for t in reversed(graph.nodes):  # elementwise trees, into the op that ends them
            if "fused" in t.meta or "fused_into" in t.meta or not _tree_root(t):
                continue
            inner = _tree(t, graph)
            if inner:
                inner.sort(key=order.__getitem__)
                changed |= _group(inner[0], inner[1:] + [t])
        return changed

    @staticmethod
    def _epilogue(n, graph, gathers: bool, products: bool) -> list:
        members, prev = [], n
        while True:
            u = _sole_user(prev, graph)
            if (u is None or "fused_into" in u.meta
                    or not _absorbable_after_kernel(u, prev, n, gathers)
                    or u.meta.get("phase") != n.meta.get("phase")):
                break
            if u.op in OpGroup.Binary:
                other = u.inputs[1] if u.inputs[0] is prev else u.inputs[0]
                if _computed_operand(other, u, n, gathers):  # evaluated in the epilogue, not stored
                    other.meta["operand"] = True
                    members.append(other)
                elif products and _second_product(other, u, n, members):  # summed with n's
                    other.meta["product"] = True
                    members.append(other)
            members.append(u)
            prev = u
        while members and members[-1].op == Op.RESHAPE:  # a trailing view stays a view
            members.pop()
        return members


def _group(anchor, members: list) -> bool:
    if not members:
        return False
    anchor.meta["fused"] = [m.name for m in members]
    for m in members:
        m.meta["fused_into"] = anchor.name
    members[-1].meta["tail"] = True
    return True
