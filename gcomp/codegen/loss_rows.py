"""Rows the masked loss does not read: computed only where the loss needs them.

A training step's loss is a mean over the nodes of the training mask
(``passes/add_loss.py``), but every kernel computes every node row.  The logits of the
other rows, and everything only they need, are wasted work; so are the rows of their
gradients, which are zero (the loss gradient is zero outside the mask, and products,
activation gradients and sums keep those rows zero).  When the runtime numbers the
mask's nodes first (``runtime/executor.py``: ``decide_layout``), each such kernel runs
on a prefix of the rows, rows [0, L) with L the mask's count: no kernel changes, only
views.

Expects: a lowered CPU training plan (``lower`` + ``add_optimizer``) whose loss kernel
reads the node input ``train_mask``, and the specs of its kernels.
Guarantees, with ``plan.loss_rows = {"mask": "train_mask"}`` (the plan dimension ``"L"``):

* A run step marked ``"rows": "L"`` computes only rows [0, L) of its output: its output
  and the node tensors it reads at the output's row (a product's x, an epilogue's extra,
  the labels and the mask) are viewed as ``["L", ...]``, and an aggregation over in-edges
  reads the first L + 1 entries of ``indptr`` (``{"graph", "array", "rows": "L"}``); the
  rows it gathers stay whole.  A sum over the rows (a weight gradient ``x.T @ dy``, a
  bias gradient) is marked so where one of its factors is zero past row L.
* A run step that aggregates over out-edges a tensor zero past row L reads the CSC arrays
  of the edges into rows [0, L) only (``"rows": "L"`` on ``csc_*``; the executor builds
  them once per bound graph); fixed edge weights are put in that CSC's order by a bind
  step of their own (``"E:<graph>|L"`` of them).  Weights read through ``csc_eid`` (the
  kernel sizes them by the edges it walks) keep the whole CSC.
* Every node tensor is valid wherever a later step reads it: a value computed on the
  prefix that a later step reads whole is zero past row L (a gradient, by the rules
  above), and a ``zero_rows`` step (``"tail": True``) writes those zeros right after it.
* With L equal to N (the runtime did not order the mask first: another format than CSR,
  distributed shards, no mask given) the plan computes what it computed before: views
  are whole, the restricted CSC is the whole CSC, and tail steps are skipped.

Not for CUDA plans (their kernels and CUDA graphs are not re-checked for prefix views).
"""

from __future__ import annotations

from gcomp.codegen.kernels import KernelSpec
from gcomp.passes.add_loss import TRAIN_MASK as MASK
from gcomp.runtime.plan import Plan

DIM = "L"

# ops whose value is zero where their (first) input is: relu(0) = tanh(0) = 0, ...
_ZERO_UNARY = {"relu", "leaky_relu", "elu", "neg", "tanh", "reshape", "slice"}
# elementwise_grad ops whose factor dy multiplies a finite derivative (0 * d = 0)
_FINITE_GRADS = {"relu", "leaky_relu", "elu", "sigmoid", "tanh", "maximum", "minimum", "max"}
# kernels whose node tensors are all read at the output's row
_ROWWISE = {"matmul", "ewise", "ewise_grad", "ewise_chain", "cross_entropy",
            "cross_entropy_grad", "cross_entropy_fused"}


def mark_loss_rows(plan: Plan, specs: dict) -> bool:
    """Mark ``plan``'s run steps (module docstring); False, changing nothing, where the
    plan's loss reads no ``train_mask``."""
    if not any(a.get("buf") == MASK for s in plan.steps for a in s["args"]
               if specs[s["kernel"]].kind.startswith("cross_entropy")):
        return False
    _Marking(plan, specs).run()
    plan.loss_rows = {"mask": MASK}
    return True


