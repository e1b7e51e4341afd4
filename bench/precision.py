"""bfloat16 activations (``--precision bf16``) against float32, gcomp alone.

1. Training epochs on arxiv-synth (3 layers, hidden 32, Adam lr 0.01; GGNN hidden 128):
   a float32 and a bfloat16 trainer of the same model, their steps alternating, median of
   ``--reps``; the memory the plan places (``planned_bytes``, activations and the values
   computed once per feed); the largest relative difference of the eval-mode outputs of
   the initial weights; the training loss of both after the timed steps.
2. Accuracy on Cora: ``--epochs`` epochs from the same initial weights (hidden 16, dropout
   0.5, weight decay 5e-4), test accuracy of each.

``python -m bench.precision [--models gcn,sage,gin,gat,ggnn] [--reps 7] [--epochs 200]
[--out bench/results]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench import report
from bench.env import machine, set_threads, versions

PRECISIONS = ("fp32", "bf16")


def _trainers(model, graph, opt):
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    return {p: Trainer(compile_model(model, train=True, optimizer=opt, precision=p), graph)
            for p in PRECISIONS}


def arxiv_row(name: str, reps: int, warmup: int) -> dict:
    from bench import workload as W
    from gcomp.codegen.optimizer import OptimizerConfig
    wl = W.make(name, "arxiv-synth", 3, 128 if name == "ggnn" else 32, 4)
    tr = _trainers(wl.model, wl.graph, OptimizerConfig(name="adam", lr=0.01))
    z = {p: t.logits() for p, t in tr.items()}
    diff = float(np.abs(z["bf16"] - z["fp32"]).max() / np.abs(z["fp32"]).max())
    for _ in range(warmup):
        for t in tr.values():
            t.step()
    times = {p: [] for p in tr}
    loss = {}
    for _ in range(reps):
        for p, t in tr.items():
            t0 = time.perf_counter()
            loss[p] = float(t.step())
            times[p].append(time.perf_counter() - t0)
    row = {"model": name, "graph": "arxiv-synth", "max_rel_diff_initial": diff}
    for p, t in tr.items():
        mem = t._binding.memory
        row[p] = {"median_ms": statistics.median(times[p]) * 1e3,
                  "times_ms": [x * 1e3 for x in times[p]],
                  "planned_mb": (mem["planned_bytes"] + mem["pinned_bytes"]) / 2**20,
                  "loss_after": loss[p],
                  "bf16_buffers": sum(b["dtype"] == "bfloat16"
                                      for b in t.artifact.train_plan.buffers.values())}
    row["speedup"] = row["fp32"]["median_ms"] / row["bf16"]["median_ms"]
    print(f"{name}: fp32 {row['fp32']['median_ms']:.1f} ms, bf16 {row['bf16']['median_ms']:.1f} "
          f"ms ({row['speedup']:.2f}x); planned {row['fp32']['planned_mb']:.0f} -> "
          f"{row['bf16']['planned_mb']:.0f} MB; initial outputs differ by {diff:.1e}", flush=True)
    return row


def cora_row(name: str, epochs: int) -> dict:
    import gcomp.models as models
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.runtime.data import load_graph
    if name == "ggnn":  # GatedGraphConv cannot shrink 1,433 features to its hidden width
        return {"model": name, "graph": "cora", "skipped": "needs hidden >= 1,433"}
    g = load_graph("cora")
    m = models.build(name, g.num_features, hidden=16, out_channels=int(g.y.max()) + 1,
                     layers=2, heads=4, dropout=0.5, seed=0)
    tr = _trainers(m, g, OptimizerConfig(name="adam", lr=0.01, weight_decay=5e-4))
    row = {"model": name, "graph": "cora", "epochs": epochs}
    for p, t in tr.items():
        for _ in range(epochs):
            t.step()
        row[p] = t.evaluate()
    print(f"cora {name}: test accuracy fp32 {row['fp32']['test_acc']:.3f}, bf16 "
          f"{row['bf16']['test_acc']:.3f}", flush=True)
    return row


def markdown(res: dict) -> str:
    out = [f"# bfloat16 activations against float32 ({res['date_utc']})", "",
           f"{res['machine']['cpu_model']}, {res['threads']} threads; `{res['command']}`", "",
           "Training epoch on arxiv-synth (median ms of alternating steps; planned memory: "
           "activations and per-feed values):", "",
           "| model | fp32 ms | bf16 ms | speed-up | fp32 planned MB | bf16 planned MB | "
           "initial outputs max rel diff | loss after (fp32 / bf16) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in res["arxiv"]:
        f, b = r["fp32"], r["bf16"]
        out.append(f"| {r['model']} | {f['median_ms']:.1f} | {b['median_ms']:.1f} | "
                   f"{r['speedup']:.2f}x | {f['planned_mb']:.0f} | {b['planned_mb']:.0f} | "
                   f"{r['max_rel_diff_initial']:.1e} | {f['loss_after']:.4f} / "
                   f"{b['loss_after']:.4f} |")
    out += ["", f"Cora, {res['epochs']} epochs (hidden 16, dropout 0.5, weight decay 5e-4), "
            "test accuracy:", "", "| model | fp32 | bf16 |", "|---|---|---|"]
    for r in res["cora"]:
        if "skipped" in r:
            out.append(f"| {r['model']} | {r['skipped']} | |")
        else:
            out.append(f"| {r['model']} | {r['fp32']['test_acc']:.3f} | "
                       f"{r['bf16']['test_acc']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gcn,sage,gin,gat,ggnn")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    stamp = datetime.now(timezone.utc)
    names = args.models.split(",")
    res = {"date_utc": stamp.isoformat(timespec="seconds"),
           "command": "python -m bench.precision " + " ".join(sys.argv[1:] if argv is None
                                                              else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "reps": args.reps, "epochs": args.epochs,
           "arxiv": [arxiv_row(n, args.reps, args.warmup) for n in names],
           "cora": [cora_row(n, args.epochs) for n in names]}
    report.save(args.out, "precision", stamp, res, markdown(res))
    return res


if __name__ == "__main__":
    main()
