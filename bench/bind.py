"""Graph preparation when a graph is bound, against PyG's CSR preparation, by graph size.

gcomp's binding of a 3-layer GCN training plan (hidden 32): validation, the node-order
and format cost models, CSR and CSC with self loops, the GCN normalization and its CSC
copy (``Executor.bind``, ``bind_time_s``).  PyG's: the normalized CSR ``adj_t`` the
``pyg-csr`` configuration of ``python -m bench`` builds (``peers_pyg.csr_input``).  Each
system runs in a fresh process per graph: the first preparation's seconds and its peak
RSS above the process before it (VmHWM reset through ``/proc/self/clear_refs``), then
the median of ``--reps`` preparations more.

Graphs: ``arxiv-synth`` and random graphs ``random-<E>m`` of 200,000 nodes and E million
edges (seeded, 128 features).

``python -m bench.bind [--graphs arxiv-synth,random-20m] [--reps 3] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import report
from bench.env import machine, set_threads, versions
from bench.memory import status_mb

REPO = Path(__file__).resolve().parent.parent


def _graph(name: str):
    import numpy as np
    from gcomp.runtime.data import GraphData, load_graph
    if not name.startswith("random-"):
        return load_graph(name)
    n, e = 200_000, int(float(name[len("random-"):-1]) * 1e6)
    rng = np.random.default_rng(0)
    return GraphData(name, n, rng.integers(0, n, (2, e)),
                     rng.standard_normal((n, 128), dtype=np.float32))


def child(spec: dict) -> dict:
    set_threads(spec["threads"])
    g = _graph(spec["graph"])
    if spec["system"] == "gcomp":
        import gcomp.models
        from gcomp.compiler import compile_model
        from gcomp.runtime.executor import Executor
        art = compile_model(gcomp.models.build("gcn", g.x.shape[1], hidden=32,
                                               out_channels=40, layers=3), train=True)
        ex = Executor(art.train_plan, art.library(), art.params, {}, art.device())

        def prepare(first):
            return ex.bind(g, again=not first).bind_time_s
    else:
        from bench.peers_pyg import csr_input

        def prepare(first):
            t0 = time.perf_counter()
            csr_input("gcn", g.edge_index, g.num_nodes)
            return time.perf_counter() - t0
    before = status_mb("VmRSS")["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    first = prepare(True)
    peak = status_mb("VmHWM")["VmHWM"] - before
    times = [prepare(False) for _ in range(spec["reps"])]
    return {"first_s": first, "median_s": statistics.median(times), "times_s": times,
            "peak_above_mb": peak, "nodes": g.num_nodes, "edges": g.num_edges}


def run_child(spec: dict) -> dict:
    p = subprocess.run([sys.executable, "-m", "bench.bind", "--child", json.dumps(spec)],
                       cwd=REPO, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"child exited {p.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def markdown(res: dict) -> str:
    out = [f"# Graph preparation at bind time ({res['date_utc']})", "",
           f"{res['machine']['cpu_model']}, {res['threads']} threads; `{res['command']}`", "",
           "| graph | nodes | edges | gcomp bind s (first / median) | gcomp peak MB above | "
           "PyG CSR s (first / median) | PyG peak MB above |", "|---|---|---|---|---|---|---|"]
    for row in res["graphs"]:
        g, p = row["gcomp"], row["pyg-csr"]
        if "error" in g or "error" in p:
            out.append(f"| {row['graph']} | | | {g.get('error', '')} | | {p.get('error', '')} | |")
            continue
        out.append(f"| {row['graph']} | {g['nodes']:,} | {g['edges']:,} | "
                   f"{g['first_s']:.2f} / {g['median_s']:.2f} | {g['peak_above_mb']:.0f} | "
                   f"{p['first_s']:.2f} / {p['median_s']:.2f} | {p['peak_above_mb']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.bind", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default="arxiv-synth,random-20m")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return {}
    stamp = datetime.now(timezone.utc)
    res = {"date_utc": stamp.isoformat(timespec="seconds"),
           "command": "python -m bench.bind " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "graphs": []}
    for name in args.graphs.split(","):
        row = {"graph": name}
        for system in ("gcomp", "pyg-csr"):
            row[system] = run_child({"graph": name, "system": system, "reps": args.reps,
                                     "threads": args.threads})
            print(name, system, row[system], flush=True)
        res["graphs"].append(row)
    report.save(args.out, "bind", stamp, res, markdown(res))
    return res


if __name__ == "__main__":
    main()