class _Marking:
    def __init__(self, plan: Plan, specs: dict):
        self.plan = plan
        self.specs = specs
        self.zero: set[str] = set()  # roots that are zero past row L
        self.need: dict[str, str] = {}  # root -> rows its readers read: "L" or "N"

    # ------------------------------------------------------------------ arguments
    def root(self, a: dict) -> str:
        return self.plan.buffers[a["buf"]].get("alias", a["buf"])

    def dims(self, a: dict) -> list:
        return a.get("view") or self.plan.buffers[a["buf"]]["dims"]

    def is_node(self, a: dict) -> bool:
        return "buf" in a and bool(self.dims(a)) and self.dims(a)[0] == "N"

    def is_zero(self, a: dict) -> bool:
        return self.is_node(a) and self.root(a) in self.zero

    def roles(self, s: dict) -> tuple[str, list[int], list[int], list[int]] | None:
        """(kind of step, the node arguments it reads at its output's row, those it reads
        at any row, those it writes) for the kernels this pass knows; None otherwise."""
        spec = self.specs[s["kernel"]]
        args = s["args"]
        node = [i for i, a in enumerate(args) if self.is_node(a)]
        if any("features" in a for a in args):
            return None  # sparse-feature kernels index rows through X's nonzeros
        kind, p = spec.kind, spec.p
        outs = [len(args) - 1] if node and node[-1] == len(args) - 1 else []
        if kind == "cross_entropy":  # z, y, m -> the log-sum-exps and the loss
            outs = [3]
        if kind in ("matmul_tn", "colsum"):
            return "sum", node, [], []
        if not outs:
            return None  # a kernel writing no node tensor (edge values, a scalar)
        if kind in _ROWWISE or (kind in ("reduce", "slice") and p["axis"] != 0) or (
                kind == "dropout" and args[0].get("nodes")):
            return "row", [i for i in node if i not in outs], [], outs
        arrays = {a["array"] for a in args if "graph" in a}
        if kind == "csr_agg" and "indptr" in arrays:
            x = len(args) - 2 - len(p.get("extras", ()))
            return "row", [i for i in node if i not in outs and i != x], [x], outs
        if kind == "csr_agg" and "csc_indptr" in arrays:
            x = len(args) - 2 - len(p.get("extras", ()))
            return "out_edges", [i for i in node if i not in outs and i != x], [x], outs
        if kind == "attention_agg":  # s_src, s_dst, x: the source scores and rows gathered
            s_src, s_dst, x = [i for i, a in enumerate(args) if "buf" in a][:3]
            return "row", [i for i in node if i not in outs + [s_src, x]], [s_src, x], outs
        return None

    # ------------------------------------------------------------------ zero rows
    def chain_zero(self, s: dict, base: bool) -> bool:
        """Whether a matmul or aggregation's epilogue keeps its result zero past row L
        (``base``: whether the sums are)."""
        p = self.specs[s["kernel"]].p
        extras = s["args"][len(s["args"]) - 1 - len(p.get("extras", ())):-1]

        def operand(o) -> bool:
            if isinstance(o, int):
                return self.is_zero(extras[o])
            if isinstance(o, (tuple, list)) and len(o) == 3:
                return self.combine(o[0], o[1], [operand(v) for v in o[2]])
            return False
        cur = base
        for op, attrs, o, swapped in p.get("epilogue", ()):
            vals = [cur] if o is None else [operand(o), cur] if swapped else [cur, operand(o)]
            cur = self.combine(op, attrs, vals)
        return cur

    @staticmethod
    def combine(op: str, attrs: dict, zeros: list[bool]) -> bool:
        """Whether ``op`` of operands that are (True) or may not be (False) zero past row L
        is zero there."""
        if op == "mul":
            return any(zeros)
        if op == "div":
            return zeros[0]
        if op in ("add", "sub", "maximum", "minimum"):
            return all(zeros)
        if op == "elementwise_grad":  # dy times a finite derivative
            return zeros[0] and dict(attrs).get("op") in _FINITE_GRADS
        return len(zeros) == 1 and zeros[0] and op in _ZERO_UNARY

    def tree_zero(self, expr, args: list) -> bool:
        if expr[0] == "in":
            return self.is_zero(args[expr[1]])
        op, attrs, children = expr
        return self.combine(op, attrs, [self.tree_zero(c, args) for c in children])

    def zero_output(self, s: dict) -> bool:
        """Whether step ``s`` writes a node tensor that is zero past row L."""
        spec = self.specs[s["kernel"]]
        kind, p, args = spec.kind, spec.p, s["args"]
        if kind in ("cross_entropy_fused", "cross_entropy_grad"):
            return any(a.get("buf") == MASK for a in args)
        if kind == "matmul":
            base = self.is_zero(args[0]) and ("K2" not in p or self.is_zero(args[2]))
            return self.chain_zero(s, base)
        if kind == "ewise":
            return self.combine(p["op"], p.get("attrs", {}),
                                [self.is_zero(a) for a in args[:-1]])
        if kind == "ewise_grad":
            return self.combine("elementwise_grad", {"op": p["op"]}, [self.is_zero(args[0])])
        if kind == "ewise_chain":
            return self.tree_zero(p["expr"], args)
        if kind == "reduce" and p["axis"] != 0 and p["op"] in ("sum", "mean"):
            return self.tree_zero(p["expr"], args) if "expr" in p else self.is_zero(args[0])
        if kind in ("slice", "dropout") and self.roles(s):
            return self.is_zero(args[-3 if kind == "dropout" else 0])
        return False

    def sums_zero(self, s: dict) -> bool:
        """Whether a sum over rows (``matmul_tn``, ``colsum``) has a factor zero past L."""
        p = self.specs[s["kernel"]].p
        if "expr" in p:
            return self.tree_zero(p["expr"], s["args"])
        return any(self.is_zero(a) for a in s["args"][:-1])

    # ------------------------------------------------------------------ the marking
    def run(self) -> None:
        steps = self.plan.steps
        for s in steps:  # forward: which outputs are zero past row L
            r = self.roles(s)
            if r is not None and r[3] and self.zero_output(s):
                self.zero.update(self.root(s["args"][i]) for i in r[3])
        for o in self.plan.outputs:
            if o["dims"] and o["dims"][0] == "N":
                self.need[self.plan.buffers[o["buffer"]].get("alias", o["buffer"])] = "N"
        tails = []
        for s in reversed(steps):  # backward: which rows each step must compute
            r = self.roles(s)
            if r is None:
                self.read(s, [i for i, a in enumerate(s["args"]) if self.is_node(a)], "N")
                continue
            kind, rows_in, gathered, outs = r
            if kind == "sum":
                rows = DIM if self.sums_zero(s) else "N"
            elif kind == "out_edges":
                x = gathered[0]
                if self.is_zero(s["args"][x]) and self.restrictable(s):
                    self.restrict_csc(s)
                    self.read(s, [x], DIM)
                    gathered = []
                rows = "N"
            else:
                wanted = {self.need.get(self.root(s["args"][i])) for i in outs}
                prefix = all(self.root(s["args"][i]) in self.zero for i in outs)
                rows = DIM if "N" not in wanted or prefix else "N"
                if rows == DIM:
                    tails += [(s, i) for i in outs if self.need.get(self.root(s["args"][i])) == "N"]
            if rows == DIM:
                self.prefix(s, rows_in + outs)
            self.read(s, rows_in, rows)
            self.read(s, gathered, "N")
        for s, i in tails:
            self.zero_tail(s, i)
        self.drop_unread_bind_steps()

    def read(self, s: dict, idx: list[int], rows: str) -> None:
        for i in idx:
            root = self.root(s["args"][i])
            if self.need.get(root) != "N":
                self.need[root] = rows

    def prefix(self, s: dict, idx: list[int]) -> None:
        """Run step ``s`` on rows [0, L): its row arguments and in-edge ``indptr`` viewed
        so (copies: lowering may share an argument's dict between steps)."""
        s["rows"] = DIM
        args = [dict(a) for a in s["args"]]
        for i in idx:
            args[i]["view"] = [DIM] + list(self.dims(args[i])[1:])
        for a in args:
            if a.get("array") == "indptr" or a.get("nodes"):
                a["rows"] = DIM
        s["args"] = args

    def restrictable(self, s: dict) -> bool:
        """Whether out-edge aggregation ``s`` can read a restricted CSC: its weights, if
        any, are in CSC order (``lower.csc_order``), not read through ``csc_eid`` (the
        kernel sizes the weights by the edges it walks)."""
        p = self.specs[s["kernel"]].p
        return p["weight"] == "none" or not p.get("indirect")

    def restrict_csc(self, s: dict) -> None:
        """Aggregate over the out-edges into rows [0, L) only; fixed weights are put in
        that CSC's order once per bound graph, into a buffer of their own."""
        args = [dict(a, rows=DIM) if str(a.get("array", "")).startswith("csc_") else dict(a)
                for a in s["args"]]
        if self.specs[s["kernel"]].p["weight"] != "none":
            w = next(i for i, a in enumerate(args) if "buf" in a)  # the CSC-ordered weights
            name = f"{args[w]['buf']}.{DIM}"
            if name not in self.plan.buffers:
                made = next(b for b in self.plan.bind_steps
                            if b["args"][-1] == {"buf": args[w]["buf"]})
                eid = made["args"][0]
                dims = self.plan.buffers[args[w]["buf"]]["dims"]
                self.plan.buffers[name] = {"dims": [f"{dims[0]}|{DIM}", *dims[1:]],
                                           "dtype": "float32"}
                self.plan.bind_steps.append({**made, "args": [dict(eid, rows=DIM), made["args"][1],
                                                              {"buf": name}]})
            args[w] = {"buf": name}
        s["args"] = args

    def zero_tail(self, s: dict, i: int) -> None:
        a = s["args"][i]
        dims = self.plan.buffers[a["buf"]]["dims"] if "view" not in a else a["view"]
        width = 1
        for d in dims[1:]:
            width *= int(d)
        spec = KernelSpec.make("zero_rows", F=width)
        self.specs[spec.name] = spec
        step = {"kernel": spec.name, "args": [{"buf": a["buf"], "view": [DIM, width]},
                                              {"buf": a["buf"], "view": ["N", width]}],
                "node": s["node"], "op": "zero_rows", "attrs": {}, "tail": True}
        for key in ("when", "unless"):
            if key in s:
                step[key] = s[key]
        steps = self.plan.steps
        steps.insert(steps.index(s) + 1, step)

    def drop_unread_bind_steps(self) -> None:
        """CSC-ordered weights no step reads any more (``restrict_csc``) are not made."""
        read = {a["buf"] for s in self.plan.feed_steps + self.plan.steps
                for a in s["args"] if "buf" in a}
        for b in list(self.plan.bind_steps):
            out = b["args"][-1].get("buf", "")
            if out.endswith((".csc", f".csc.{DIM}")) and out not in read:
                self.plan.bind_steps.remove(b)
                del self.plan.buffers[out]
