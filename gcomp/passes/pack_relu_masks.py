"""Keep a ReLU's signs for its gradient, not its output (``--prefer memory``).

Expects: a verified graph after autodiff and rematerialize, in the order lowering will
run it (the pass compares readers' positions).
Guarantees: the same values.  Where the gradient of ``y = relu(...)`` (autodiff's
``elementwise_grad[op="relu", of_output]``, dy * (y > 0)) is y's last reader, y is a
float32 node tensor [N, F] and not an output, and a node-sized buffer that an aggregation
or a product reads is made and freed between y's last value reader and the gradient (y
held there adds to the memory in use), the gradient reads the signs of y packed 32 to a
word instead, taken just after y is computed: ``mask_bits(dy, sign_bits(y))``.  y's storage is
then free after its last value reader (a weight gradient, an aggregation computed again)
rather than held through the backward steps in between until its gradient: GraphSAGE's
last hidden activation, [N, 32], stays alive through its layer's whole backward pass for
the mask alone.  The words cost 4 bytes per 32 features a node, a sixteenth of the
bfloat16 activation; the price is one pass over y to pack and the mask as its own kernel
(it is no longer folded into the kernel that produces dy).  With the option
``prefer="speed"`` (the default) the pass changes nothing.

    Before:  %y = relu(%z)                              : f32[N,32]
             %w = matmul[trans_a=true](%y, %dz)         : f32[32,40]   (last value reader)
             ...
             %dy.y = elementwise_grad[op="relu", of_output=true](%dy, %y)
    After:   %y = relu(%z)
             %y.signs = sign_bits(%y)                   : i32[N,1]
             %w = matmul[trans_a=true](%y, %dz)
             ...
             %dy.y = mask_bits(%dy, %y.signs)                (the gradient's name)
"""

from __future__ import annotations

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.passes.manager import Pass


def _packable(g: Node, at: dict, outputs: list) -> bool:
    if not (g.op == Op.ELEMENTWISE_GRAD and g.attrs["op"] == "relu" and g.attrs["of_output"]
            and len(g.inputs) == 2):
        return False
    dy, y = g.inputs
    if not (y.ty.is_node and y.ty.rank == 2 and isinstance(y.ty.shape[1], int)
            and y.ty.dtype == "float32" and dy.ty == y.ty == g.ty and y not in outputs):
        return False
    readers = [at[u] for u in y.users if u is not g]
    if not readers or max(readers) > at[g]:
        return False
    last = max(readers)
    return any(_held_between(v, last, at[g], at) for v in at if last < at[v] < at[g])


def _held_between(v: Node, start: int, end: int, at: dict) -> bool:
    """Is ``v`` a node-sized buffer made and freed between positions start and end: a kernel
    input (an aggregation's or a product's, which no fusion folds away) whose readers all
    come before ``end``?  y held through that interval for its mask alone adds to the
    memory in use there; y packed does not."""
    return (getattr(v.ty, "is_node", False) and bool(v.users)
            and any(u.op in (Op.AGGREGATE, Op.MATMUL) for u in v.users)
            and all(start < at[u] < end for u in v.users))


class PackReluMasks(Pass):
    name = "pack_relu_masks"

    def run(self, graph: Graph, ctx) -> bool:
        if ctx is None or ctx.option("prefer") != "memory":
            return False
        at = {n: k for k, n in enumerate(graph.nodes)}
        changed = False
        for g in [n for n in graph.nodes if _packable(n, at, graph.outputs)]:
            dy, y = g.inputs
            nodes = graph.nodes
            with graph.inserting_before(nodes[nodes.index(y) + 1]):
                signs = graph.create_node(Op.SIGN_BITS, [y],
                                          name=graph.fresh_name(f"{y.name}.signs"))
            with graph.inserting_before(g):
                mask = graph.create_node(Op.MASK_BITS, [dy, signs])
            graph.replace_all_uses_with(g, mask)
            name = g.name
            graph.erase_node(g)
            graph.rename(mask, name)
            changed = True
        return changed
