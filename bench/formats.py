"""Adjacency formats: training epochs with each format forced, the cost model's choice, PyG.

    python -m bench.formats [--reps 7] [--models gcn,gin]

Graphs (synthetic, fixed seeds) where each format has its case:

* ``complete-2k``: 2,048 nodes, every ordered pair joined (4.2M edges): dense;
* ``band-k64``: 50,000 nodes, 64 in-edges each from nodes at most 32 apart, numbered at
  random (reverse Cuthill-McKee recovers the band): banded;
* ``molecules``: 5,000 graphs of 30 nodes packed into one (8 in-edges per node, within
  its graph): block diagonal, yet sparse enough for CSR or ELL buckets;
* ``cora-edges``: Cora's 2,708 nodes and 10,556 edges (features random, as for the others):
  small enough to stay in cache, where ELL buckets compete with CSR.

For each graph and model (3 layers, hidden 32, Adam): one gcomp trainer per feasible
format and one left to the cost model (``auto``), and PyG with a CSR adjacency, timed
alternately, each call on an idle process (``bench.protocol.settle``), median of
``--reps`` epochs.  Also recorded: the cost model's predicted
aggregation time per format (``gcomp explain`` shows the same numbers) and bind times.
Writes ``formats-latest.md`` and ``formats.json`` (machine, versions, command).
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

from bench.env import apply_torch_threads, machine, set_threads, versions
from bench.protocol import settle

FEATURES, CLASSES = 32, 4


def complete(seed: int = 0):
    n = 2048
    src, dst = np.meshgrid(np.arange(n), np.arange(n))
    return n, np.stack([src.ravel(), dst.ravel()])


def band(seed: int = 0):
    rng = np.random.default_rng(seed)
    n, k = 50_000, 64
    dst = np.repeat(np.arange(n), k)
    src = np.clip(dst + rng.integers(-32, 33, dst.size), 0, n - 1)
    ids = rng.permutation(n)
    return n, ids[np.stack([src, dst])]


def molecules(seed: int = 0):
    rng = np.random.default_rng(seed)
    graphs, size, k = 5000, 30, 8
    dst = np.repeat(np.arange(graphs * size), k)
    src = dst // size * size + rng.integers(0, size, dst.size)
    return graphs * size, np.stack([src, dst])


def cora_edges(seed: int = 0):
    from gcomp.runtime.data import load_graph
    g = load_graph("cora")
    return g.num_nodes, g.edge_index


GRAPHS = {"complete-2k": complete, "band-k64": band, "molecules": molecules,
          "cora-edges": cora_edges}


def graph_data(name: str):
    from gcomp.runtime.data import GraphData
    n, ei = GRAPHS[name]()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    return GraphData(name, n, ei.astype(np.int64), x, None, y)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default=",".join(GRAPHS))
    p.add_argument("--models", default="gcn,gin")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-pyg", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)

    import gcomp.models
    from gcomp.compiler import compile_model
    from gcomp.errors import InputError
    from gcomp.runtime.trainer import Trainer, masks_of
    from bench.workload import Workload

    results = []
    for gname in args.graphs.split(","):
        g = graph_data(gname)
        for mname in args.models.split(","):
            model = gcomp.models.build(mname, FEATURES, hidden=32, out_channels=CLASSES,
                                       layers=3)
            art = compile_model(model, train=True)
            runners, entry = {}, {"graph": gname, "model": mname, "nodes": g.num_nodes,
                                  "edges": g.num_edges, "bind_ms": {}, "chosen": None}
            for fmt in ("auto", "csr", "dense", "banded", "ell"):
                try:
                    tr = Trainer(art, g, formats=fmt)
                except InputError as e:
                    entry.setdefault("infeasible", {})[fmt] = str(e)
                    continue
                runners[fmt] = tr.step
                entry["bind_ms"][fmt] = tr.bind_time_s * 1e3
                if fmt == "auto":
                    rep = tr._binding.formats
                    entry["chosen"] = {k: v["chosen"] for k, v in rep.items()}
                    entry["predicted_ms"] = {k: v["cost_ms"] for k, v in rep.items()}
                    entry["node_order"] = tr._binding.reorder["chosen"]
            if not args.no_pyg:
                from bench import peers_pyg
                apply_torch_threads(args.threads)
                wl = Workload(mname, gname, 3, 32, 1, g, g.x, np.asarray(g.y, np.int64),
                              masks_of(g)[0], model)
                runners["pyg-csr"] = peers_pyg.make("pyg-csr", wl, "training").step
            times = {k: [] for k in runners}
            for fn in runners.values():  # warm-up
                fn()
            for _ in range(args.reps):
                for k, fn in runners.items():
                    settle()  # thread pools left spinning by the last call slow the next
                    t0 = time.perf_counter()
                    fn()
                    times[k].append((time.perf_counter() - t0) * 1e3)
            entry["times_ms"] = times
            entry["median_ms"] = {k: statistics.median(v) for k, v in times.items()}
            print(json.dumps({k: entry[k] for k in ("graph", "model", "chosen", "median_ms")}),
                  flush=True)
            results.append(entry)
    res = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m bench.formats " + " ".join(sys.argv[1:] if argv is None
                                                             else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "formats.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "formats-latest.md").write_text(md)
    print(md)
    return res


def markdown(res: dict) -> str:
    mach = res["machine"]
    lines = [f"# Adjacency formats: training epoch per format ({res['date_utc']})", "",
             f"{mach['cpu_model']}, {mach['cores_available']} cores; threads {res['threads']}; "
             f"`{res['command']}`; 3 layers, hidden 32, Adam; median ms per epoch", "",
             "| graph | model | csr | dense | banded | ell | auto (choice) | PyG CSR | auto vs "
             "PyG | predicted aggregation ms (csr / dense / banded / ell) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["results"]:
        med = e["median_ms"]

        def cell(k):
            return f"{med[k]:.1f}" if k in med else "-"
        choice = ", ".join(sorted(set((e["chosen"] or {}).values()))) or "csr"
        pred = next(iter(e.get("predicted_ms", {}).values()), {})
        pred_s = " / ".join(f"{pred[k]:.2f}" if k in pred else "-"
                            for k in ("csr", "dense", "banded", "ell"))
        ratio = f"{med['pyg-csr'] / med['auto']:.2f}x" if "pyg-csr" in med else "-"
        lines.append(f"| {e['graph']} ({e['nodes']:,} nodes, {e['edges']:,} edges) | "
                     f"{e['model']} | {cell('csr')} | {cell('dense')} | {cell('banded')} | "
                     f"{cell('ell')} | "
                     f"{cell('auto')} ({choice}, order {e.get('node_order')}) | "
                     f"{cell('pyg-csr')} | {ratio} | {pred_s} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
