"""The SpMM's CUDA kernels timed apart, on a GPU host: ``python -m bench.spmm_kernels
GRAPH DIRS [--hub-edges 128,64]``.

The split aggregation (``gcomp/codegen/hub_split.py``) is one library function that
launches two kernels, the hub tasks' and the rows' (which merges the hubs' partials);
``bench.gpu`` times them together.  This runs each ``DIR/any-spmm{32,128}.gcomp``
(``bench.gpu prepare`` output, e.g. one directory per tuning knob) 20 times back to back
under ``torch.profiler`` and prints one JSON row per directory, width and hub task size
(``graph.HUB_EDGES`` set before binding): the per-call time and each kernel's mean.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

CALLS = 20


def kernel_means(events) -> dict[str, float]:
    """{kernel: mean ms a call} of ``torch.profiler``'s averaged device events."""
    return {e.key: round(e.self_device_time_total / max(e.count, 1) / 1e3, 4)
            for e in events if e.self_device_time_total > 0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("graph")
    p.add_argument("dirs", help="comma-separated bench.gpu prepare directories")
    p.add_argument("--hub-edges", default="128")
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import gcomp.runtime.graph as graph_mod
    from bench.gpu import aggregate, spmm_bound, summary, timed_batch
    from bench.workload import load
    from gcomp.runtime.artifact import load as load_artifact
    torch.cuda.init()  # one CUDA context for torch's profiler and TVM's kernels
    g = load(args.graph)[0]
    for d in args.dirs.split(","):
        for width in (32, 128):
            for hub in (int(h) for h in args.hub_edges.split(",")):
                graph_mod.HUB_EDGES = hub
                x = np.random.default_rng(0).standard_normal((g.num_nodes, width))
                ex, b = spmm_bound(load_artifact(f"{d}/any-spmm{width}.gcomp"), g,
                                   x.astype(np.float32))
                per_call = summary(timed_batch(lambda: aggregate(ex, b), ex.sync, 10, 1))
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(CALLS):
                        aggregate(ex, b)
                    ex.sync()
                print(json.dumps({"dir": d, "width": width, "hub_edges": hub,
                                  "per_call_ms": per_call["median_ms"],
                                  "kernels_ms": kernel_means(prof.key_averages())}),
                      flush=True)


if __name__ == "__main__":
    main()
