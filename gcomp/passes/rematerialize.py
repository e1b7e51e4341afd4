"""Recompute values in the backward pass instead of keeping them from the forward pass.

Expects: a verified graph right after autodiff: the loss is the first output, and the
nodes after it are the backward pass.
Guarantees: the same values.  A forward ``add``, ``sub``, ``mul`` or ``neg`` of node-sized
tensors (leading axis N) whose every node-sized input the backward pass reads anyway is
computed again just before its first backward reader, and the backward readers take the
copy.  The forward value then has forward readers only, where fusion folds it into their
kernel, and nothing node-sized lives from the forward pass to the backward pass for it;
the copy folds into the backward kernel that reads it.  A GRU's ``h - n`` (read by the
new state and by the gradient of the update gate; h and n are kept for their own
gradients) no longer stays in memory through the step: 83 MB per GRU step of GGNN on the
arxiv-size graph at hidden 128.

    Before:  %s = sub(%h, %n)          : f32[N,8]      (forward; %h, %n read by the backward)
             %loss = ...
             %dz = mul(%dy, %s)        : f32[N,8]      (backward)
    After:   %s = sub(%h, %n)          : f32[N,8]      (forward readers only)
             %loss = ...
             %s.again = sub(%h, %n)    : f32[N,8]
             %dz = mul(%dy, %s.again)  : f32[N,8]

With the pass option ``prefer="memory"`` a sum or mean aggregation over in-edges is cheap
enough too (one more pass over the edges a step, for an [N, F] buffer less through the
step), where its node input depends on the parameters (an aggregation of the fed features
is computed once per feed instead) and its other inputs do not: GIN's
``sum_j h_j + (1 + eps) * h`` and GraphSAGE's ``mean_j h_j``, which the backward pass
reads for the weight gradient of the linear layer after them, are computed again from h,
which the backward reads anyway; so is a product of the fed features with a weight
(GIN's ``x W``, which its eps gradient reads: a product over the features a step, for an
[N, hidden] buffer less through the step).  An input that is not read by the backward but
is itself recomputable in this sense (GIN's aggregation inside that sum) is computed again
with it.
"""

from __future__ import annotations

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import N
from gcomp.passes.hoist_graph_static import phases
from gcomp.passes.manager import Pass

CHEAP = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.NEG})


def _node_sized(v: Node) -> bool:
    return getattr(v.ty, "rank", 0) >= 1 and v.ty.shape[0] == N  # a graph has no rank


class Rematerialize(Pass):
    name = "rematerialize"

    def run(self, graph: Graph, ctx) -> bool:
        if not graph.outputs:
            return False
        order = {n: k for k, n in enumerate(graph.nodes)}
        end = order[graph.outputs[0]]  # the loss: what comes after it is the backward pass
        memory_first = ctx is not None and ctx.option("prefer") == "memory"
        phase = phases(graph)  # "run": depends on the parameters (or step counters)

        def backward(u: Node) -> bool:
            return order.get(u, end + 1) > end

        def kept(i: Node) -> bool:
            return any(map(backward, i.users))

        def recomputable(v: Node) -> bool:
            """v can be computed again from values the backward pass keeps anyway (and
            from recomputable forward values)."""
            if not _node_sized(v) or order.get(v, end) >= end:
                return False
            if v.op in CHEAP:
                node_inputs = [i for i in v.inputs if _node_sized(i)]
            elif (memory_first and v.op == Op.AGGREGATE and v.attrs.get("flow", "in") == "in"
                  and v.attrs.get("reduce", "sum") in ("sum", "mean")):
                x, others = v.inputs[1], v.inputs[2:]
                if phase[x] != "run" or any(phase[i] == "run" for i in others):
                    return False
                node_inputs = [x]
            elif (memory_first and v.op == Op.MATMUL and v.inputs[0].op == Op.INPUT
                  and v.inputs[1].op == Op.PARAM
                  and not (v.attrs.get("trans_a") or v.attrs.get("trans_b"))):
                node_inputs = []  # a graph input stays through the step: nothing to keep
            else:
                return False
            return all(kept(i) or recomputable(i) for i in node_inputs)

        changed = False
        for v in list(graph.nodes[:end]):
            late = [u for u in v.users if backward(u)]
            if not late or not recomputable(v):
                continue
            first = min(late, key=graph.nodes.index)
            if not _node_sized(first):
                self._early(graph, first, v, graph.outputs[0])
            with graph.inserting_before(first):
                again = self._again(graph, v, lambda i: not kept(i) and recomputable(i), {})
            for u in late:
                u.replace_input(v, again)
            changed = True
        return changed

    @staticmethod
    def _early(graph: Graph, u: Node, v: Node, loss: Node) -> None:
        """Move u (a backward reader of v whose value is small: a weight gradient) up to
        just after its other inputs, so the copy of v lives only as long as it needs to
        and the node-sized values u reads may die before others are made (autodiff puts
        a product's input gradient before its weight gradient)."""
        nodes = graph.nodes
        at = max([nodes.index(i) for i in u.inputs if i is not v] + [nodes.index(loss)]) + 1
        if at < nodes.index(u):
            graph.move_before(u, nodes[at])

    def _again(self, graph: Graph, v: Node, copied, copies: dict) -> Node:
        """v computed again, with those of its inputs that ``copied`` names (recomputable
        values the backward pass does not keep) computed again first."""
        if v not in copies:
            inputs = [self._again(graph, i, copied, copies) if copied(i) else i
                      for i in v.inputs]
            copies[v] = graph.create_node(v.op, inputs, dict(v.attrs),
                                          name=graph.fresh_name(f"{v.name}.again"))
        return copies[v]
