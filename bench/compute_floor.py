"""How far is a training step from this machine's floor, and what does the floor allow?

A training step's dense products (``matmul`` and ``matmul_tn`` kernels: x W forward,
dY W^T and x^T dY backward) are compute bound; the rest (aggregations, elementwise
kernels, the loss) is memory bound.  For each model:

1. The GEMM work of one step: 2 n K M floating-point operations per product the bound
   training plan runs, counted from the plan's buffers.
2. This machine's GEMM rate: ``torch.mm`` (MKL) of two 4096 x 4096 float32 matrices on
   ``--threads`` threads, best of ``--reps``: what a tuned library reaches at the most
   favourable shape.  GEMM floor = work / rate.
3. gcomp's step, each kernel timed alone (median of ``--reps``): the products' time next
   to their floor, and everything else.
4. Given a peer's epoch time (``--peers-from``: a ``python -m bench --mode training``
   JSON; its best PyG configuration), the step time a speed-up target asks for
   (``--target``, default 10), next to the GEMM floor alone.
5. A roofline of the whole step: every kernel's floor is the larger of its products'
   work at the GEMM rate and the bytes of its arguments (each read or written once:
   the compulsory traffic, gathered rows counted once) at this machine's copy bandwidth
   (``bench.memory_floor``, 512 MB arrays).  Their sum bounds any step made of the same
   kernels; only fusing kernels (fewer bytes between them) goes below it.

``python -m bench.compute_floor [--models gcn,sage,gin,gat] [--threads 2] [--reps 7]
[--peers-from bench/results/intel-avx512/training-<stamp>.json] [--out bench/results]``
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

from bench import report
from bench.env import apply_torch_threads, machine, set_threads, versions

GEMM_SIDE = 4096


def gemm_rate(threads: int, reps: int) -> float:
    """GFLOP/s of torch.mm at GEMM_SIDE^3 (MKL), best of ``reps``."""
    import torch
    a = torch.randn(GEMM_SIDE, GEMM_SIDE)
    b = torch.randn(GEMM_SIDE, GEMM_SIDE)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(reps))
    return 2 * GEMM_SIDE ** 3 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def product_flops(plan, step: dict, n: int) -> int:
    """Floating-point operations of a dense product step (x [n, K] @ w [K, M], or
    x [n, K]^T @ y [n, M]: K and M are the second dims of its first two arguments), else 0."""
    if step["op"] != "matmul" or not step["kernel"].startswith("gc_matmul"):
        return 0
    K, M = (a["view"] if "view" in a else plan.buffers[a["buf"]]["dims"]
            for a in step["args"][:2])
    return 2 * n * int(K[1]) * int(M[1])


def arg_bytes(args) -> int:
    """Bytes of a kernel call's tensor arguments: what it moves at least, each input read
    once and each output written once (a tensor passed twice counts twice)."""
    from gcomp.runtime.memory import ITEMSIZE
    return sum(int(np.prod([int(d) for d in a.shape])) * ITEMSIZE[str(a.dtype)]
               for a in args if hasattr(a, "shape"))


def roofline(row: dict, gflop_s: float, gb_s: float) -> dict:
    """Per-kernel floors (ms) of a profiled step: max(work / GEMM rate, bytes / bandwidth)."""
    floors = [max(f / gflop_s / 1e6, b / gb_s / 1e6)
              for f, b in zip(row["kernel_flops"], row["kernel_bytes"])]
    over = sorted(zip(row["kernel_names"], row["kernel_ms"], floors),
                  key=lambda k: k[2] - k[1])
    return {"roofline_ms": sum(floors),
            "memory_floor_ms": sum(row["kernel_bytes"]) / gb_s / 1e6,
            "kernel_floor_ms": floors,
            "furthest": [{"kernel": k, "ms": m, "floor_ms": fl} for k, m, fl in over[:5]]}


def profile(model: str, graph: str, reps: int) -> dict:
    """Per-kernel medians of one training step (Adam, lr 0.01) of the bundled model."""
    from bench import workload as W
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    wl = W.make(model, graph, 3, 32, 4)
    art = compile_model(wl.model, train=True, optimizer=OptimizerConfig(name="adam", lr=0.01))
    tr = Trainer(art, wl.graph)
    for _ in range(3):
        tr.step()
    b = tr._binding
    times = np.zeros((reps, len(b.steps)))
    for r in range(reps):
        for k, (fn, args) in enumerate(b.steps):
            t0 = time.perf_counter()
            fn(*args)
            times[r, k] = time.perf_counter() - t0
    steps = [_seconds(tr.step) for _ in range(reps)]
    med = np.median(times, axis=0) * 1e3
    n = wl.graph.num_nodes
    flops = [product_flops(art.train_plan, s, n) for s in b.plan_steps]
    return {"model": model, "step_ms": statistics.median(steps) * 1e3,
            "kernels_ms": float(med.sum()),
            "kernel_names": [s["kernel"] for s in b.plan_steps],
            "kernel_ms": [float(m) for m in med], "kernel_flops": flops,
            "kernel_bytes": [arg_bytes(args) for _, args in b.steps],
            "gemm_gflop": sum(flops) / 1e9,
            "gemm_ms": float(sum(m for m, f in zip(med, flops) if f)),
            "other_ms": float(sum(m for m, f in zip(med, flops) if not f)),
            "products": sum(1 for f in flops if f)}


def best_peer(path: Path | None, graph: str, model: str) -> tuple[str, float] | None:
    """(configuration, median ms) of the fastest PyG configuration in a training bench JSON."""
    if path is None:
        return None
    res = json.loads(path.read_text())
    entry = next((e for e in res["workloads"] if e["graph"] == graph and e["model"] == model),
                 None)
    pyg = {c: v["median_s"] * 1e3 for c, v in (entry or {}).get("configs", {}).items()
           if c.startswith("pyg") and v.get("median_s")}
    return min(pyg.items(), key=lambda kv: kv[1]) if pyg else None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.compute_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gcn,sage,gin,gat")
    p.add_argument("--graph", default="arxiv-synth")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--target", type=float, default=10.0)
    p.add_argument("--peers-from", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import torch  # noqa: F401  (before TVM starts its thread pool: bench.env)
    apply_torch_threads(args.threads)
    stamp = datetime.now(timezone.utc)
    rate = gemm_rate(args.threads, args.reps)
    print(f"GEMM rate (torch.mm {GEMM_SIDE}^3, {args.threads} threads): {rate:.0f} GFLOP/s",
          flush=True)
    from bench.memory_floor import copy_bandwidth
    bw = copy_bandwidth(512, args.threads, args.reps)
    print(f"copy bandwidth (512 MB, {args.threads} threads): {bw:.1f} GB/s", flush=True)
    res = {"date_utc": stamp.isoformat(timespec="seconds"),
           "command": "python -m bench.compute_floor " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "reps": args.reps, "graph": args.graph, "gemm_gflop_s": rate,
           "copy_gb_s": bw, "target": args.target,
           "peers_from": str(args.peers_from) if args.peers_from else None, "models": []}
    for model in args.models.split(","):
        row = profile(model, args.graph, args.reps)
        row["gemm_floor_ms"] = row["gemm_gflop"] / rate * 1e3
        row.update(roofline(row, rate, bw))
        peer = best_peer(args.peers_from, args.graph, model)
        if peer:
            row["peer"], row["peer_ms"] = peer
            row["target_ms"] = peer[1] / args.target
        res["models"].append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("kernel_")}),
              flush=True)
    report.save(args.out, "compute-floor", stamp, res, markdown(res))
    return res


def markdown(res: dict) -> str:
    t = res["target"]
    out = [f"# Training step against the GEMM floor ({res['date_utc']})", "",
           f"{res['machine']['cpu_model']}, {res['machine']['cores_available']} cores, "
           f"{res['threads']} threads; `{res['command']}`", "",
           f"GEMM rate: {res['gemm_gflop_s']:.0f} GFLOP/s (torch.mm, MKL, {GEMM_SIDE}^3 float32, "
           f"best of {res['reps']}).  {res['graph']}, 3 layers, hidden 32; gcomp's kernels timed "
           "one by one, medians.", "",
           f"| model | GEMM GFLOP per step | GEMM floor ms | gcomp GEMM kernels ms | gcomp other "
           f"kernels ms | gcomp step ms | best PyG ms | {t:g}x that ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in res["models"]:
        peer = (f"{r['peer_ms']:.1f} ({r['peer']}) | {r['target_ms']:.1f}" if "peer" in r
                else "- | -")
        out.append(f"| {r['model']} | {r['gemm_gflop']:.2f} ({r['products']} products) | "
                   f"{r['gemm_floor_ms']:.1f} | {r['gemm_ms']:.1f} | {r['other_ms']:.1f} | "
                   f"{r['step_ms']:.1f} | {peer} |")
    if res["peers_from"]:
        out += ["", f"PyG times from `{res['peers_from']}` (same machine, `python -m bench "
                "--mode training`)."]
    rows = [r for r in res["models"] if "roofline_ms" in r]
    if rows:
        out += ["", f"Roofline of the step: each kernel's floor is max(products' work at "
                f"{res['gemm_gflop_s']:.0f} GFLOP/s, its arguments' bytes at "
                f"{res['copy_gb_s']:.1f} GB/s copy bandwidth), summed.", "",
                f"| model | kernels | roofline ms | of which bytes alone ms | gcomp kernels ms | "
                f"gcomp / roofline | {t:g}x PyG's best needs ms | furthest from their floor "
                "(ms / floor ms) |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            far = ", ".join(f"{k['kernel'].removeprefix('gc_').rsplit('_', 1)[0]} "
                            f"{k['ms']:.1f} / {k['floor_ms']:.1f}" for k in r["furthest"][:3])
            need = f"{r['target_ms']:.1f}" if "target_ms" in r else "-"
            out.append(f"| {r['model']} | {len(r['kernel_ms'])} | {r['roofline_ms']:.1f} | "
                       f"{r['memory_floor_ms']:.1f} | {r['kernels_ms']:.1f} | "
                       f"{r['kernels_ms'] / r['roofline_ms']:.2f}x | {need} | {far} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
