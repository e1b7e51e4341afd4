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

from collections import Counter

from gcomp.codegen.build import build_library, make_target
from gcomp.codegen.lower import lower
from gcomp.codegen.optimizer import OptimizerConfig, add_optimizer
from gcomp.errors import CompileError
from gcomp.ir.printer import print_graph
from gcomp.model import Model
from gcomp.passes import PassContext, default_pipeline, training_pipeline
from gcomp.runtime.artifact import Artifact, new_manifest


def compile_model(model: Model, target: str = "llvm", *, ctx: PassContext | None = None,
                  mcpu: str | None = None, train: bool = False,
                  optimizer: OptimizerConfig | None = None) -> Artifact:
    """Compile ``model`` for ``target``; returns a runnable, savable artifact.

    ``train=True`` also compiles one whole training step (forward, masked cross-entropy,
    backward, optimizer update) into the same kernel library.
    """
    tgt = make_target(target, mcpu=mcpu)
    ctx = ctx or PassContext(target=target)
    graph = default_pipeline()(model.graph.copy(), ctx)
    plan, specs = lower(graph)
    ir = {"source": print_graph(model.graph), "optimized": print_graph(graph, show_meta=True)}
    train_plan, opt = None, None
    if train:
        opt = optimizer or OptimizerConfig()
        tgraph = training_pipeline()(model.graph.copy(), ctx)
        if "grads" not in tgraph.meta:
            raise CompileError("training needs the add_loss and autodiff passes; do not "
                               "disable them")
        train_plan, tspecs = lower(tgraph)
        train_plan.loss = tgraph.outputs[0].name
        train_plan.grads = dict(tgraph.meta["grads"])
        add_optimizer(train_plan, tspecs, opt)
        specs = {**specs, **tspecs}
        ir["training"] = print_graph(tgraph, show_meta=True)
    lib_path = build_library(specs, tgt)
    params = {p.name: model.params[p.name] for p in model.graph.params}
    ops = dict(sorted(Counter(n.op.value for n in graph).items()))
    manifest = new_manifest({"name": model.name, **model.config}, model.signature(), tgt, ops,
                            optimizer=opt.to_json() if opt else None)
    return Artifact(manifest, plan, params, lib_path.read_bytes(), ir, train_plan)
