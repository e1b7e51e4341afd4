"""The compile driver: model -> passes -> plan and kernels -> artifact.

    model (Graph IR + params)
      -> pass pipeline (gcomp/passes)            optimized Graph IR (+ training graph: loss,
                                                 autodiff; gcomp/passes/autodiff.py)
      -> lower (gcomp/codegen/lower.py)          plan + kernel specs (+ optimizer updates:
                                                 gcomp/codegen/optimizer.py)
      -> build (gcomp/codegen/build.py)          TVM TensorIR -> scheduled -> shared library
      -> Artifact (gcomp/runtime/artifact.py)    saved as .gcomp, run by the runtime
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from gcomp.codegen.build import build_library, device_code_format, make_target
from gcomp.codegen.calibrate import calibrate_formats, calibrate_sparse_threshold
from gcomp.codegen.caller_order import offer_caller_order
from gcomp.codegen.hub_split import split_hub_rows
from gcomp.codegen.kernels import KernelSpec, define, has_amx, has_dot_bf16
from gcomp.codegen.lower import lower
from gcomp.codegen.loss_rows import mark_loss_rows
from gcomp.codegen.optimizer import OptimizerConfig, add_optimizer
from gcomp.codegen.precision import PRECISIONS, store_bf16
from gcomp.codegen.specialize import specialize
from gcomp.errors import CompileError
from gcomp.ir.ops import Op
from gcomp.ir.printer import print_graph
from gcomp.model import Model
from gcomp.passes import PassContext, default_pipeline, training_pipeline
from gcomp.runtime.artifact import Artifact, new_manifest
from gcomp.runtime.cpu_features import (AMX_MATTR, DOT_BF16_MATTR, host_has_amx,
                                        host_has_dot_bf16, isa_features,
                                        missing_features)
from gcomp.runtime.memory import nominal_arena_bytes


def _measurable(tgt: dict) -> dict:
    """The target the calibrations compile for and time on this machine: ``tgt``, or for
    a CPU (``--mcpu``) with instructions this one lacks, this CPU (the kernels compiled for
    the other would stop with an illegal instruction here; this one's costs stand in)."""
    if tgt["kind"] == "llvm" and missing_features(tgt["mcpu"]):
        return make_target("llvm")
    return tgt


def _set_thresholds(plans, tgt: dict, fixed: float | None) -> None:
    """Sparse-feature thresholds: given, or measured on the target for each input's width."""
    plans = [p for p in plans if p is not None]
    variants = {k: v for p in reversed(plans) for k, v in p.variants.items()}
    for key, v in variants.items():
        if fixed is not None:
            threshold, table = float(fixed), [{"note": "given by the user"}]
        else:
            K = next(int(p.buffers[v["input"]]["dims"][1]) for p in plans if key in p.variants)
            widths = [int(p.buffers[s["args"][-1]["buf"]]["dims"][-1]) for p in plans
                      for s in p.steps if s.get("when") == key and s["op"] == "matmul"]
            threshold, table = calibrate_sparse_threshold(K, min(widths or [K]), tgt,
                                                          training=len(plans) > 1)
        for p in plans:
            if key in p.variants:
                p.variants[key].update(threshold=threshold, calibration=table)


def _set_format_costs(plans, tgt: dict) -> None:
    """Per-unit costs of the adjacency formats at each width an aggregation offers them."""
    widths = {s["formats"]["width"] for p in plans if p for s in p.steps if "formats" in s}
    if widths:
        costs = calibrate_formats(widths, tgt)
        for p in plans:
            if p is not None:
                p.formats = {"costs": costs}


def _add_feed_kernels(plans, specs: dict, tgt: dict) -> None:
    """On the CPU, node features are checked by one parallel kernel that reads the
    caller's array in place, and copied in by the same pass (``feed_rows``) unless the
    kernels can read them there (``check_rows``); the plan input names both.  A sparse
    variant names the kernel that tells whether its values still hold the nonzeros
    its kernels were bound with (``match_rows``)."""
    if tgt["kind"] != "llvm":
        return

    def kernel(kind: str, width) -> str:
        spec = KernelSpec.make(kind, F=int(width))
        specs[spec.name] = spec
        return spec.name
    for p in plans:
        for inp in (p.inputs if p is not None else ()):
            if inp["role"] == "node" and inp.get("dtype") == "float32" and len(inp["dims"]) == 2:
                inp["feed_kernel"] = kernel("feed_rows", inp["dims"][1])
                inp["check_kernel"] = kernel("check_rows", inp["dims"][1])
        for v in (p.variants.values() if p is not None else ()):
            v["match_kernel"] = kernel("match_rows", p.buffers[v["input"]]["dims"][1])


def _add_alignments(plans, specs: dict, tgt: dict) -> None:
    """Record the byte alignment each CPU kernel assumes of each argument (4 for the
    CPU definitions, 64 for the generic ones): the runtime hands a kernel the caller's
    own array only where its alignment suffices (a misaligned one would crash it)."""
    if tgt["kind"] != "llvm":
        return
    for p in plans:
        if p is not None:
            p.alignment = {k: [int(a.ty.data_alignment) for a in define(specs[k], tgt).params]
                           for k in p.kernels()}


def _used(specs: dict, plans) -> dict:
    """The specs the plans' steps and variants still name."""
    used = {k for p in plans if p is not None for k in p.kernels()}
    return {k: v for k, v in specs.items() if k in used}


def target_formats(tgt: dict) -> tuple:
    """The adjacency formats besides CSR with kernels for the target (the CPU's)."""
    return ("dense", "banded", "ell") if tgt["kind"] == "llvm" else ()


def check_feature_width(model: Model, graph) -> None:
    """A CompileError where ``graph``'s features are not as wide as the model's input."""
    from gcomp.runtime.data import check_feature_width as check
    check(graph, [(n.name, n.ty.shape[1]) for n in model.node_feature_inputs()
                  if len(n.ty.shape) == 2], CompileError)


def _training_plan(model: Model, ctx: PassContext, formats, scatter: bool, tgt: dict):
    """(training graph, plan, kernel specs).  A ReLU's signs packed for its gradient
    (``pack_relu_masks``) free its output early, which shrinks the memory only where that
    output was live at the busiest step; where the plan without them needs no larger an
    arena (GCN: its busiest step is the loss's), the pipeline runs again without the pass
    (and without instruments: they saw the first run) and that plan is kept."""
    def run(c):
        g = training_pipeline()(model.graph.copy(), c)
        if "grads" not in g.meta:
            raise CompileError("training needs the add_loss and autodiff passes; do not "
                               "disable them")
        return (g, *lower(g, formats, scatter, gpu=tgt["kind"] == "cuda", target=tgt))
    packed = run(ctx)
    if not any(n.op == Op.SIGN_BITS for n in packed[0]):
        return packed
    plain = run(dataclasses.replace(ctx, instruments=(),
                                    disabled=ctx.disabled | {"pack_relu_masks"}))
    carve = tgt["kind"] != "cuda"  # the GPU's buffers share whole allocations
    smaller = nominal_arena_bytes(plain[1], carve) <= nominal_arena_bytes(packed[1], carve)
    return plain if smaller else packed


def compile_model(model: Model, target: str = "llvm", *, ctx: PassContext | None = None,
                  mcpu: str | None = None, train: bool = False,
                  optimizer: OptimizerConfig | None = None,
                  sparse_threshold: float | None = None, arch: str | None = None,
                  formats: tuple | None = None, graph=None, precision: str = "fp32") -> Artifact:
    """Compile ``model`` for ``target``; returns a runnable, savable artifact.

    ``train=True`` also compiles one whole training step (forward, masked cross-entropy,
    backward, optimizer update) into the same kernel library.  ``sparse_threshold`` fixes
    the fraction of zeros in the node features above which the sparse-feature kernels run
    (default: measured on the target, ``gcomp/codegen/calibrate.py``).  ``arch`` is the
    CUDA architecture for ``target="cuda"`` (default ``sm_90``; ``docs/cuda.md``).
    ``formats``: the adjacency formats besides CSR the runtime may choose between by the
    bound graph (``gcomp/runtime/formats.py``; default: all the target has kernels for).
    ``graph`` (a ``GraphData``) specializes the artifact to that graph: the variants its
    statistics rule out are not compiled (``gcomp/codegen/specialize.py``).
    ``precision="bf16"`` stores node-sized activations in bfloat16, computing in float32
    (``gcomp/codegen/precision.py``).
    """
    if precision not in PRECISIONS:
        raise CompileError(f"unknown precision {precision!r}; choose one of "
                           f"{', '.join(PRECISIONS)}")
    if graph is not None:  # before compiling for a graph it cannot run
        check_feature_width(model, graph)
    tgt = make_target(target, mcpu=mcpu, arch=arch)
    if precision == "bf16" and tgt["kind"] == "llvm" and mcpu is None:
        if host_has_amx():
            tgt["mattr"] = list(AMX_MATTR)  # LLVM may not know this CPU has them
        elif host_has_dot_bf16() and not has_dot_bf16(tgt):
            tgt["mattr"] = list(DOT_BF16_MATTR)
    # beyond the target's instructions ("amx" tiles, which the OS must grant), or named for
    # `gcomp info`: the products' bfloat16 dot products
    cpu_features = [] if precision != "bf16" else ["amx"] if has_amx(tgt) else \
        ["avx512_bf16"] if has_dot_bf16(tgt) else []
    formats = target_formats(tgt) if formats is None else tuple(formats)
    unknown = set(formats) - set(target_formats(tgt))
    if unknown:
        raise CompileError(f"no {', '.join(sorted(unknown))} kernels for target {target!r}")
    # the passes see the target compiled for (reorder_linear's choices depend on it)
    ctx = dataclasses.replace(ctx or PassContext(), target=target,
                              tile_products="amx" in cpu_features)
    ir_graph = default_pipeline()(model.graph.copy(), ctx)
    if any(n.op == Op.DROPOUT for n in ir_graph):
        raise CompileError("inference needs the eval_mode pass (dropout is the identity at "
                           "inference, not a random mask); do not disable it")
    scatter = ctx.scatters_out_edges()  # memory over reproducibility on a GPU
    plan, specs = lower(ir_graph, formats, scatter, gpu=tgt["kind"] == "cuda", target=tgt)
    for out, named in zip(plan.outputs, model.graph.outputs):
        out["name"] = named.name  # the model's name: passes may have merged the value (cse)
    ir = {"source": print_graph(model.graph),
          "optimized": print_graph(ir_graph, show_meta=True)}
    train_plan, opt = None, None
    if train:
        opt = optimizer or OptimizerConfig()
        tgraph, train_plan, tspecs = _training_plan(model, ctx, formats, scatter, tgt)
        train_plan.loss = tgraph.outputs[0].name
        train_plan.grads = dict(tgraph.meta["grads"])
        add_optimizer(train_plan, tspecs, opt, one_kernel=tgt["kind"] == "cuda")
        if tgt["kind"] == "llvm" and ctx.option("prefer") != "memory":
            # numbering the mask's nodes first copies the features where a kernel reading
            # them has no form reading them through the order (caller_order.py), and adds
            # the CSC of the edges into the mask's rows: not when memory is preferred
            mark_loss_rows(train_plan, tspecs)
        specs = {**specs, **tspecs}
        ir["training"] = print_graph(tgraph, show_meta=True)
    measured = _measurable(tgt)
    _set_thresholds([plan, train_plan], measured, sparse_threshold)
    _add_feed_kernels([plan, train_plan], specs, tgt)
    if tgt["kind"] == "cuda":
        split_hub_rows([plan, train_plan], specs)
        specs = _used(specs, [plan, train_plan])
    _set_format_costs([plan, train_plan], measured)
    if graph is not None:
        for p in (plan, train_plan):
            if p is not None:
                specialize(p, graph, gpu=tgt["kind"] == "cuda")
        specs = _used(specs, [plan, train_plan])
    if precision == "bf16":
        store_bf16([plan, train_plan], specs, tgt,
                   feature_copies=ctx.option("prefer") != "memory")
        specs = _used(specs, [plan, train_plan])
    if tgt["kind"] == "llvm":
        offer_caller_order([plan, train_plan], specs, tgt)
    _add_alignments([plan, train_plan], specs, tgt)
    lib_path = build_library(specs, tgt)
    params = {p.name: model.params[p.name] for p in model.graph.params}
    ops = dict(sorted(Counter(n.op.value for n in ir_graph).items()))
    manifest = new_manifest({"name": model.name, **model.config}, model.signature(), tgt, ops,
                            device_code_format=device_code_format(tgt),
                            optimizer=opt.to_json() if opt else None, precision=precision,
                            cpu_features=cpu_features,
                            isa=isa_features(tgt["mcpu"]) if tgt["kind"] == "llvm" else ())
    art = Artifact(manifest, plan, params, lib_path.read_bytes(), ir, train_plan)
    art.graphs = {"inference": ir_graph, "training": tgraph if train else None}  # not saved
    art.specs = specs  # not saved either: what gcomp.debug.cuda_emulator runs
    return art
