"""Node orders on the CPU: the aggregation alone and training steps, with the graph bound
in its given order, in degree order and in reverse Cuthill-McKee order.

    python -m bench.orders [--graph arxiv-synth] [--models gcn,sage,gin] [--reps 10]

Why: on a GPU the same SpMM kernel ran 1.5x faster on the arxiv-size graph in degree
order, so the GPU binds skewed graphs that way (``gcomp/runtime/reorder.py``); this asks
the CPU the same question, for the aggregation alone and for whole training steps.

For each width in ``--widths``, the SpMM (``bench.gpu.spmm_model``, compiled for llvm)
is bound once per order (``Executor.reorder``), its output checked against scipy's
float64 product, and the orders timed alternately, each call on an idle process
(``bench.protocol.settle``).  For each model (3 layers, hidden 32, Adam), one trainer per
order (``Trainer(..., reorder=...)``): their first losses must agree to 1e-4 (the same
sums in another order), then their steps are timed alternately.  The tables give medians,
the orders each binding actually chose, and the bind times.  Writes ``orders-latest.md``
and ``orders.json`` (machine, versions, threads, command) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.env import machine, set_threads, versions
from bench.protocol import settle

ORDERS = ("none", "degree", "rcm")


def _alternate(calls: dict, reps: int, warmup: int) -> dict:
    """Median ms of each callable, the callables taking turns."""
    times = {k: [] for k in calls}
    for r in range(warmup + reps):
        for k, fn in calls.items():
            settle()
            t = time.perf_counter()
            fn()
            if r >= warmup:
                times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def spmm_case(g, width: int, reps: int, warmup: int) -> dict:
    import scipy.sparse as sp

    from bench.gpu import aggregate, spmm_model
    from gcomp.compiler import compile_model
    from gcomp.runtime.executor import Executor
    art = compile_model(spmm_model(width), "llvm")
    x = np.random.default_rng(width).standard_normal((g.num_nodes, width)).astype(np.float32)
    src, dst = g.edge_index
    a = sp.csr_matrix((np.ones(src.size), (dst, src)), shape=(g.num_nodes, g.num_nodes))
    ref = a @ x.astype(np.float64)
    runs, chosen, bind_s = {}, {}, {}
    for order in ORDERS:
        ex = Executor(art.plan, art.library(), art.params)  # one binding each
        ex.reorder = order
        b = ex.feed(ex.bind(g), {"x": x})
        ex.execute(b)
        err = np.abs(ex.outputs(b)[0] - ref).max() / np.abs(ref).max()
        if err > 1e-4:  # float32 sums over rows of up to 22,897 terms
            raise AssertionError(f"SpMM in {order} order: relative error {err:.1e} against scipy")
        runs[order] = (lambda ex=ex, b=b: aggregate(ex, b))
        chosen[order], bind_s[order] = b.reorder["chosen"], b.bind_time_s
    kernels = [s["kernel"] for s, _, _ in b.feed_steps] + [s["kernel"] for s in b.plan_steps]
    return {"case": f"SpMM F={width}", "median_ms": _alternate(runs, reps, warmup),
            "chosen": chosen, "bind_s": bind_s, "kernels": kernels}


def training_case(g, name: str, reps: int, warmup: int) -> dict:
    import gcomp.models
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    classes = int(g.y.max()) + 1
    model = gcomp.models.build(name, g.num_features, hidden=32, out_channels=classes,
                               layers=3, seed=0)
    art = compile_model(model, "llvm", train=True)
    trainers = {o: Trainer(art, g, seed=0, reorder=o) for o in ORDERS}
    losses = {o: tr.step() for o, tr in trainers.items()}
    if max(abs(v - losses["none"]) for v in losses.values()) > 1e-4 * abs(losses["none"]):
        raise AssertionError(f"{name}: first losses differ between orders: {losses}")
    return {"case": f"{name} training step",
            "median_ms": _alternate({o: tr.step for o, tr in trainers.items()}, reps, warmup),
            "chosen": {o: tr.node_order for o, tr in trainers.items()},
            "bind_s": {o: tr.bind_time_s for o, tr in trainers.items()}}


def markdown(res: dict) -> str:
    mach = res["machine"]
    lines = [f"# Node orders on the CPU ({res['date_utc']})", "",
             f"{mach['cpu_model']}, {mach['cores_available']} cores; threads {res['threads']}; "
             f"`{res['command']}`; graph {res['graph']}; median ms, the orders alternating", "",
             "| case | given | degree | RCM | degree vs given | RCM vs given | bind s "
             "(given / degree / RCM) |", "|---|---|---|---|---|---|---|"]
    for e in res["results"]:
        m, b = e["median_ms"], e["bind_s"]
        lines.append(f"| {e['case']} | {m['none']:.2f} | {m['degree']:.2f} | {m['rcm']:.2f} | "
                     f"{m['none'] / m['degree']:.2f}x | {m['none'] / m['rcm']:.2f}x | "
                     + " / ".join(f"{b[o]:.2f}" for o in ORDERS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="arxiv-synth")
    p.add_argument("--models", default="gcn,sage,gin")
    p.add_argument("--widths", default="32,128", help="SpMM feature widths ('' for none)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    from bench.workload import load
    g = load(args.graph)[0]
    results = [spmm_case(g, int(w), args.reps, args.warmup) for w in args.widths.split(",") if w]
    results += [training_case(g, m, args.reps, args.warmup) for m in args.models.split(",") if m]
    res = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m bench.orders " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "graph": args.graph, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "orders.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "orders-latest.md").write_text(md)
    print(md)
    return res


if __name__ == "__main__":
    main()
