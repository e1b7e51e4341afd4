"""Lower an optimized Graph IR graph to an execution plan and the kernels it calls.

Expects: the graph after the pass pipeline (no bare ``scatter`` of a gathered
message is required, but one costs an E x F buffer), with ``meta["phase"]``
from ``hoist_graph_static``.  Produces a ``Plan`` (runtime data) and the
``KernelSpec`` of every kernel it names.  Each IR value gets a buffer named
after it; ``reshape`` becomes a view of its input.
"""

from __future__ import annotations

from math import prod

from gcomp.codegen.kernels import KernelSpec, target_definition
from gcomp.codegen.scatter_kernel import additive
from gcomp.errors import CompileError
from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import OpGroup, Op
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType, value_role
from gcomp.runtime.plan import Plan, kernel_kind


def plan_dims(ty: TensorType) -> list:
    return ["N" if d == N else f"E:{d.graph}" if isinstance(d, EdgeDim) else int(d)
            for d in ty.shape]


def _spec_shape(ty: TensorType) -> tuple:
    return tuple("n" if not isinstance(d, int) else d for d in ty.shape)


NODE_IDS = {"nodes": "ids"}  # the user's id of each node row (the runtime may reorder nodes)


def _scalar_attrs(n: Node) -> dict:
    return {k: v for k, v in n.attrs.items() if isinstance(v, (str, int, float, bool))}


def _in_place(step: dict, args: list[int]) -> None:
    """Let the memory plan give ``step``'s output (its last argument) the storage of the
    input arguments ``args`` when their lifetime ends at this step: the kernel reads each
    of them only at the index it writes, before writing it (elementwise kernels)."""
    if args:
        step["in_place"] = args


def _contraction(n: Node) -> int:
    """K of matmul ``n`` (``x @ w`` or ``x @ w.T``): the length of its sums."""
    w = n.inputs[1]
    return int(w.ty.shape[1] if n.attrs["trans_b"] else w.ty.shape[0])


def _remapped_leaves(expr) -> set[int]:
    """Leaves of an elementwise tree read at another index than the output's (under a
    slice or a reshape)."""
    if expr[0] == "in":
        return set()
    op, _, args = expr
    found = set().union(*(_remapped_leaves(a) for a in args))
    if op in ("slice", "reshape"):
        stack = list(args)
        while stack:
            e = stack.pop()
            if e[0] == "in":
                found.add(e[1])
            else:
                stack.extend(e[2])
    return found


def _node_inputs_of(v: Node) -> list[str]:
    """Names of the node inputs ``v`` is computed from."""
    seen, stack, found = set(), [v], set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == Op.INPUT and isinstance(u.ty, TensorType) and u.ty.is_node:
            found.add(u.name)
        stack.extend(u.inputs)
    return sorted(found)


