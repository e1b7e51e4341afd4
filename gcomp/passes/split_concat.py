"""Products of a concatenation, computed from its parts.

Expects: a verified graph, typically right after autodiff: the gradient of a value sliced
into column ranges (a GRU's gates) is the concat of the slices' gradients, read by the
two products of the weight that made the value and by its bias's column sum.
Guarantees: the same values up to the order of float additions.  A concat of rank-2
parts along the last axis whose every user is one of

    matmul(c, W)            ->  add over k of matmul(part_k, W[rows of part k])
    matmul(c, W, trans_b)   ->  add over k of matmul(part_k, W[:, columns of part k], trans_b)
    matmul(X, c, trans_a)   ->  concat over k of matmul(X, part_k, trans_a)   (weight-sized)
    sum(c, axis 0)          ->  concat over k of sum(part_k, axis 0)          (bias-sized)

is no longer stored: its users read the parts, which are live anyway.  A 3-step GGNN
(hidden 128) on the arxiv-size graph held two such [N, 384] gradients (248 MB each) at
its busiest step.

    Before:  %c = concat(%a, %b, axis=1)              : f32[N,256]
             %y = matmul(%c, %w, trans_b=True)         : f32[N,128]   (%w : f32[128,256])
    After:   %y = add(matmul(%a, slice(%w, 1, 0, 128), trans_b=True),
                      matmul(%b, slice(%w, 1, 128, 256), trans_b=True))
"""

from __future__ import annotations

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.passes.manager import Pass


def _form(u: Node, c: Node) -> str | None:
    """How user ``u`` reads concat ``c``: "rows" (c @ W), "cols" (c @ W^T), "tn" (X^T @ c),
    "sum" (column sums), or None (anything else keeps c)."""
    a = u.attrs
    if u.op == Op.MATMUL and u.inputs[0] is c and u.inputs[1] is not c and not a["trans_a"]:
        return "cols" if a["trans_b"] else "rows"
    if (u.op == Op.MATMUL and u.inputs[1] is c and u.inputs[0] is not c and a["trans_a"]
            and not a["trans_b"]):
        return "tn"
    if u.op == Op.SUM and a["axis"] % 2 == 0 and not a["keepdims"]:
        return "sum"
    return None


class SplitConcatProducts(Pass):
    name = "split_concat_products"

    def run(self, graph: Graph, ctx) -> bool:
        changed = False
        for c in list(graph):
            if (c.op != Op.CONCAT or c.ty.rank != 2 or c.attrs["axis"] % 2 != 1
                    or c in graph.outputs or not c.users):
                continue
            forms = {u: _form(u, c) for u in c.users}
            if None in forms.values():
                continue
            for u, form in forms.items():
                with graph.inserting_before(u):
                    done = self._split(graph, c, u, form)
                graph.replace_all_uses_with(u, done)
                name = u.name
                graph.erase_node(u)
                graph.rename(done, name)  # gradients are found by name (meta["grads"])
            graph.erase_node(c)
            changed = True
        return changed

    @staticmethod
    def _split(graph: Graph, c: Node, u: Node, form: str) -> Node:
        def new(op, inputs, hint, **attrs):
            return graph.create_node(op, inputs, attrs, name=graph.fresh_name(f"{u.name}.{hint}"))

        pieces, start = [], 0
        for k, part in enumerate(c.inputs):
            stop = start + int(part.ty.shape[1])
            if form in ("rows", "cols"):
                w = u.inputs[1]
                ws = new(Op.SLICE, [w], "w", axis=0 if form == "rows" else 1, start=start,
                         stop=stop)
                pieces.append(new(Op.MATMUL, [part, ws], f"part{k}", trans_a=False,
                                  trans_b=form == "cols"))
            elif form == "tn":
                pieces.append(new(Op.MATMUL, [u.inputs[0], part], f"part{k}", trans_a=True,
                                  trans_b=False))
            else:
                pieces.append(new(Op.SUM, [part], f"part{k}", axis=0, keepdims=False))
            start = stop
        if form in ("rows", "cols"):
            total = pieces[0]
            for p in pieces[1:]:
                total = new(Op.ADD, [total, p], "sum")
            return total
        return new(Op.CONCAT, pieces, "cat", axis=1 if form == "tn" else 0)
