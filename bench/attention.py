"""GAT with and without the fused attention kernels (``fuse_attention``).

    python -m bench.attention [--mode inference|training] [--graph arxiv-synth]
                              [--heads 4] [--dropout 0.0] [--reps 9]

Both artifacts compile the same 3-layer GAT (hidden 32) from the same weights; the
unfused one disables the pass (scores gathered per edge, ``edge_softmax``, weighted
aggregation: five [E, heads] tensors in memory, more in training, where the backward
of the chain adds its own).  Inference: outputs are checked against each other first,
then forwards alternate (features fed once, ``Executor.execute`` only).  Training (the
fused forward and its fused backward against the unfused chain and its backward): a
first step's loss and gradients are checked against each other, then Adam steps
alternate.  Median of ``--reps``.  Also reported: the bytes of edge tensors each plan
allocates and its planned memory.  Writes ``attention[-training]-latest.md`` and a
JSON with machine, versions and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.env import machine, set_threads, versions


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("inference", "training"), default="inference")
    p.add_argument("--graph", default="arxiv-synth")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout of the features and of the attention coefficients")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import numpy as np

    import models
    from gcomp.compiler import compile_model
    from gcomp.passes import PassContext
    from gcomp.runtime.data import load_graph
    from gcomp.runtime.memory import nbytes

    g = load_graph(args.graph)
    m = models.build("gat", g.num_features, hidden=32, out_channels=int(g.y.max()) + 1,
                     layers=3, heads=args.heads, dropout=args.dropout)
    train = args.mode == "training"
    arts = {"fused": compile_model(m, train=train),
            "unfused": compile_model(m, train=train,
                                     ctx=PassContext(disabled=frozenset({"fuse_attention"})))}
    runs, outs = {}, {}
    for name, art in arts.items():
        if train:
            from gcomp.runtime.trainer import Trainer
            tr = Trainer(art, g, seed=0)
            loss = tr.step()  # the first step from the same weights: compared below
            outs[name] = np.concatenate([[loss]] + [v.ravel() for _, v in
                                                    sorted(tr.gradients().items())])
            runs[name] = (tr.step, tr._binding, art.train_plan)
        else:
            ex = art.executor()
            b = ex.feed(ex.bind(g), {"x": g.x})
            runs[name] = (lambda ex=ex, b=b: ex.execute(b), b, art.plan)
            outs[name] = art.run(g)[0]
    diff = float(np.abs(outs["fused"] - outs["unfused"]).max() /
                 max(1e-30, np.abs(outs["unfused"]).max()))
    assert diff <= 1e-4, f"fused and unfused GAT differ: {diff}"
    for run, _, _ in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (run, _, _) in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    edge_bytes, planned = {}, {}
    for name, (_, b, plan) in runs.items():
        edge_bytes[name] = sum(nbytes(plan, k, b.dims) for k, v in plan.buffers.items()
                               if v["dims"] and str(v["dims"][0]).startswith("E:")
                               and "alias" not in v)
        planned[name] = b.memory["total_bytes"]
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m bench.attention " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "mode": args.mode, "graph": args.graph, "heads": args.heads, "dropout": args.dropout,
           "max_rel_diff": diff,
           "times_ms": times, "median_ms": med, "edge_tensor_bytes": edge_bytes,
           "planned_bytes": planned,
           "speedup": med["unfused"] / med["fused"]}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "attention" + ("-training" if train else "") + (
        f"-dropout{args.dropout:g}" if args.dropout else "")
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    mach = res["machine"]
    what = "training step (forward, backward, Adam)" if train else "forward"
    md = [f"# GAT {args.mode}: fused attention vs unfused ({res['date_utc']})", "",
          f"{mach['cpu_model']}, {mach['cores_available']} cores; threads {args.threads}; "
          f"`{res['command']}`; {args.graph}, 3 layers, hidden 32, {args.heads} heads, "
          f"dropout {args.dropout:g}", "",
          f"| plan | median ms per {what} | edge tensors (MB) | planned memory (MB) |",
          "|---|---|---|---|"]
    for name in ("fused", "unfused"):
        md.append(f"| {name} | {med[name]:.1f} | {edge_bytes[name] / 2**20:.1f} | "
                  f"{planned[name] / 2**20:.1f} |")
    md += ["", f"Speed-up of the fused plan: {res['speedup']:.2f}x; "
           f"{'loss and gradients' if train else 'outputs'} agree to "
           f"{diff:.1e} (max relative difference)."]
    (args.out / f"{stem}-latest.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return res


if __name__ == "__main__":
    main()