class _Lowering:
    def __init__(self, graph: Graph, formats: tuple = (), scatter: bool = False,
                 gpu: bool = False, target: dict | None = None):
        self.graph = graph
        self.gpu = gpu
        self.target = target
        self.plan = Plan()
        self.specs: dict[str, KernelSpec] = {}
        self.formats = tuple(formats)
        self.scatter = scatter

    # -------------------------------------------------------------- helpers
    def buffer(self, n: Node, dims=None, alias: str | None = None, name: str | None = None) -> str:
        name = name or n.name
        entry = {"dims": dims if dims is not None else plan_dims(n.ty), "dtype": n.ty.dtype}
        if alias is not None:
            entry["alias"] = alias
        self.plan.buffers[name] = entry
        return name

    def arg(self, n: Node | str, view: list | None = None) -> dict:
        name = n if isinstance(n, str) else n.name
        a = {"buf": name}
        if view is not None and view != self.plan.buffers[name]["dims"]:
            a["view"] = view
        return a

    @staticmethod
    def garr(g: Node, array: str) -> dict:
        return {"graph": g.name, "array": array}

    def step(self, n: Node, spec: KernelSpec, args: list, when: str | None = None,
             unless: str | None = None, phase: str | None = None) -> dict:
        """Emit a kernel call; ``when``/``unless`` name a runtime variant it belongs to;
        ``phase`` (default: the node's) when it runs."""
        self.specs[spec.name] = spec
        phase = phase or n.meta.get("phase", "run")
        s = {"kernel": spec.name, "args": args, "node": n.name, "op": n.op.value,
             "attrs": {k: v for k, v in n.attrs.items() if isinstance(v, (str, int, float))}}
        if when:
            s["when"] = when
        if unless:
            s["unless"] = unless
        {"bind": self.plan.bind_steps, "feed": self.plan.feed_steps}.get(
            phase, self.plan.steps).append(s)
        return s

    # -------------------------------------------------------------- sparse input features
    @staticmethod
    def _is_feature_input(v: Node) -> bool:
        return (v.op == Op.INPUT and isinstance(v.ty, TensorType) and v.ty.is_node
                and v.ty.rank == 2 and v.ty.dtype == "float32")

    def feature_operand(self, v: Node):
        """(values, dropout or None, aggregation or None) when a matmul of ``v`` has a
        sparse variant: ``v`` is node features or dropout of them; an aggregation of the
        features computed once per feed (``reorder_linear`` hoists A X in training),
        a sum, whose variant, when the features are sparse, multiplies X's nonzeros first
        and aggregates the narrow product (A X is denser than X: Cora 98.7% -> 95% zeros);
        or other values computed from node inputs once per feed (their own variant,
        measured once computed)."""
        if self._is_feature_input(v):
            return v, None, None
        if v.op == Op.DROPOUT and self._is_feature_input(v.inputs[0]):
            return v.inputs[0], v, None
        if self._aggregated_features(v):
            return v.inputs[1], None, v
        if (v.meta.get("phase") == "feed" and isinstance(v.ty, TensorType) and v.ty.is_node
                and v.ty.rank == 2 and v.ty.dtype == "float32"):
            return v, None, None
        return None

    def _aggregated_features(self, v: Node) -> bool:
        """Is ``v`` a sum over in-edges of the features (fixed edge weights or none),
        computed once per feed?  (A mean's transpose also divides by the destinations'
        degrees: mean aggregations of the features keep their own measured variant.)"""
        return (v.op == Op.AGGREGATE and v.meta.get("phase") == "feed"
                and v.attrs["flow"] == "in" and v.attrs["reduce"] == "sum"
                and self._is_feature_input(v.inputs[1]) and "fused" not in v.meta
                and (len(v.inputs) < 3 or (v.inputs[2].ty.rank == 1
                                           and v.inputs[2].meta.get("phase") == "bind")))

    def _read_only_by_products(self, v: Node) -> bool:
        """Whether ``v`` is read only as the x of products ``x @ w`` (those have sparse
        variants) and is not a model output: a sparse variant may then skip computing it.
        A value with no readers is an output (dead values are gone), and must be computed."""
        return (bool(v.users) and v not in self.graph.outputs
                and all(u.op == Op.MATMUL and u.inputs[0] is v and not u.attrs["trans_b"]
                        for u in v.users))

    def variant(self, x: Node) -> str:
        """The sparse variant of node values ``x``; for computed values, ``sources`` names
        the node inputs they are computed from (the runtime measures them after feeding)."""
        key = f"sparse:{x.name}"
        if key not in self.plan.variants:
            v = {"input": x.name, "threshold": None}
            if x.op != Op.INPUT:
                v["sources"] = _node_inputs_of(x)
            self.plan.variants[key] = v
        return key

    @staticmethod
    def farr(x: Node, array: str) -> dict:
        return {"features": x.name, "array": array}

    def feature_values(self, x: Node, drop: Node | None) -> dict:
        """Values of the nonzeros of x (after dropout's mask when there is one)."""
        if drop is None:
            return self.farr(x, "values")
        return self.arg(f"{drop.name}.nnz")

    def sparse_feature_matmul(self, n: Node, x: Node, drop: Node | None, w: Node, out: Node,
                              chain=(), kinds=(), ext_args=(), agg: Node | None = None) -> None:
        """The sparse-X variant of x @ w: an aggregation over X's nonzeros (rows of w);
        of (A x) @ w (``agg``): A (x @ w), the product first, into a buffer of its own."""
        key = self.variant(x)
        M = int(w.ty.shape[1])
        xw = self.buffer(n, dims=["N", M], name=f"{n.name}.xw") if agg is not None else None
        fused = {"epilogue": chain, "extras": kinds} if chain and agg is None else {}
        spec = KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge", **fused)
        args = [self.farr(x, "indptr"), self.farr(x, "indices"), self.feature_values(x, drop),
                self.arg(w)]
        if agg is None:
            self.step(n, spec, args + list(ext_args) + [self.arg(out)], when=key)
            return
        self.step(n, spec, args + [self.arg(xw)], when=key)
        self.aggregate_step(n, agg, {"buf": xw}, self.arg(out, self.flat2(out)), M,
                            (tuple(chain), tuple(kinds), list(ext_args)), "in", when=key)

    def sparse_feature_grad(self, n: Node, x: Node, drop: Node | None, dy: Node,
                            agg: Node | None = None) -> None:
        """The sparse-X variant of x.T @ dy: an aggregation over X's columns (CSC); of
        (A x).T @ dy (``agg``): x.T @ (A.T dy), the aggregation over out-edges first."""
        key = self.variant(x)
        M = int(dy.ty.shape[1])
        src = self.arg(dy)
        if agg is not None:
            src = {"buf": self.buffer(n, dims=["N", M], name=f"{n.name}.adj")}
            self.aggregate_step(n, agg, self.arg(dy), src, M, ((), (), []), "out", when=key)
        spec = KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge", indirect=True)
        args = [self.farr(x, "csc_indptr"), self.farr(x, "csc_indices"), self.farr(x, "csc_eid"),
                self.feature_values(x, drop), src, self.arg(n)]
        self.step(n, spec, args, when=key)

    # -------------------------------------------------------------- adjacency formats
    def offer_formats(self, n: Node, g: Node, spec: KernelSpec, wview: list, step: dict,
                      transpose: bool) -> None:
        """Give an aggregation step (its args: graph arrays, weights, then x, extras, out)
        the dense, banded and ELL kernels the runtime may run instead
        (``gcomp/runtime/formats.py``): for sum and mean with one weight per edge or none,
        run on every step (aggregations run once per graph or feed stay CSR)."""
        p = spec.p
        if (not self.formats or p["weight"] == "head" or p["reduce"] not in ("sum", "mean")
                or n.meta.get("phase", "run") != "run"):
            return
        fused = {k: p[k] for k in ("epilogue", "extras") if k in p}
        kernels, packs = {}, {}
        for fmt in self.formats:
            agg = KernelSpec.make("format_agg", fmt=fmt, reduce=p["reduce"], F=p["H"] * p["C"],
                                  transpose=transpose, **fused)
            self.specs[agg.name] = agg
            kernels[fmt] = agg.name
            if fmt != "ell":  # packed by the runtime (formats.pack_ell)
                pack = KernelSpec.make("format_pack", fmt=fmt, weight=p["weight"])
                self.specs[pack.name] = pack
                packs[fmt] = pack.name
        step["formats"] = {"graph": g.name, "weights": wview[0] if wview else None,
                           "width": p["H"] * p["C"], "transpose": transpose,
                           "kernels": kernels, "pack": packs,
                           "tail": len(step["args"]) - len(p.get("extras", ())) - 2}

    @staticmethod
    def lead(n: Node) -> str:
        d = n.ty.shape[0]
        return "N" if d == N else f"E:{d.graph}"

    def flat2(self, n: Node) -> list:
        """[lead, prod(rest)] view of a tensor (lead: its symbolic or first static axis)."""
        lead = n.ty.shape[0] if isinstance(n.ty.shape[0], int) else self.lead(n)
        return [lead, int(prod(n.ty.shape[1:]))]

    # -------------------------------------------------------------- driver
    def run(self) -> tuple[Plan, dict[str, KernelSpec]]:
        for n in self.graph:
            self.lower(n)
        for o in self.graph.outputs:
            if isinstance(o.ty, GraphType):
                raise CompileError(f"output %{o.name} is a graph; outputs must be tensors")
            out = {"name": o.name, "buffer": o.name, "role": value_role(o.ty),
                   "dims": plan_dims(o.ty)}
            if o.ty.edge_graph:
                out["graph"] = o.ty.edge_graph
            self.plan.outputs.append(out)
        if not self.gpu:
            self.stream_in_order_outputs()
        return self.plan, self.specs

    def stream_in_order_outputs(self) -> None:
        """Mark the aggregations whose output only products read (x @ w, a weight
        gradient x.T @ dy, or an epilogue's extra, all read in row order, which the
        hardware prefetcher hides) or only the caller: the CPU kernel may then write it
        past the caches (``stream_out``, ``gcomp/codegen/stream_stores.py``) and keep the
        last-level cache for the rows it gathers.  Rows another aggregation gathers next
        are read at random and better found in cache: GCN's bf16 training step lost up to
        0.3 ms an aggregation when those were streamed too."""
        steps = self.plan.bind_steps + self.plan.feed_steps + self.plan.steps
        root = {name: b.get("alias", name) for name, b in self.plan.buffers.items()}
        readers: dict[str, set] = {}
        for st in steps:
            for a in st["args"][:-1]:
                if "buf" in a:
                    readers.setdefault(root[a["buf"]], set()).add(kernel_kind(st["kernel"]))
        outputs = {root[o["buffer"]] for o in self.plan.outputs}
        old = set()
        for st in self.plan.feed_steps + self.plan.steps:
            spec = self.specs[st["kernel"]]
            out = st["args"][-1].get("buf")
            if spec.kind != "csr_agg" or out is None:
                continue
            kinds = readers.get(root[out], set())
            if kinds <= {"matmul", "matmul_tn"} and (kinds or root[out] in outputs):
                streamed = KernelSpec.make("csr_agg", **spec.p, stream_out=True)
                self.specs[streamed.name] = streamed
                old.add(st["kernel"])
                st["kernel"] = streamed.name
        for name in old - {st["kernel"] for st in steps}:
            del self.specs[name]

    def lower(self, n: Node) -> None:
        if "fused" in n.meta:
            return  # an anchor: its group is emitted at the group's last member
        if "fused_into" in n.meta:
            anchor = self.graph.node(n.meta["fused_into"])
            if anchor.meta["fused"][-1] == n.name:
                self.lower_group(anchor, [self.graph.node(m) for m in anchor.meta["fused"]])
            return
        op = n.op
        fn = getattr(self, f"lower_{op.value}", None)
        if fn is not None:
            fn(n)
        elif op in OpGroup.Elementwise:
            self.lower_elementwise(n)
        elif op in OpGroup.Reduce:
            self.lower_reduce(n)
        else:
            raise CompileError(f"%{n.name}: no lowering for op {op}")

    # -------------------------------------------------------------- fusion groups
    def _extra_kind(self, v: Node, out: Node) -> str:
        if v.ty.rank == 0:
            return "scalar"
        if v.ty.is_static:
            return "vec"
        return "col" if v.ty.shape != out.ty.shape and v.ty.shape[-1] == 1 else "row"

    def lower_group(self, anchor: Node, members: list[Node]) -> None:
        """One kernel for ``anchor`` and its fused ``members`` (see passes/fuse_epilogues)."""
        tail = members[-1]
        self.buffer(tail)
        if anchor.op in (Op.AGGREGATE, Op.ATTENTION_AGGREGATE, Op.MATMUL):
            chain, extras, kinds, prev = [], [], [], anchor
            second = self.second_product(anchor, members)

            def operand(v: Node):
                """Index of extra input ``v``, or (op, attrs, operands) for an operand the
                epilogue computes (``meta["operand"]``, see passes/fuse_epilogues)."""
                if v.meta.get("operand"):
                    return (v.op.value, _scalar_attrs(v), tuple(operand(i) for i in v.inputs))
                if v not in extras:
                    extras.append(v)
                    kinds.append(self._extra_kind(v, tail))
                return extras.index(v)
            for m in members:
                if m.meta.get("operand") or m.meta.get("product"):
                    continue
                if m.op == Op.RESHAPE:
                    prev = m
                    continue
                if len(m.inputs) == 1:
                    chain.append((m.op.value, _scalar_attrs(m), None, False))
                else:
                    other = m.inputs[1] if m.inputs[0] is prev else m.inputs[0]
                    if other is not second[0]:  # the second product is in the sums
                        chain.append((m.op.value, _scalar_attrs(m), operand(other),
                                      m.inputs[0] is other))
                prev = m
            ext_args = [self.arg(e, self.flat2(e) if k == "row" else None) for e, k in
                        zip(extras, kinds)]
            if anchor.op == Op.AGGREGATE:
                self.lower_aggregate(anchor, out=tail, epilogue=(tuple(chain), tuple(kinds),
                                                                  ext_args))
            elif anchor.op == Op.ATTENTION_AGGREGATE:
                self.lower_attention_aggregate(anchor, out=tail,
                                               epilogue=(tuple(chain), tuple(kinds), ext_args))
            else:
                x, w = anchor.inputs
                feat = None if anchor.attrs["trans_b"] else self.feature_operand(x)
                wbuf, K, M, tb = self.weight_operand(anchor)
                spec = KernelSpec.make("matmul", K=int(K), M=int(M), epilogue=chain, extras=kinds,
                                       **tb, **second[1])
                s = self.step(anchor, spec, [self.arg(x), self.arg(wbuf)] + second[2] + ext_args
                              + [self.arg(tail)], unless=self.variant(feat[0]) if feat else None)
                # the epilogue reads a row extra at the element it stores, after the sum
                # (an aggregation's epilogue may not: its output is its accumulator)
                first = 2 + len(second[2])
                _in_place(s, [first + k for k, (e, kind) in enumerate(zip(extras, kinds))
                              if kind == "row" and e.ty == tail.ty])
                if feat:
                    self.sparse_feature_matmul(anchor, feat[0], feat[1], w, tail, tuple(chain),
                                               tuple(kinds), ext_args, agg=feat[2])
            return
        group = [anchor] + members
        leaves: list[Node] = []

        def expr(v: Node):
            if v in group:
                attrs = _scalar_attrs(v)
                if v.op == Op.RESHAPE:  # index maps into the input's shape
                    attrs = {"in_shape": _spec_shape(v.inputs[0].ty)}
                elif v.op == Op.SLICE:
                    attrs = {"axis": attrs["axis"] % v.ty.rank, "start": attrs["start"],
                             "in_shape": _spec_shape(v.inputs[0].ty)}
                return [v.op.value, attrs, [expr(i) for i in v.inputs]]
            if v not in leaves:
                leaves.append(v)
            return ["in", leaves.index(v)]
        if tail.op in OpGroup.Reduce:  # the tree is the reduction's input
            group.remove(tail)
            self.lower_reduce(tail, tree=(expr(tail.inputs[0]), leaves))
            return
        tree = expr(tail)
        spec = KernelSpec.make("ewise_chain", expr=tree,
                               in_shapes=[_spec_shape(v.ty) for v in leaves],
                               out_shape=_spec_shape(tail.ty))
        s = self.step(anchor, spec, [self.arg(v) for v in leaves] + [self.arg(tail)])
        moved = _remapped_leaves(tree)
        _in_place(s, [i for i, v in enumerate(leaves) if v.ty == tail.ty and i not in moved])

    # -------------------------------------------------------------- leaves
    def lower_input(self, n: Node) -> None:
        entry = {"name": n.name, "role": value_role(n.ty)}
        if isinstance(n.ty, GraphType):
            self.plan.graphs.append({"name": n.name, "parent": None, "mode": None})
        else:
            entry["dims"] = plan_dims(n.ty)
            entry["dtype"] = n.ty.dtype
            if n.ty.edge_graph:
                entry["graph"] = n.ty.edge_graph
            self.buffer(n)
            if entry["role"] == "scalar":  # step counters: persistent, set by the runtime
                self.plan.state.append(n.name)
        self.plan.inputs.append(entry)

    def lower_param(self, n: Node) -> None:
        self.buffer(n)
        self.plan.params.append(n.name)

    def lower_const(self, n: Node) -> None:
        self.buffer(n)
        self.plan.consts[n.name] = float(n.attrs["value"])

    # -------------------------------------------------------------- graph structure
    def lower_self_loops(self, n: Node) -> None:
        self.plan.graphs.append({"name": n.name, "parent": n.inputs[0].name,
                                 "mode": n.attrs["mode"]})

    def lower_edge_remap(self, n: Node) -> None:
        g2, w = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("edge_remap", F=int(prod(w.ty.shape[1:])), fill=float(n.attrs["fill"]))
        self.step(n, spec, [self.garr(g2, "origin"), self.arg(w, self.flat2(w)),
                            self.arg(n, self.flat2(n))])

    def lower_degree(self, n: Node) -> None:
        g = n.inputs[0]
        w = n.inputs[1] if len(n.inputs) > 1 else None
        self.buffer(n)
        self._degree(n, g, w, n.attrs["side"], n.name)

    def _degree(self, n: Node, g: Node, w: Node | None, side: str, out: str) -> None:
        if side == "in":
            spec = KernelSpec.make("degree", weighted=w is not None, indirect=False)
            args = [self.garr(g, "indptr")] + ([self.arg(w)] if w is not None else [])
        else:
            spec = KernelSpec.make("degree", weighted=w is not None, indirect=w is not None)
            args = [self.garr(g, "csc_indptr")]
            if w is not None:
                args += [self.garr(g, "csc_eid"), self.arg(w)]
        self.step(n, spec, args + [self.arg(out)])

    def lower_sym_norm(self, n: Node) -> None:
        g = n.inputs[0]
        w = n.inputs[1] if len(n.inputs) > 1 else None
        deg = self.buffer(n, dims=["N"], name=f"{n.name}.deg")
        self._degree(n, g, w, "in", deg)
        self.buffer(n)
        spec = KernelSpec.make("sym_norm", weighted=w is not None)
        args = [self.garr(g, "indptr"), self.garr(g, "indices"), self.arg(deg)]
        self.step(n, spec, args + ([self.arg(w)] if w is not None else []) + [self.arg(n)])

    # -------------------------------------------------------------- message passing
    def lower_gather(self, n: Node) -> None:
        g, x = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("take_rows", F=int(prod(x.ty.shape[1:])))
        idx = "indices" if n.attrs["side"] == "src" else "rows"
        self.step(n, spec, [self.garr(g, idx), self.arg(x, self.flat2(x)),
                            self.arg(n, self.flat2(n))])

    def lower_scatter(self, n: Node) -> None:
        g, e = n.inputs
        self.buffer(n)
        F = int(prod(e.ty.shape[1:]))
        if n.attrs["side"] == "src":  # onto sources: CSC segments, edge values read via eid
            if n.attrs["reduce"] != "sum":
                raise CompileError(f"%{n.name}: only sum reduces onto source nodes")
            self.step(n, KernelSpec.make("csr_segment_indirect", F=F),
                      [self.garr(g, "csc_indptr"), self.garr(g, "csc_eid"),
                       self.arg(e, self.flat2(e)), self.arg(n, self.flat2(n))])
            return
        spec = KernelSpec.make("csr_segment", reduce=n.attrs["reduce"], F=F)
        self.step(n, spec, [self.garr(g, "indptr"), self.arg(e, self.flat2(e)),
                            self.arg(n, self.flat2(n))])

    def lower_aggregate(self, n: Node, out: Node | None = None, epilogue=((), (), [])) -> None:
        g, x = n.inputs[0], n.inputs[1]
        w = n.inputs[2] if len(n.inputs) > 2 else None
        chain, kinds, ext_args = epilogue
        if out is None:
            out = n
            self.buffer(n)
        fused = {"epilogue": chain, "extras": kinds} if chain else {}
        feat = x.ty.shape[1:]
        if w is None:
            H, weight = 1, "none"
        elif w.ty.rank == 1:
            H, weight = 1, "edge"
        else:
            H, weight = int(prod(w.ty.shape[1:])), "head"
        C = int(prod(feat)) // H
        tail = [self.arg(x, self.flat2(x))] + list(ext_args) + [self.arg(out, self.flat2(out))]
        flow = n.attrs["flow"]
        spec, args, wview = self._agg_call(n, g, w, n.attrs["reduce"], flow, H, C, weight,
                                           tail, fused)
        # aggregated features that only matmuls read: their sparse variant does without
        unless = (self.variant(x) if self._aggregated_features(n)
                  and self._read_only_by_products(n) else None)
        self.offer_formats(n, g, spec, wview, self.step(n, spec, args, unless=unless),
                           transpose=flow == "out")

    def _agg_call(self, n: Node, g: Node, w: Node | None, reduce: str, flow: str, H: int,
                  C: int, weight: str, tail: list, fused: dict) -> tuple:
        """The ``csr_agg`` spec and arguments of an aggregation over ``g`` (``tail``: x,
        epilogue extras, out), and the view of the weights the adjacency formats pack."""
        wview = [self.arg(w, [self.lead(w), H if weight == "head" else 1])] if w is not None else []
        if flow == "in":
            spec = KernelSpec.make("csr_agg", reduce=reduce, H=H, C=C, weight=weight, **fused)
            return spec, [self.garr(g, "indptr"), self.garr(g, "indices")] + wview + tail, wview
        if reduce != "sum":  # over out-edges: the CSC arrays
            raise CompileError(f"%{n.name}: only sum aggregates over out-edges")
        if self.scatter and additive(fused.get("epilogue", ())):
            # the forward CSR's edges scattered, weights as stored
            spec = KernelSpec.make("csr_scatter", H=H, C=C, weight=weight, **fused)
            return spec, [self.garr(g, "indptr"), self.garr(g, "indices")] + wview + tail, wview
        head = [self.garr(g, "csc_indptr"), self.garr(g, "csc_indices")]
        if w is None:
            spec = KernelSpec.make("csr_agg", reduce="sum", H=H, C=C, weight="none", **fused)
            return spec, head + tail, wview
        if w.meta.get("phase") == "bind":  # fixed weights: put them in CSC order once
            spec = KernelSpec.make("csr_agg", reduce="sum", H=H, C=C, weight=weight, **fused)
            return spec, head + [self.csc_order(n, g, w, H)] + tail, wview
        spec = KernelSpec.make("csr_agg", reduce="sum", H=H, C=C, weight=weight, indirect=True,
                               **fused)
        return spec, head + [self.garr(g, "csc_eid")] + wview + tail, wview

    def aggregate_step(self, n: Node, agg: Node, x_arg: dict, out_arg: dict, C: int,
                       epilogue, flow: str, when: str) -> None:
        """``agg``'s aggregation (a sum: its graph and fixed edge weights; over out-edges:
        its transpose) applied to ``x_arg`` [N, C] into ``out_arg``, as a step of node
        ``n`` in variant ``when``."""
        w = agg.inputs[2] if len(agg.inputs) > 2 else None
        chain, kinds, ext_args = epilogue
        fused = {"epilogue": chain, "extras": kinds} if chain else {}
        spec, args, _ = self._agg_call(n, agg.inputs[0], w, "sum", flow, 1, C,
                                       "edge" if w is not None else "none",
                                       [x_arg] + list(ext_args) + [out_arg], fused)
        self.step(n, spec, args, when=when)

    def csc_order(self, n: Node, g: Node, w: Node, H: int) -> dict:
        """Edge values ``w`` of graph ``g`` in CSC order (out-edges grouped by source),
        computed once per bound graph, so aggregations over out-edges read them in
        sequence instead of through ``csc_eid``."""
        name = f"{w.name}.csc"
        if name not in self.plan.buffers:
            self.buffer(w, dims=[f"E:{g.name}", H], name=name)
            self.step(n, KernelSpec.make("take_rows", F=H, index="int64"),
                      [self.garr(g, "csc_eid"), self.arg(w, [self.lead(w), H]),
                       self.arg(name)], phase="bind")
        return self.arg(name)

    def lower_attention_aggregate(self, n: Node, out: Node | None = None,
                                  epilogue=((), (), [])) -> None:
        x, s_src, s_dst = n.inputs[1:4]
        chain, kinds, ext_args = epilogue
        if out is None:
            out = n
            self.buffer(n)
        fused = {"epilogue": chain, "extras": kinds} if chain else {}
        self._attention_step(n, "attention_agg", [s_src, s_dst, x], list(ext_args),
                             self.arg(out, self.flat2(out)), **fused)

    def lower_attention_grad_dst(self, n: Node) -> None:
        x, s_src, s_dst, dy = n.inputs[1:5]
        self.buffer(n)
        self._attention_step(n, "attention_grad_dst", [s_src, s_dst, x, dy], [], self.arg(n))

    def lower_attention_grad_src(self, n: Node) -> None:
        x, s_src, dy, stats = n.inputs[1:5]
        self.buffer(n)
        self._attention_step(n, "attention_grad_src", [s_src, x, dy, stats], [], self.arg(n))

    def _attention_step(self, n: Node, kind: str, tensors: list, epilogue_args: list,
                        out: dict, **fused) -> None:
        """A fused attention kernel's step, its arguments in ``attention_spec``'s order: the
        graph arrays (CSC for the source pass), with dropout the canonical edge ids its
        mask hashes, the tensors (node features flattened to 2-D), with dropout the step
        counter, epilogue extras, the output."""
        g, x = n.inputs[0], n.inputs[1]
        csc = kind == "attention_grad_src"
        params = {"H": int(x.ty.shape[1]), "C": int(prod(x.ty.shape[2:])),
                  "slope": float(n.attrs["negative_slope"])}
        head = [self.garr(g, "csc_indptr" if csc else "indptr"),
                self.garr(g, "csc_indices" if csc else "indices")]
        step = []
        if n.attrs["p"] > 0:
            params.update(p=float(n.attrs["p"]), seed=int(n.attrs["seed"]))
            head.append(self.garr(g, "csc_perm" if csc else "perm"))
            step = [self.arg(n.inputs[-1])]
        args = [self.arg(t, self.flat2(t)) if t.ty.rank > 2 else self.arg(t) for t in tensors]
        self.step(n, KernelSpec.make(kind, **params, **fused), head + args + step
                  + epilogue_args + [out])

    def lower_edge_softmax(self, n: Node) -> None:
        g, e = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("edge_softmax", H=int(prod(e.ty.shape[1:])))
        self.step(n, spec, [self.garr(g, "indptr"), self.arg(e, self.flat2(e)),
                            self.arg(n, self.flat2(n))])

    # -------------------------------------------------------------- dense
    def lower_matmul(self, n: Node) -> None:
        x, w = n.inputs
        if x.ty.rank != 2 or x.ty.is_static:
            raise CompileError(f"%{n.name}: matmul needs x of shape [N or E, K], got {x.ty}")
        self.buffer(n)
        feat = self.feature_operand(x)
        if n.attrs["trans_a"]:  # x.T @ w: a weight gradient, reduced over the rows
            extra = {}
            if n.attrs["sum_row"]:  # a bias gradient too (passes/fuse_bias_grads.py)
                if feat:
                    raise CompileError(f"%{n.name}: a product of node features has no sum "
                                       "row (its sparse-feature variant has none)")
                extra["sum_row"] = True
            spec = KernelSpec.make("matmul_tn", K=int(x.ty.shape[1]), M=int(w.ty.shape[1]),
                                   **extra)
            self.step(n, spec, [self.arg(x), self.arg(w), self.arg(n)],
                      unless=self.variant(feat[0]) if feat else None)
            if feat:
                self.sparse_feature_grad(n, feat[0], feat[1], w, agg=feat[2])
            return
        if n.attrs["trans_b"]:  # x @ w.T
            wt, K, M, tb = self.transposed(n, w)
            self.step(n, KernelSpec.make("matmul", K=K, M=M, **tb),
                      [self.arg(x), self.arg(wt), self.arg(n)])
            return
        spec = KernelSpec.make("matmul", K=int(w.ty.shape[0]), M=int(w.ty.shape[1]))
        self.step(n, spec, [self.arg(x), self.arg(w), self.arg(n)],
                  unless=self.variant(feat[0]) if feat else None)
        if feat:
            self.sparse_feature_matmul(n, feat[0], feat[1], w, n, agg=feat[2])

    def weight_operand(self, n: Node) -> tuple[str, int, int, dict]:
        """(buffer, K, M, the spec's extra parameters) of matmul ``n``'s weight."""
        w = n.inputs[1]
        return self.transposed(n, w) if n.attrs["trans_b"] else (w.name, *w.ty.shape, {})

    def second_product(self, anchor: Node, members: list[Node]) -> tuple:
        """(node, spec parameters, its arguments) of the second product summed in
        ``anchor``'s kernel (``meta["product"]``, passes/fuse_epilogues), or (None, {}, [])
        when there is none.  Where the target's row-group kernel does not take the two
        (shapes it leaves to the generic kernel, no target given), the second product runs
        as its own step and is added by the epilogue as a row extra."""
        second = next((m for m in members if m.meta.get("product")), None)
        if second is None:
            return None, {}, []
        K, K2, M = _contraction(anchor), _contraction(second), int(anchor.ty.shape[-1])
        if (self.target is None or self.gpu or target_definition(
                KernelSpec.make("matmul", K=K, M=M, K2=K2), self.target) is None):
            self.lower_matmul(second)
            return None, {}, []
        buf = self.weight_operand(second)[0]
        return second, {"K2": K2}, [self.arg(second.inputs[0]), self.arg(buf)]

    def transposed(self, n: Node, w: Node) -> tuple[str, int, int, dict]:
        """The weight operand of ``x @ w.T`` for matmul ``n``: (buffer, K, M of the product,
        the spec's extra parameters).  The GPU's product reads w transposed while it stages
        it (``trans_b``); elsewhere a step before it writes w.T (w is a small static weight
        matrix), so the product's vector loop runs along w's rows."""
        M, K = int(w.ty.shape[0]), int(w.ty.shape[1])
        if self.gpu:
            return w.name, K, M, {"trans_b": True}
        wt = self.buffer(n, dims=[K, M], name=f"{n.name}.wT")
        self.step(n, KernelSpec.make("transpose", K=M, M=K), [self.arg(w), self.arg(wt)])
        return wt, K, M, {}

    def lower_elementwise(self, n: Node) -> None:
        self.buffer(n)
        attrs = {k: v for k, v in n.attrs.items()}
        spec = KernelSpec.make("ewise", op=n.op.value, attrs=attrs,
                               in_shapes=[_spec_shape(i.ty) for i in n.inputs],
                               out_shape=_spec_shape(n.ty))
        s = self.step(n, spec, [self.arg(i) for i in n.inputs] + [self.arg(n)])
        _in_place(s, [k for k, i in enumerate(n.inputs) if i.ty == n.ty])

    def lower_reduce(self, n: Node, tree: tuple | None = None) -> None:
        """``tree``: (expression, leaves) of fused elementwise ops computing the input,
        evaluated while it is reduced (passes/fuse_epilogues)."""
        x = n.inputs[0]
        self.buffer(n)
        axis = n.attrs["axis"] % x.ty.rank
        colsum = (axis == 0 and n.op == Op.SUM and not n.attrs["keepdims"] and x.ty.rank >= 2
                  and not isinstance(x.ty.shape[0], int))  # column sums over nodes or edges
        if tree is None:
            fused, ins = {}, [self.arg(x, self.flat2(x) if colsum else None)]
        else:
            fused = {"expr": tree[0], "in_shapes": [_spec_shape(v.ty) for v in tree[1]]}
            ins = [self.arg(v) for v in tree[1]]
        if colsum:
            F = int(prod(x.ty.shape[1:]))
            if tree is not None:
                fused["shape"] = _spec_shape(x.ty)
            self.step(n, KernelSpec.make("colsum", F=F, **fused), ins + [self.arg(n, [F])])
            return
        spec = KernelSpec.make("reduce", op=n.op.value, shape=_spec_shape(x.ty), axis=axis,
                               keepdims=bool(n.attrs["keepdims"]), **fused)
        self.step(n, spec, ins + [self.arg(n)])

    def _softmax(self, n: Node, log: bool) -> None:
        x = n.inputs[0]
        if n.attrs["axis"] % x.ty.rank != x.ty.rank - 1:
            raise CompileError(f"%{n.name}: {n.op} is compiled over the last axis only")
        self.buffer(n)
        self.step(n, KernelSpec.make("softmax", shape=_spec_shape(x.ty), log=log),
                  [self.arg(x), self.arg(n)])

    def lower_softmax(self, n: Node) -> None:
        self._softmax(n, log=False)

    def lower_log_softmax(self, n: Node) -> None:
        self._softmax(n, log=True)

    def lower_concat(self, n: Node) -> None:
        self.buffer(n)
        axis = n.attrs["axis"] % n.ty.rank
        spec = KernelSpec.make("concat", shapes=[_spec_shape(i.ty) for i in n.inputs], axis=axis)
        self.step(n, spec, [self.arg(i) for i in n.inputs] + [self.arg(n)])

    def lower_elementwise_grad(self, n: Node) -> None:
        self.buffer(n)
        attrs = {k: n.attrs[k] for k in ("alpha", "exponent", "of_output")}
        spec = KernelSpec.make("ewise_grad", op=n.attrs["op"], wrt=n.attrs["wrt"], attrs=attrs,
                               in_shapes=[_spec_shape(i.ty) for i in n.inputs],
                               out_shape=_spec_shape(n.ty))
        s = self.step(n, spec, [self.arg(i) for i in n.inputs] + [self.arg(n)])
        _in_place(s, [k for k, i in enumerate(n.inputs) if i.ty == n.ty])

    def lower_sign_bits(self, n: Node) -> None:
        self.buffer(n)
        spec = KernelSpec.make("sign_bits", F=int(n.inputs[0].ty.shape[1]))
        self.step(n, spec, [self.arg(n.inputs[0]), self.arg(n)])

    def lower_mask_bits(self, n: Node) -> None:
        self.buffer(n)
        spec = KernelSpec.make("mask_bits", F=int(n.ty.shape[1]))
        s = self.step(n, spec, [self.arg(i) for i in n.inputs] + [self.arg(n)])
        _in_place(s, [0])

    def lower_broadcast_to(self, n: Node) -> None:
        x = n.inputs[0]
        self.buffer(n)
        spec = KernelSpec.make("broadcast", in_shape=_spec_shape(x.ty), out_shape=_spec_shape(n.ty))
        self.step(n, spec, [self.arg(x), self.arg(n)])

    def lower_slice(self, n: Node) -> None:
        x = n.inputs[0]
        self.buffer(n)
        spec = KernelSpec.make("slice", shape=_spec_shape(x.ty), axis=n.attrs["axis"] % x.ty.rank,
                               start=n.attrs["start"], stop=n.attrs["stop"])
        self.step(n, spec, [self.arg(x), self.arg(n)])

    def lower_dropout(self, n: Node) -> None:
        x, step = n.inputs
        self.buffer(n)
        g = x.ty.edge_graph
        spec = KernelSpec.make("dropout", F=int(prod(x.ty.shape[1:])), p=float(n.attrs["p"]),
                               seed=int(n.attrs["seed"]))
        # the mask hashes canonical element ids: user edge ids (perm) or user node ids
        perm = [{"graph": g, "array": "perm"}] if g is not None else []
        if x.ty.is_node:
            perm = [NODE_IDS]
        elif g is None:
            raise CompileError(f"%{n.name}: dropout applies to node or edge tensors, got {x.ty}")
        unless = None
        if self._is_feature_input(x):
            # with sparse features the matmuls read masked nonzeros instead; the dense mask
            # is only needed if something else reads it
            key = self.variant(x)
            if self._read_only_by_products(n):
                unless = key
            self.buffer(n, dims=[f"NNZ:{x.name}", 1], name=f"{n.name}.nnz")
            nspec = KernelSpec.make("dropout_nnz", F=int(x.ty.shape[1]), p=float(n.attrs["p"]),
                                    seed=int(n.attrs["seed"]))
            self.step(n, nspec, [NODE_IDS, self.farr(x, "rows"), self.farr(x, "indices"),
                                 self.farr(x, "values"), self.arg(step),
                                 self.arg(f"{n.name}.nnz")], when=key)
        self.step(n, spec, perm + [self.arg(x, self.flat2(x)), self.arg(step),
                                   self.arg(n, self.flat2(n))], unless=unless)

    def lower_cross_entropy(self, n: Node) -> None:
        z, y, m = n.inputs
        self.buffer(n)
        if "with_grad" in n.meta:
            return  # written by its gradient's kernel (passes/fuse_loss_grad.py)
        lse = self.buffer(n, dims=[self.lead(z)], name=f"{n.name}.lse")
        self.step(n, KernelSpec.make("cross_entropy", C=int(z.ty.shape[1])),
                  [self.arg(z), self.arg(y), self.arg(m), self.arg(lse), self.arg(n)])

    def lower_cross_entropy_grad(self, n: Node) -> None:
        dy, z, y, m = n.inputs
        self.buffer(n)
        C = int(z.ty.shape[1])
        if "with_loss" in n.meta:  # the loss too, in one pass over the logits
            s = self.step(n, KernelSpec.make("cross_entropy_fused", C=C),
                          [self.arg(dy), self.arg(z), self.arg(y), self.arg(m),
                           self.arg(n.meta["with_loss"]), self.arg(n)])
            _in_place(s, [1])  # row i of the logits, read whole before row i is written
            return
        # the gradient reads the log-sum-exps its loss kernel wrote (autodiff derives it
        # from a cross_entropy of the same operands, which comes first)
        loss = next((u for u in z.users if u.op == Op.CROSS_ENTROPY
                     and list(u.inputs) == [z, y, m]), None)
        if loss is None or f"{loss.name}.lse" not in self.plan.buffers:
            raise CompileError(f"%{n.name}: cross_entropy_grad needs the cross_entropy of the "
                               "same operands before it")
        s = self.step(n, KernelSpec.make("cross_entropy_grad", C=C),
                      [self.arg(dy), self.arg(z), self.arg(y), self.arg(m),
                       self.arg(f"{loss.name}.lse"), self.arg(n)])
        _in_place(s, [1])  # element (i, c) of the logits, read once before (i, c) is written

    def lower_edge_dot(self, n: Node) -> None:
        g, x, y = n.inputs
        self.buffer(n)
        H = int(prod(x.ty.shape[1:-1]))
        spec = KernelSpec.make("edge_dot", H=H, C=int(x.ty.shape[-1]))
        self.step(n, spec, [self.garr(g, "indptr"), self.garr(g, "indices"),
                            self.garr(g, "rows"),
                            self.arg(x, self.flat2(x)), self.arg(y, self.flat2(y)),
                            self.arg(n, [self.lead(n), H])])

    def lower_aggregate_argmax(self, n: Node) -> None:
        g, x = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("argmax_rows", F=int(prod(x.ty.shape[1:])), gathered=True)
        self.step(n, spec, [self.garr(g, "indptr"), self.garr(g, "indices"),
                            self.arg(x, self.flat2(x)), self.arg(n, self.flat2(n))])

    def lower_scatter_argmax(self, n: Node) -> None:
        g, e = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("argmax_rows", F=int(prod(e.ty.shape[1:])), gathered=False)
        self.step(n, spec, [self.garr(g, "indptr"), self.arg(e, self.flat2(e)),
                            self.arg(n, self.flat2(n))])

    def lower_aggregate_max_grad(self, n: Node) -> None:
        g, dy, am = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("aggregate_max_grad", F=int(prod(dy.ty.shape[1:])))
        self.step(n, spec, [self.garr(g, "csc_indptr"), self.garr(g, "csc_indices"),
                            self.garr(g, "csc_eid"), self.arg(am, self.flat2(am)),
                            self.arg(dy, self.flat2(dy)), self.arg(n, self.flat2(n))])

    def lower_scatter_max_grad(self, n: Node) -> None:
        g, dy, am = n.inputs
        self.buffer(n)
        spec = KernelSpec.make("scatter_max_grad", F=int(prod(dy.ty.shape[1:])))
        self.step(n, spec, [self.garr(g, "rows"), self.arg(am, self.flat2(am)),
                            self.arg(dy, self.flat2(dy)), self.arg(n, self.flat2(n))])

    def lower_reshape(self, n: Node) -> None:
        src = n.inputs[0]
        root = self.plan.buffers[src.name].get("alias", src.name)
        self.buffer(n, alias=root)


def lower(graph: Graph, formats: tuple = (), scatter: bool = False, gpu: bool = False,
          target: dict | None = None) -> tuple[Plan, dict[str, KernelSpec]]:
    """``formats``: the adjacency formats besides CSR the target has kernels for.
    ``scatter`` (CUDA only: atomics): aggregations over out-edges whose epilogue only adds
    scatter over the forward CSR (``csr_scatter``) instead of gathering over the CSC
    arrays, so the transposed graph is never built.  ``gpu``: the plan is CUDA's (its
    products read a transposed weight as it is; ``transposed``).  ``target``: the one
    compiled for, whose kernels decide what a fused group may hold (``second_product``)."""
    return _Lowering(graph, formats, scatter, gpu, target).run()
