"""How close is neighbour aggregation to this machine's memory-bandwidth floor?

1. Copy bandwidth, STREAM-like: ``np.copyto`` of float32 arrays of several sizes, best of N,
   on one thread and on ``--threads`` threads (each copying its slice; numpy releases the GIL
   while copying).  The floor uses the best figure for arrays of 128 MB and more (far larger
   than the caches).  Bandwidth counts bytes read + bytes written (STREAM's convention).
2. The bytes a weighted sum aggregation (out[i] = sum_j w_ij x[j], CSR by destination) must
   move on the arxiv-size graph: indptr (int64) + indices (int32) + edge weights (float32) +
   the gathered rows + the output.  Rows gathered: at least every source row once
   (N x F x 4, the compulsory traffic, used for the floor); with no cache reuse at all every
   edge fetches its row (E x F x 4, reported too).  Floor time = bytes / best bandwidth.
3. Measured next to it: gcomp's compiled ``aggregate`` kernel (a model with one aggregate,
   ``Executor.execute`` only; x fed once), scipy's CSR x dense (one thread) and
   ``torch.sparse.mm`` (``--threads`` threads), on the same CSR arrays, at F = 32 and 128.

``python -m bench.memory_floor [--threads 2] [--reps 10] [--out bench/results]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench import report
from bench.env import apply_torch_threads, machine, set_threads, versions
from bench.protocol import settle

SIZES_MB = (8, 32, 128, 512)
WIDTHS = (32, 128)


def copy_bandwidth(size_mb: int, threads: int, reps: int) -> float:
    """Best copy bandwidth in GB/s (read + write bytes) for arrays of ``size_mb`` MB."""
    n = size_mb * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    np.copyto(dst, src)  # first touch of dst's pages happens here, not in a timed copy
    bounds = np.linspace(0, n, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            if threads == 1:
                np.copyto(dst, src)
            else:
                list(pool.map(lambda p: np.copyto(*p), parts))
            best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def timed(fn, reps: int) -> dict:
    """Median, best and all times of ``reps`` calls of ``fn``, after one warm-up call and
    after the previous system's threads went idle: torch's OpenMP threads spin after a
    call, and on two cores they took the CPU from the next system's threads (gcomp's
    32-wide aggregation read 15-20 ms instead of 5 right after a torch call)."""
    settle()
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(ts) * 1e3, "best_ms": min(ts) * 1e3,
            "times_ms": [t * 1e3 for t in ts]}


def gcomp_aggregate(graph, width: int):
    """Compile a model whose only op is a weighted sum aggregation; returns (executor, binding,
    kernel names)."""
    from gcomp.compiler import compile_model
    from gcomp.frontend.builder import EdgeInput, GraphInput, Module, NodeInput, trace

    class Aggregate(Module):
        def forward(self, x, edge_index, edge_weight):
            return edge_index.aggregate(x, "sum", weight=edge_weight)

    model = trace(Aggregate(), {"x": NodeInput(width), "edge_index": GraphInput(),
                                "edge_weight": EdgeInput("edge_index")}, name="aggregate")
    art = compile_model(model)
    ex = art.executor()
    b = ex.bind(graph)
    return ex, b, [s["kernel"] for s in art.plan.feed_steps + art.plan.steps]


def aggregation_calls(b) -> list:
    """The kernel calls of the aggregation: it runs when the features are fed (an
    aggregation of an input is computed once per feed), or in the run steps."""
    return [(fn, args) for _, fn, args in b.feed_steps] + list(b.steps)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.memory_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--graph", default="arxiv-synth")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import scipy.sparse as sp
    import torch
    apply_torch_threads(args.threads)
    from gcomp.runtime.data import GraphData, load_graph
    from gcomp.runtime.graph import GraphStructure

    stamp = datetime.now(timezone.utc)
    res = {"date_utc": stamp.isoformat(timespec="seconds"),
           "command": "python -m bench.memory_floor " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "reps": args.reps, "bandwidth_gb_s": {}, "aggregation": []}
    print("copy bandwidth (GB/s, read + write, best of %d):" % args.reps, flush=True)
    for mb in SIZES_MB:
        for th in sorted({1, args.threads}):
            bw = copy_bandwidth(mb, th, args.reps)
            res["bandwidth_gb_s"][f"{mb}MB/{th}t"] = bw
            print(f"  {mb:4d} MB, {th} thread(s): {bw:6.1f}", flush=True)
    big = {k: v for k, v in res["bandwidth_gb_s"].items() if int(k.split("MB")[0]) >= 128}
    bw_key = max(big, key=big.get)  # arrays far larger than the caches
    bw = big[bw_key]
    res["floor_bandwidth"] = {"gb_s": bw, "from": bw_key}

    g0 = load_graph(args.graph)
    n, e = g0.num_nodes, g0.num_edges
    rng = np.random.default_rng(0)
    w = rng.uniform(0.1, 1.0, e).astype(np.float32)
    graph = GraphData(g0.name, n, g0.edge_index, None, w)
    s = GraphStructure.from_edge_index(g0.edge_index, n)  # gcomp's CSR: sorted by destination
    w_csr = s.to_csr_order(w)
    A = sp.csr_matrix((w_csr, s.indices, s.indptr), shape=(n, n))  # repeated edges kept, as gcomp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        At = torch.sparse_csr_tensor(torch.from_numpy(s.indptr),
                                     torch.from_numpy(s.indices.astype(np.int64)),
                                     torch.from_numpy(w_csr), (n, n))
    res["graph"] = {"name": args.graph, "nodes": n, "edges": e}
    for F in WIDTHS:
        x = rng.standard_normal((n, F), dtype=np.float32)
        xt = torch.from_numpy(x)
        bytes_fixed = (n + 1) * 8 + e * 4 + e * 4 + n * F * 4  # indptr, indices, weights, out
        b_min = bytes_fixed + n * F * 4
        b_noreuse = bytes_fixed + e * F * 4
        ex, b, kernels = gcomp_aggregate(graph, F)
        # the kernel reads the fed array in place: first rows starting on cache lines, as
        # every buffer gcomp allocates (the intermediates a model's later layers gather),
        # then numpy's own array, 16 bytes past a line (a 32-float row spans 3 lines, not 2)
        xa = _line_aligned(x)
        b = ex.feed(b, {"x": xa})  # a new binding when x is not the one bound
        ref = A @ x
        ex.execute(b)
        out = ex.outputs(b)[0]
        diff = float(np.abs(out - ref).max() / np.abs(ref).max())
        tdiff = float(np.abs(torch.sparse.mm(At, xt).numpy() - ref).max() / np.abs(ref).max())
        row = {"F": F, "bytes_compulsory": b_min, "bytes_no_reuse": b_noreuse,
               "floor_ms": b_min / bw / 1e6, "floor_no_reuse_ms": b_noreuse / bw / 1e6,
               "gcomp_kernels": kernels, "gcomp_max_rel_diff": diff, "torch_max_rel_diff": tdiff}
        calls = aggregation_calls(b)
        with torch.no_grad():
            row["gcomp"] = timed(lambda: [fn(*a) for fn, a in calls], args.reps)
            row["x_offset"] = x.ctypes.data % 64
            b = ex.feed(b, {"x": x})
            ex.execute(b)
            if not b.reads_callers("x"):
                raise SystemExit("gcomp copied numpy's array instead of reading it in place")
            diff = max(diff, float(np.abs(ex.outputs(b)[0] - ref).max() / np.abs(ref).max()))
            calls_numpy = aggregation_calls(b)
            row["gcomp_numpy_x"] = timed(lambda: [fn(*a) for fn, a in calls_numpy], args.reps)
            row["scipy"] = timed(lambda: A @ x, args.reps)
            row["torch_sparse_mm"] = timed(lambda: torch.sparse.mm(At, xt), args.reps)
        for k in ("gcomp", "gcomp_numpy_x", "scipy", "torch_sparse_mm"):
            row[k]["x_floor"] = row[k]["median_ms"] / row["floor_ms"]
        res["aggregation"].append(row)
        print(f"F={F}: {b_min / 1e6:.1f} MB to move -> floor {row['floor_ms']:.2f} ms "
              f"(no reuse {b_noreuse / 1e6:.1f} MB, {row['floor_no_reuse_ms']:.2f} ms); "
              f"gcomp {row['gcomp']['median_ms']:.2f} ms (numpy's x at {row['x_offset']} "
              f"bytes past a line: {row['gcomp_numpy_x']['median_ms']:.2f}), scipy {row['scipy']['median_ms']:.2f}, "
              f"torch {row['torch_sparse_mm']['median_ms']:.2f} (diff {diff:.1e} / {tdiff:.1e})",
              flush=True)
        if max(diff, tdiff) > 1e-4:
            raise SystemExit(f"aggregation results disagree with scipy ({diff:.2e}, {tdiff:.2e})")
    report.save(args.out, "floor", stamp, res, markdown(res))
    return res


def markdown(res: dict) -> str:
    g = res["graph"]
    fb = res["floor_bandwidth"]
    out = [f"# Memory-bandwidth floor of neighbour aggregation ({res['date_utc']})", "",
           f"{res['machine']['cpu_model']}, {res['machine']['cores_available']} cores; "
           f"`{res['command']}`", "",
           "Copy bandwidth (GB/s, bytes read + written, best of %d):" % res["reps"], "",
           "| array | " + " | ".join(res["bandwidth_gb_s"]) + " |",
           "|---" * (1 + len(res["bandwidth_gb_s"])) + "|",
           "| GB/s | " + " | ".join(f"{v:.1f}" for v in res["bandwidth_gb_s"].values()) + " |",
           "", f"Floor bandwidth: {fb['gb_s']:.1f} GB/s ({fb['from']}).", "",
           f"Weighted sum aggregation on {g['name']} ({g['nodes']:,} nodes, {g['edges']:,} "
           "edges), median ms (x floor):", "",
           "| F | MB to move (compulsory / no reuse) | floor ms | gcomp aggregate | gcomp, x "
           f"as numpy allocates it | scipy (1 thread) | torch.sparse.mm ({res['threads']} "
           "threads) |", "|---|---|---|---|---|---|---|"]
    for r in res["aggregation"]:
        cells = [f"{r[k]['median_ms']:.2f} ({r[k]['x_floor']:.1f}x)"
                 for k in ("gcomp", "gcomp_numpy_x", "scipy", "torch_sparse_mm")]
        out.append(f"| {r['F']} | {r['bytes_compulsory'] / 1e6:.1f} / {r['bytes_no_reuse'] / 1e6:.1f} "
                   f"| {r['floor_ms']:.2f} (no reuse {r['floor_no_reuse_ms']:.2f}) | "
                   + " | ".join(cells) + " |")
    out += ["", "gcomp aggregate: x's rows start on 64-byte cache lines, as in every buffer "
            "gcomp allocates (the values later layers aggregate). Next to it, the caller's "
            "numpy array read in place, whose first row starts "
            + ", ".join(sorted({f"{r['x_offset']}" for r in res["aggregation"]}))
            + " bytes past a line (numpy aligns to 16 bytes), so each row spans one more "
            "cache line."]
    return "\n".join(out) + "\n"


def _line_aligned(x: np.ndarray) -> np.ndarray:
    """A copy of ``x`` whose first element starts a 64-byte cache line."""
    from gcomp.runtime.executor import _aligned_bytes
    out = _aligned_bytes(x.nbytes, 64).view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


if __name__ == "__main__":
    main()
