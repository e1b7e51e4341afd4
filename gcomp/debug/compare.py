"""Kernel-by-kernel comparison of two builds of one model (a CUDA build against the CPU's).

When two targets disagree on a model's output or gradients, the first kernel whose
result differs is the one to read.  Both builds are bound to the same graph in the same
layout (no reordering, CSR adjacency), their kernels run one at a time, and each kernel's
output buffer is read right after it ran (later kernels may reuse its storage).  Steps are
paired by output buffer name (the n-th write of a name in one build with the n-th in the
other); steps of one build only (a kernel the other target fuses differently) are skipped.

    from gcomp.debug.compare import compare_training_step
    for row in compare_training_step(cuda_artifact, cpu_artifact, graph):
        print(row["kernel"], row["buffer"], row["rel_err"])
"""

from __future__ import annotations

import numpy as np


def _run_by_kernel(binding, sync) -> list[tuple[str, str, np.ndarray]]:
    """(kernel, output buffer, its value) after each kernel of ``binding``'s run steps."""
    out = []
    for step, (fn, args) in zip(binding.plan_steps, binding.steps):
        fn(*args)
        sync()
        last = step["args"][-1]
        if "buf" in last:
            out.append((step["kernel"], last["buf"], binding.buffers[last["buf"]].numpy().copy()))
    return out


def _pair(a: list, b: list, tol: float) -> list[dict]:
    seen: dict[str, int] = {}
    b_by = {}
    for kernel, buf, v in b:
        b_by.setdefault(buf, []).append((kernel, v))
    rows = []
    for kernel, buf, v in a:
        k = seen[buf] = seen.get(buf, -1) + 1
        if k >= len(b_by.get(buf, ())):
            continue
        other_kernel, w = b_by[buf][k]
        if v.shape != w.shape:
            continue
        x, y = v.astype(np.float64), w.astype(np.float64)
        err = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12)) if y.size else 0.0
        rows.append({"kernel": kernel, "other_kernel": other_kernel, "buffer": buf,
                     "shape": list(v.shape), "rel_err": err, "ok": err <= tol})
    return rows


def compare_forward(art_a, art_b, graph, features: dict | None = None,
                    tol: float = 1e-4) -> list[dict]:
    """Every kernel of one forward run of two artifacts of the same model on ``graph``."""
    runs = []
    for art in (art_a, art_b):
        ex = art.executor()
        ex.reorder, ex.formats = "none", "csr"
        feeds = features or {i["name"]: graph.dense_x() for i in ex.node_inputs()}
        b = ex.feed(ex.bind(graph, features), feeds)
        runs.append(_run_by_kernel(b, ex.sync))
    return _pair(*runs, tol)


def compare_training_step(art_a, art_b, graph, seed: int = 0, tol: float = 1e-4) -> list[dict]:
    """Every kernel of the first training step of two training artifacts on ``graph``."""
    from gcomp.runtime.trainer import Trainer
    runs = []
    for art in (art_a, art_b):
        tr = Trainer(art, graph, seed=seed, reorder="none", formats="csr")
        tr.next_step()
        runs.append(_run_by_kernel(tr._binding, tr.train_ex.sync))
    return _pair(*runs, tol)
