"""The compile driver: model -> passes -> plan and kernels -> artifact.

    model (Graph IR + params)
      -> pass pipeline (gcomp/passes)            optimized Graph IR
      -> lower (gcomp/codegen/lower.py)          plan + kernel specs
      -> build (gcomp/codegen/build.py)          TVM TensorIR -> scheduled -> shared library
      -> Artifact (gcomp/runtime/artifact.py)    saved as .gcomp, run by the runtime
"""

from __future__ import annotations

from collections import Counter

from gcomp.codegen.build import build_library, make_target
from gcomp.codegen.lower import lower
from gcomp.ir.printer import print_graph
from gcomp.model import Model
from gcomp.passes import PassContext, default_pipeline
from gcomp.runtime.artifact import Artifact, new_manifest


def compile_model(model: Model, target: str = "llvm", *, ctx: PassContext | None = None,
                  mcpu: str | None = None) -> Artifact:
    """Compile ``model`` for ``target`` ("llvm"); returns a runnable, savable artifact."""
    tgt = make_target(target, mcpu=mcpu)
    ctx = ctx or PassContext(target=target)
    graph = default_pipeline()(model.graph.copy(), ctx)
    plan, specs = lower(graph)
    lib_path = build_library(specs, tgt)
    params = {p.name: model.params[p.name] for p in graph.params}
    ops = dict(sorted(Counter(n.op.value for n in graph).items()))
    manifest = new_manifest({"name": model.name, **model.config}, model.signature(), tgt, ops)
    ir = {"source": print_graph(model.graph), "optimized": print_graph(graph, show_meta=True)}
    return Artifact(manifest, plan, params, lib_path.read_bytes(), ir)
