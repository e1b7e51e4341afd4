"""gcomp under test: compile the workload's model, bind the graph once, run.

Inference step = ``ex.execute(ex.feed(b, {"x": x}))``: feed is timed because the peers also
read x in their forward.  Compile time and bind time (CSR build, self loops, normalizations)
are one-time costs, reported in ``setup_s``.
"""

from __future__ import annotations

import time

from bench.runner import Runner


def _context(prefer: str):
    from gcomp.passes import PassContext
    return PassContext(options={"prefer": prefer})


def compile_artifact(workload, precision: str = "fp32", prefer: str = "speed"):
    """(artifact, seconds).  The compiled kernel library is cached by gcomp on disk
    ($GCOMP_CACHE_DIR); the harness points that at a fresh directory per run."""
    from gcomp.compiler import compile_model
    t0 = time.perf_counter()
    art = compile_model(workload.model, precision=precision, ctx=_context(prefer))
    return art, time.perf_counter() - t0


def make(workload, mode: str, artifact=None, precision: str = "fp32", prefer: str = "speed",
         **options) -> Runner:
    """``prefer``: the compiler's ``--prefer``; ``options``: ``Trainer`` keywords of a
    training run (``loss_rows``, ``reorder``)."""
    if mode == "training":
        return make_training(workload, artifact, precision, prefer, **options)
    setup = {}
    if artifact is None:
        artifact, setup["compile_s"] = compile_artifact(workload, precision, prefer)
    t0 = time.perf_counter()
    ex = artifact.executor()
    setup["load_s"] = time.perf_counter() - t0
    b = ex.bind(workload.graph)
    setup["bind_s"] = b.bind_time_s
    x = workload.x
    parts = {"feed_s": [], "execute_s": []}

    def step():
        t0 = time.perf_counter()
        fed = ex.feed(b, {"x": x})  # the binding to run: a new one if x is not the one bound
        t1 = time.perf_counter()
        ex.execute(fed)
        t2 = time.perf_counter()
        parts["feed_s"].append(t1 - t0)
        parts["execute_s"].append(t2 - t1)

    def output():
        fed = ex.feed(b, {"x": x})
        ex.execute(fed)
        return ex.outputs(fed)[0]

    fed = ex.feed(b, {"x": x})
    how = ("not read by the kernels" if "x" not in fed.reads
           else "read in place" if fed.reads_callers("x") else "copied in")
    return Runner("gcomp", step, output, setup, parts=parts, artifact=artifact,
                  notes=[f"{len(b.steps)} kernel calls per forward; feed (validation of x, "
                         f"{how}) is inside the timed step"])


def make_training(workload, artifact=None, precision: str = "fp32", prefer: str = "speed",
                  **options) -> Runner:
    """One epoch = ``Trainer.step()``: forward, masked cross-entropy over the graph's training
    mask (the workload's), backward and one Adam step (lr 0.01), all compiled kernels; the
    features, labels and mask are copied in once at bind time (the peers hold them as tensors
    too).  ``output()`` is the eval-mode forward."""
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    setup = {}
    if artifact is None:
        t0 = time.perf_counter()
        artifact = compile_model(workload.model, train=True,
                                 optimizer=OptimizerConfig(name="adam", lr=0.01),
                                 precision=precision, ctx=_context(prefer))
        setup["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer = Trainer(artifact, workload.graph, **options)
    setup["load_bind_s"] = time.perf_counter() - t0
    setup["bind_s"] = trainer.bind_time_s
    return Runner("gcomp", trainer.step, trainer.logits, setup, artifact=artifact,
                  notes=[f"{len(trainer._binding.steps)} kernel calls per epoch"])
