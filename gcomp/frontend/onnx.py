"""Import a GNN exported to ONNX (``torch.onnx.export`` of PyG models) as a gcomp Model.

    model = import_onnx("gcn.onnx")                      # roles inferred
    model = import_onnx("m.onnx", roles={"edge_index": "ei"})

Steps: load with ``onnx``, run ``onnx.checker`` and shape inference, check the
opset (16 to 20), decide the role of every graph input, then interpret the
nodes abstractly (``onnx_ops``) and emit Graph IR for the outputs
(``onnx_values.Emitter``).  Float initializers become parameters (trainable);
the exporter's shape and index plumbing folds away; gather -> edge-wise ->
scatter over the edge index becomes the IR's gather/scatter, degree,
sym_norm, self_loops and edge_softmax ops, which the compiler fuses into
sparse aggregation.  See docs/onnx.md.

Input roles: ``features`` (float ``[num_nodes, F]``), ``edge_index`` (integer
``[2, num_edges]``), ``edge_weight`` (float ``[num_edges]``) and
``adjacency`` (float ``[num_nodes, num_nodes]``, bound to an edge-index graph
at run time).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from gcomp.errors import GcompError, ModelImportError
from gcomp.frontend.onnx_dims import Lin
from gcomp.frontend.onnx_ops import Interp
from gcomp.frontend.onnx_values import (Adjacency, Emitter, FromIR, GraphDesc, GraphIndex, Known,
                                        Tensor, clean_name)
from gcomp.frontend.outputs import distinct
from gcomp.ir.graph import Graph
from gcomp.ir.ops import Op
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType
from gcomp.model import Model

OPSETS = range(16, 21)
ROLES = ("features", "edge_index", "edge_weight", "adjacency")
_FLOAT = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
_INT = {6: "int32", 7: "int64"}
_HINTS = {"features": re.compile(r"^(x|h|feat|features?|node_feat\w*|input)$", re.I),
          "edge_index": re.compile(r"edge_?index|^ei$|^edges?$", re.I),
          "edge_weight": re.compile(r"edge_?(weight|attr)|^ew$", re.I),
          "adjacency": re.compile(r"^(a|adj\w*)$", re.I)}
# exporter-made scalar constants stored as initializers (torch.export names them val_<n>)
_CONST_INIT = re.compile(r"^val_\d+$")


def import_onnx(path, roles: dict | None = None) -> Model:
    """Load the ONNX file ``path`` as a Model.  ``roles`` maps a role (features, edge_index,
    edge_weight, adjacency) to an ONNX input name, overriding inference."""
    import onnx

    path = Path(path)
    try:
        proto = onnx.load(str(path))
    except FileNotFoundError:
        raise ModelImportError(f"{str(path)!r}: no such file") from None
    except Exception as e:  # protobuf decode errors have many types
        raise ModelImportError(f"{str(path)!r} is not a readable ONNX model: {e}") from None
    if not proto.opset_import and not proto.graph.node:  # protobuf reads most bytes as empty
        raise ModelImportError(f"{str(path)!r} is not a readable ONNX model: it holds no graph "
                               "and no opset (an empty or unrelated file?)")
    return import_proto(proto, roles, name=path.stem, source=path.name)


def _check_defined(g) -> None:
    """Name a tensor that nothing defines (the checker calls it a sorting problem)."""
    defined = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    produced = {o for n in g.node for o in n.output}
    for n in g.node:
        for t in n.input:
            if t not in defined and t not in produced:
                raise ModelImportError(
                    f"ONNX node {n.name!r} ({n.op_type}) reads {t!r}, which is not an input, "
                    f"an initializer or a node output (a missing initializer?)")
        defined.update(n.output)


def import_proto(proto, roles: dict | None = None, name: str = "onnx_model",
                 source: str = "") -> Model:
    """Import an in-memory ``onnx.ModelProto`` (see ``import_onnx``)."""
    import onnx

    _check_opset(proto)
    _check_defined(proto.graph)
    try:
        onnx.checker.check_model(proto)
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelImportError(f"the ONNX model is invalid: {msg[:400]}") from None
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    inputs = [i for i in g.input if i.name not in inits]
    scatters = [n for n in g.node if n.op_type in ("ScatterElements", "ScatterND")]
    assigned = assign_roles(inputs, roles, weights_as_inputs=not inits,
                            aggregation=_where(scatters[0]) if scatters else None)

    ir = Graph(_ir_name(name))
    em = Emitter(ir, Lin.atom("N"))
    em.producers = {out: _where(n) for n in g.node for out in n.output if out}
    interp = Interp(em, _opset(proto))
    _bind_inputs(interp, inputs, assigned)
    for t in g.initializer:
        arr = onnx.numpy_helper.to_array(t)
        param = None
        if arr.dtype.kind == "f" and not (arr.size <= 1 and _CONST_INIT.match(t.name)):
            param = (t.name, ())
        interp.env[t.name] = Known(arr, param=param, origin=t.name)
    interp.run(g.node)

    outs = []
    for o in g.output:
        v = interp.env[o.name]
        if not isinstance(v, Tensor):
            raise ModelImportError(f"output {o.name!r} is {v.describe()}, not a float tensor "
                                   "computed from the inputs")
        node = em.full(v)
        if not (isinstance(node.ty, TensorType) and node.ty.is_node):
            raise ModelImportError(f"output {o.name!r} has type {node.ty}; gcomp models output "
                                   "node tensors [num_nodes, ...]")
        outs.append(node)
    ir.set_outputs(distinct(ir, outs, [clean_name(o.name) or "output" for o in g.output]))
    _drop_unused(ir, em.params)
    _name_weights(ir, em.params)
    config = {"model": "onnx", "source": source, "opset": _opset(proto),
              "roles": {k: v for k, v in assigned.items()}}
    try:
        return Model(ir, em.params, config)
    except GcompError as e:
        raise ModelImportError(f"the imported graph is invalid: {e}") from None


def _where(node) -> str:
    return f"ONNX node {node.name or '(unnamed)'!r} ({node.op_type})"


# ====================================================================== opset and roles
def _opset(proto) -> int | None:
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return None


def _check_opset(proto) -> None:
    v = _opset(proto)
    if v is None or v not in OPSETS:
        raise ModelImportError(f"ONNX opset {v} is not supported; gcomp imports opsets "
                               f"{OPSETS.start} to {OPSETS.stop - 1} (export with "
                               "opset_version=18, or 20 with dynamo=True)")


def _info(vi) -> tuple[str, tuple]:
    tt = vi.type.tensor_type
    et = tt.elem_type
    kind = "float" if et in _FLOAT else "int" if et in _INT else f"elem_type {et}"
    dims = tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else "?")
                 for d in tt.shape.dim) if tt.HasField("shape") else None
    return kind, dims


def assign_roles(inputs, roles: dict | None, weights_as_inputs: bool = False,
                 aggregation: str | None = None) -> dict:
    """role -> ONNX input name, from ``roles`` and then names, ranks, dtypes and the
    exporter's dimension names (an edge-weight vector is not indexed by the nodes).
    ``weights_as_inputs``: the model has no initializers; ``aggregation``: the first
    scatter node, if any (errors then say so)."""
    roles = {k: v for k, v in (roles or {}).items() if v}
    names = [i.name for i in inputs]
    for role, nm in roles.items():
        if role not in ROLES:
            raise ModelImportError(f"unknown input role {role!r} (roles: {', '.join(ROLES)})")
        if nm not in names:
            raise ModelImportError(f"the {role} input {nm!r} is not an input of the model "
                                   f"(inputs: {', '.join(names)})")
    info = {i.name: _info(i) for i in inputs}
    # symbolic sizes naming the nodes (the first axis of a float [N, F] input) and the edges
    node_dims = {d[0] for k, d in info.values() if k == "float" and d and len(d) == 2
                 and isinstance(d[0], str) and d[0] != "?"}
    edge_dims = {d[1] for k, d in info.values() if k == "int" and d and len(d) == 2
                 and isinstance(d[1], str)}
    hint = ("; the model has no initializers: were its weights exported as inputs? Export "
            "with export_params=True" if weights_as_inputs else "")

    def fits(role, name):
        kind, dims = info[name]
        if dims is None:
            return False
        if role == "features":
            return kind == "float" and len(dims) == 2
        if role == "edge_index":
            return kind == "int" and len(dims) == 2 and 2 in dims
        if role == "edge_weight":
            return kind == "float" and len(dims) == 1 and not (
                dims[0] in node_dims and dims[0] not in edge_dims)
        return kind == "float" and len(dims) == 2 and dims[0] == dims[1] and dims[0] != "?"

    by_name = {i.name: i for i in inputs}
    named: dict = {}
    for role, nm in roles.items():  # what the user named must fit the role it is named for
        if nm in named:
            raise ModelImportError(f"input {nm!r} is named for two roles, {named[nm]} and "
                                   f"{role}; each input plays one")
        named[nm] = role
        if info[nm][1] is not None and not fits(role, nm):
            raise ModelImportError(f"the {role} input {_describe([by_name[nm]])} is not "
                                   f"{_WANT[role]}")

    out = dict(roles)
    taken = set(roles.values())
    for role in ("edge_index", "edge_weight", "features", "adjacency"):
        if role in out:
            continue
        cands = [n for n in names if n not in taken and fits(role, n)]
        if role == "features" and len(cands) > 1:  # an [N, N] float input is an adjacency
            cands = [n for n in cands if info[n][1][0] != info[n][1][1]] or cands
        if len(cands) > 1:
            named = [n for n in cands if _HINTS[role].search(n)]
            cands = named if len(named) == 1 else cands
        if len(cands) == 1:
            out[role] = cands[0]
            taken.add(cands[0])
        elif len(cands) > 1:
            raise ModelImportError(f"cannot tell which input is the {role} input: "
                                   f"{', '.join(cands)} all fit; name it with "
                                   f"--{role.replace('_', '-')}-input{hint}")
    if "features" not in out:
        raise ModelImportError("the model has no node-feature input (a float [num_nodes, F] "
                               f"input); inputs: {_describe(inputs)}; name it with "
                               "--features-input")
    if "edge_index" not in out and "adjacency" not in out:
        # an exporter drops an input nothing reads: a cached normalization holds the edges
        baked = (f"; {aggregation} aggregates over edges stored in the model as constants: "
                 "a GCNConv(cached=True) called before the export keeps them; export with "
                 "cached=False, edge_index an argument of forward()" if aggregation else "")
        raise ModelImportError("the model has no edge-index input (an integer [2, num_edges] "
                               f"input); inputs: {_describe(inputs)}; name it with "
                               f"--edge-index-input{baked}")
    extra = [n for n in names if n not in out.values()]
    if extra:
        per_node = [n for n in extra if info[n][1] and info[n][1][0] in node_dims]
        why = (f"; {', '.join(per_node)}: node values besides the features are not inputs "
               "gcomp takes (concatenate them onto the features)" if per_node else "")
        raise ModelImportError(f"cannot infer the role of input(s) {', '.join(extra)} "
                               f"({_describe([i for i in inputs if i.name in extra])}); "
                               "gcomp models take features, edge_index and edge_weight inputs"
                               f"{why}{hint}")
    return out


_WANT = {"features": "a float [num_nodes, F] tensor",
         "edge_index": "an integer [2, num_edges] (or [num_edges, 2]) tensor",
         "edge_weight": "a float [num_edges] vector",
         "adjacency": "a float [num_nodes, num_nodes] matrix"}


def _describe(inputs) -> str:
    parts = []
    for i in inputs:
        kind, dims = _info(i)
        parts.append(f"{i.name}: {kind}[{', '.join(map(str, dims or ('?',)))}]")
    return "; ".join(parts) or "none"


def _bind_inputs(interp: Interp, inputs, roles: dict) -> None:
    """Create the IR inputs and the abstract values of the ONNX inputs."""
    em, ir = interp.em, interp.em.graph
    by_name = {i.name: i for i in inputs}
    _require_dynamic(by_name, roles)
    n = em.n
    gd = None
    for role in ("edge_index", "adjacency"):
        if role not in roles:
            continue
        nm = roles[role]
        kind, dims = _info(by_name[nm])
        want = "int" if role == "edge_index" else "float"
        if kind != want or dims is None or len(dims) != 2:
            raise ModelImportError(f"the {role} input {nm!r} must be {want} of rank 2, got "
                                   f"{kind}[{', '.join(map(str, dims or ()))}]")
        node = em._create(Op.INPUT, [], {}, ir.fresh_name(clean_name(nm) or role),
                          ty=GraphType("coo"))
        gd = em.intern(nm, "input", None, Lin.atom(f"E[{nm}]"))
        gd.ir = node
        if role == "edge_index":
            transposed = dims[0] != 2 and dims[1] == 2
            interp.env[nm] = GraphIndex(gd, transposed, origin=nm)
        else:
            interp.env[nm] = Adjacency(gd, n, origin=nm)
    nm = roles["features"]
    kind, dims = _info(by_name[nm])
    if kind != "float" or dims is None or len(dims) != 2 or not isinstance(dims[1], int):
        raise ModelImportError(f"the features input {nm!r} must be float [num_nodes, F] with "
                               f"a static F, got {kind}[{', '.join(map(str, dims or ()))}]")
    x = em._create(Op.INPUT, [], {}, ir.fresh_name(clean_name(nm) or "x"),
                   ty=TensorType((N, dims[1]), "float32"))
    interp.env[nm] = Tensor(FromIR(x), (n, dims[1]), origin=nm)
    if "edge_weight" in roles:
        nm = roles["edge_weight"]
        if "edge_index" not in roles:
            raise ModelImportError(f"the edge_weight input {nm!r} needs an edge_index input")
        g: GraphDesc = interp.env[roles["edge_index"]].gd
        w = em._create(Op.INPUT, [], {}, ir.fresh_name(clean_name(nm) or "edge_weight"),
                       ty=TensorType((EdgeDim(g.ir.name),), "float32"))
        interp.env[nm] = Tensor(FromIR(w), (g.num_edges,), origin=nm)


def _require_dynamic(by_name: dict, roles: dict) -> None:
    """Node and edge counts must be dynamic: a fixed count is baked into the exporter's
    constants, and the model would give wrong answers on other graphs."""
    fix = ("export with dynamic_axes={'x': {0: 'num_nodes'}, 'edge_index': {1: 'num_edges'}} "
           "(dynamo=True: dynamic_shapes) so that the model serves graphs of any size")
    checks = [("features", 0, "nodes"), ("adjacency", 0, "nodes"), ("edge_weight", 0, "edges")]
    if "edge_index" in roles:
        dims = _info(by_name[roles["edge_index"]])[1] or ()
        checks.append(("edge_index", 0 if len(dims) == 2 and dims[1] == 2 and dims[0] != 2
                       else 1, "edges"))
    for role, axis, what in checks:
        if role in roles:
            dims = _info(by_name[roles[role]])[1]
            if dims and len(dims) > axis and isinstance(dims[axis], int):
                raise ModelImportError(f"the {role} input {roles[role]!r} has a fixed number of "
                                       f"{what} ({dims[axis]}); {fix}")


def _ir_name(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]", "_", name) or "onnx_model"
    return s if s[0].isalpha() else "m_" + s


def _drop_unused(ir: Graph, params: dict[str, np.ndarray]) -> None:
    """Remove values no output needs (emission is lazy, but shared helpers may be left)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(ir.nodes):
            if not node.users and node not in ir.outputs and node.op not in (Op.INPUT,):
                ir.erase_node(node)
                params.pop(node.name, None)
                changed = True


def _name_weights(ir: Graph, params: dict[str, np.ndarray]) -> None:
    """Name the weights TorchScript stores as ``onnx::MatMul_<n>`` after their layer
    (``/convs.0/lin/MatMul`` -> ``convs.0.lin.weight``), as PyG and the bundled models do."""
    for p in ir.params:
        users = list(p.users)
        if not p.name.startswith("onnx_") or len(users) != 1 or users[0].op != Op.MATMUL:
            continue
        layer, _, last = users[0].name.rpartition(".")
        if layer and last.split("_")[0] in ("MatMul", "Gemm") and not ir.has(layer + ".weight"):
            params[layer + ".weight"] = params.pop(p.name)
            ir.rename(p, layer + ".weight")
