"""Distributed training: epoch time at 1, 2, 4 ranks, bytes moved, and a scaling model.

    python -m bench.distributed                                 # arxiv-synth, gcn, ranks 1,2,4
    python -m bench.distributed --graph cora --ranks 1,2 --epochs 5 --out /tmp/d.json
    python -m bench.distributed --model-only results.json --hosts 8,16,32,64

For each rank count K it runs ``mpiexec -n K python -m bench.distributed --worker``:
every rank trains ``--epochs`` steps after ``--warmup``; rank 0 writes, per K,

* ``epoch_ms``: median step time (the max over ranks of each step);
* ``compute_ms`` per rank: step time minus the time blocked in MPI waits;
* ``bytes_per_epoch``: halo exchange, halo reduce (backward), gradient all-reduce,
  summed over ranks, and ``naive_bytes``: what the naive scheme would move instead
  (an all-gather of every exchanged node tensor, each rank receiving all rows it
  does not own, and a reduce-scatter of every backward partial sum);
* the partition report (edge cut, halo rows, balance).

The scaling model (``model_scaling``) extrapolates to P hosts (one rank each): it
partitions the graph into P parts with the same partitioner, takes compute as the
1-rank compute time times the largest part's share of the work (nodes + in-edges),
halo traffic as the largest part's halo rows times the measured bytes per halo row,
and the gradient all-reduce as a ring (2 (P-1)/P bytes, 2 (P-1) latencies); it
reports T(P) = compute + traffic / bandwidth + latency terms, with no overlap
assumed (an upper bound; the runtime overlaps interior rows with the exchange).
A host's compute is that of one single-threaded rank here; faster hosts shrink
the compute term and bring the point where communication dominates earlier.

Besides the JSON (with machine, versions and command), it writes
``distributed-latest.md`` (the tables) and ``distributed-scaling.png`` (measured
and modelled epoch time, split into compute, halo and all-reduce) next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def worker(args, comm) -> int:
    import gcomp.models as models
    from gcomp.compiler import compile_model
    from gcomp.distributed.launch import in_turn
    from gcomp.distributed.trainer import DistributedTrainer
    from gcomp.runtime.data import load_graph

    g = load_graph(args.graph)
    layers, hidden = (3, 32) if g.num_nodes > 50_000 else (2, 16)
    m = models.build(args.model, g.num_features, hidden=args.hidden or hidden,
                     out_channels=int(g.y.max()) + 1, layers=args.layers or layers, heads=2,
                     dropout=0.5)
    art = in_turn(comm, lambda: compile_model(m, "llvm", train=True))
    t0 = time.perf_counter()
    tr = DistributedTrainer(art, g, seed=0, comm=comm, method=args.partition)
    setup_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        tr.step()
    steps, waits = [], []
    for _ in range(args.epochs):
        comm.barrier()
        w0 = comm.wait_s
        t = time.perf_counter()
        tr.step()
        steps.append(time.perf_counter() - t)
        waits.append(comm.wait_s - w0)
    steps, waits = np.array(steps), np.array(waits)
    mx = comm.allreduce(steps, op=comm.MPI.MAX)
    compute = comm.comm.gather(float(np.median(steps - waits)) * 1e3)
    traffic = tr.traffic()
    keys = sorted(traffic)
    total = comm.allreduce(np.array([float(traffic[k]) for k in keys]))
    final_loss = float(tr.step())
    if comm.rank == 0:
        res = {"ranks": comm.size, "graph": g.name, "model": args.model,
               "epoch_ms": float(np.median(mx)) * 1e3, "compute_ms": compute,
               "setup_s": setup_s, "bytes_per_epoch": dict(zip(keys, total.tolist())),
               "partition": tr.partition, "final_loss": final_loss}
        Path(args.worker).write_text(json.dumps(res))
    return 0


def model_scaling(results: list[dict], hosts: list[int], graph_name: str, bandwidth: float,
                  latency: float, partition: str = "auto") -> list[dict]:
    """Predicted epoch time at P hosts from the measured runs (see the module docstring)."""
    from gcomp.distributed.partition import partition_graph, partition_report, node_weights
    from gcomp.runtime.data import load_graph
    one = next((r for r in results if r["ranks"] == 1), None)
    multi = [r for r in results if r["ranks"] > 1]
    if one is None or not multi:
        raise SystemExit("the scaling model needs a 1-rank run and a run on more ranks")
    ref = max(multi, key=lambda r: r["ranks"])
    b = ref["bytes_per_epoch"]
    halo_rows = max(ref["partition"]["halo_rows_total"], 1)
    per_halo_row = (b.get("exchange_bytes", 0) + b.get("reduce_bytes", 0)) / halo_rows
    grad_bytes = b.get("allreduce_bytes", 0) / ref["ranks"] / 2  # float64 on the wire -> f32
    g = load_graph(graph_name)
    w = node_weights(g)
    t1 = float(np.median(one["compute_ms"]))
    out = []
    for p in hosts:
        parts = partition_graph(g, p, partition)
        rep = partition_report(g, parts, p)
        share = float(np.bincount(parts, weights=w, minlength=p).max() / w.sum())
        compute = t1 * share
        halo_s = max(rep["halo"]) * per_halo_row / bandwidth + 2 * latency * (p - 1)
        ring_s = 2 * (p - 1) / p * grad_bytes / bandwidth + 2 * (p - 1) * latency
        out.append({"hosts": p, "compute_ms": compute, "halo_ms": halo_s * 1e3,
                    "allreduce_ms": ring_s * 1e3, "epoch_ms": compute + (halo_s + ring_s) * 1e3,
                    "speedup": t1 / (compute + (halo_s + ring_s) * 1e3),
                    "edge_cut_fraction": rep["edge_cut_fraction"], "max_halo": max(rep["halo"])})
    return out


def amortized_until(scaling: list[dict]) -> int | None:
    """The largest modelled host count at which communication is at most half the epoch."""
    ok = [s["hosts"] for s in scaling if s["halo_ms"] + s["allreduce_ms"] <= 0.5 * s["epoch_ms"]]
    return max(ok) if ok else None


def markdown(doc: dict) -> str:
    runs, scaling = doc["runs"], doc["scaling_model"]
    mib = 2 ** 20
    lines = [f"Command: `{doc['command']}` ({doc['date_utc']}); machine: "
             f"{doc['machine'].get('cpu_model', '?')}, {doc['machine'].get('cores_available', '?')} cores; "
             f"gcomp {doc['versions'].get('gcomp', '?')}, TVM {doc['versions'].get('tvm', '?')}.",
             "", "| ranks | epoch ms (median) | compute ms (median rank) | halo MiB/epoch "
             "| naive all-gather MiB/epoch | grad all-reduce MiB/epoch | edge cut | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        b = r["bytes_per_epoch"]
        lines.append(
            f"| {r['ranks']} | {r['epoch_ms']:.1f} | {np.median(r['compute_ms']):.1f} | "
            f"{(b.get('exchange_bytes', 0) + b.get('reduce_bytes', 0)) / mib:.1f} | "
            f"{b.get('naive_bytes', 0) / mib:.1f} | {b.get('allreduce_bytes', 0) / mib:.2f} | "
            f"{r['partition'].get('edge_cut_fraction', 0) * 100:.1f}% | {r['final_loss']:.6f} |")
    if scaling:
        net = doc["network"]
        lines += ["", f"Scaling model ({net['bandwidth'] / 1e9:g} GB/s, {net['latency'] * 1e6:g} us "
                  "per message, one rank per host, no overlap):", "",
                  "| hosts | epoch ms | compute ms | halo ms | all-reduce ms | speed-up | "
                  "efficiency | edge cut |", "|---|---|---|---|---|---|---|---|"]
        for m in scaling:
            lines.append(f"| {m['hosts']} | {m['epoch_ms']:.2f} | {m['compute_ms']:.2f} | "
                         f"{m['halo_ms']:.2f} | {m['allreduce_ms']:.3f} | {m['speedup']:.1f} | "
                         f"{m['speedup'] / m['hosts'] * 100:.0f}% | "
                         f"{m['edge_cut_fraction'] * 100:.1f}% |")
        a = amortized_until(scaling)
        lines += ["", "Communication stays under half the epoch up to "
                  f"{a} hosts." if a else "Communication exceeds half the epoch at every "
                  "modelled host count."]
    return "\n".join(lines) + "\n"


def chart(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sc = doc["scaling_model"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    hosts = [m["hosts"] for m in sc]
    comp = np.array([m["compute_ms"] for m in sc])
    halo = np.array([m["halo_ms"] for m in sc])
    ring = np.array([m["allreduce_ms"] for m in sc])
    x = np.arange(len(hosts))
    ax.bar(x, comp, label="compute (model)")
    ax.bar(x, halo, bottom=comp, label="halo exchange (model)")
    ax.bar(x, ring, bottom=comp + halo, label="gradient all-reduce (model)")
    ax.set_xticks(x, [str(h) for h in hosts])
    ax.set_xlabel("hosts (one rank each)")
    ax.set_ylabel("ms per training epoch")
    runs = ", ".join(f"{r['ranks']} rank(s): {r['epoch_ms']:.0f} ms" for r in doc["runs"])
    ax.set_title(f"{doc['runs'][0]['model']} on {doc['runs'][0]['graph']}; measured here: {runs}",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.distributed")
    p.add_argument("--graph", default="arxiv-synth")
    p.add_argument("--model", default="gcn", choices=["gcn", "sage", "gin", "gat"])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--partition", default="auto")
    p.add_argument("--threads", type=int, default=1, help="TVM threads per rank")
    p.add_argument("--hosts", default="8,16,32,64", help="scaling model: host counts")
    p.add_argument("--bandwidth", type=float, default=12.5e9, help="bytes/s per host link")
    p.add_argument("--latency", type=float, default=5e-6, help="seconds per message")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="bench/results/distributed.json")
    p.add_argument("--model-only", default=None, help="skip runs; model from this JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from gcomp.distributed.launch import run_distributed
        return run_distributed(worker, args)
    hosts = [int(h) for h in args.hosts.split(",") if h]
    if args.model_only:
        results = json.loads(Path(args.model_only).read_text())["runs"]
    else:
        results = []
        env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS="1")
        for k in [int(r) for r in args.ranks.split(",")]:
            tmp = Path(args.out).with_suffix(f".rank{k}.tmp.json")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            fwd = [a for a in (argv if argv is not None else sys.argv[1:])]
            cmd = ["mpiexec", "-n", str(k), sys.executable, "-m", "bench.distributed",
                   *fwd, "--worker", str(tmp)]
            r = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{k} ranks failed (exit {r.returncode})")
            res = json.loads(tmp.read_text())
            tmp.unlink()
            results.append(res)
            b = res["bytes_per_epoch"]
            print(f"{k} ranks: {res['epoch_ms']:.1f} ms/epoch, compute "
                  f"{np.median(res['compute_ms']):.1f} ms (median rank), halo "
                  f"{(b.get('exchange_bytes', 0) + b.get('reduce_bytes', 0)) / 2**20:.2f} MiB vs "
                  f"naive {b.get('naive_bytes', 0) / 2**20:.2f} MiB, loss "
                  f"{res['final_loss']:.6f}")
    scaling = model_scaling(results, hosts, results[0]["graph"].split("[")[0], args.bandwidth,
                            args.latency, args.partition) if hosts else []
    for s in scaling:
        print(f"model {s['hosts']:>3} hosts: {s['epoch_ms']:.1f} ms/epoch (compute "
              f"{s['compute_ms']:.1f}, halo {s['halo_ms']:.2f}, all-reduce "
              f"{s['allreduce_ms']:.2f}), speedup {s['speedup']:.1f}")
    from datetime import datetime, timezone

    from bench.env import machine, versions
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python -m bench.distributed " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "versions": versions(), "threads_per_rank": args.threads,
           "runs": results, "scaling_model": scaling,
           "network": {"bandwidth": args.bandwidth, "latency": args.latency}}
    out.write_text(json.dumps(doc, indent=1))
    (out.parent / "distributed-latest.md").write_text(markdown(doc))
    if scaling:
        chart(doc, out.parent / "distributed-scaling.png")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
