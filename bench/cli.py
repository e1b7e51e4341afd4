"""``python -m bench``: gcomp against PyG and DGL, one process, alternating, honest medians."""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from bench.env import (apply_torch_threads, import_dgl, machine, set_threads, versions,
                       wait_quiet)
from bench.runner import CONFIGS, MODES, PEER_CONFIGS
from gcomp.errors import GcompError

GRAPHS = ("cora", "pubmed-synth", "arxiv-synth")
# graph -> (layers, hidden) when --layers / --hidden are not given
DEFAULT_SIZES = {"cora": (2, 16), "pubmed-synth": (2, 16), "arxiv-synth": (3, 32)}
TOLERANCE = 1e-3  # max relative difference of a peer's output to gcomp's
# gcomp with bfloat16 activations against its float32 reference: 8 mantissa bits per value
# stored, a few stores deep (tests/test_precision.py)
BF16_TOLERANCE = 3e-2


class EquivalenceError(RuntimeError):
    pass


def _list(choices):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or s!r}; choose from {', '.join(choices)}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from bench.workload import EXTRA_MODELS, MODELS
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--mode", choices=MODES, default="inference")
    p.add_argument("--models", type=_list(MODELS + EXTRA_MODELS), default=list(MODELS),
                   help="default: the four below ggnn (which needs --hidden >= the features)")
    p.add_argument("--graphs", type=_list(GRAPHS), default=["arxiv-synth"])
    p.add_argument("--layers", type=int, help="default: 3 on arxiv-synth, 2 on cora / pubmed-synth")
    p.add_argument("--hidden", type=int, help="default: 32 on arxiv-synth, 16 on cora / pubmed-synth")
    p.add_argument("--heads", type=int, default=4, help="GAT heads in hidden layers")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (>= 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="threads for every system")
    p.add_argument("--peers", type=_list(PEER_CONFIGS), default=list(PEER_CONFIGS))
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds allowed per configuration and workload (setup + all calls); "
                        "also the limit of each memory child")
    p.add_argument("--memory-iters", type=int, default=3, help="steps run by a memory child")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--max-other-load", type=float, default=0.25, metavar="CORES",
                   help="discard and redo a timed round during which other processes used "
                        "more CPU cores than this (at most --reps redone rounds per workload)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each workload and before redoing a busy round, wait up to S "
                        "seconds for other processes to use less than --max-other-load cores")
    p.add_argument("--no-settle", action="store_true",
                   help="diagnostic: do not wait for idle threads before each call")
    p.add_argument("--floor", action="store_true",
                   help="also run the memory-bandwidth floor measurement (bench.memory_floor)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="gcomp's activations (the peers run float32; the reference output is "
                        "gcomp's float32 forward)")
    p.add_argument("--prefer", choices=["speed", "memory"], default="speed",
                   help="gcomp compiled with --prefer memory: aggregations of the features at "
                        "the narrow width every step, hidden aggregations recomputed in the "
                        "backward pass, no loss rows and no bfloat16 copy of the features")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = p.parse_args(argv)
    if a.reps < 5:
        p.error("--reps must be at least 5")
    if a.warmup < 1 or a.threads < 1:
        p.error("--warmup and --threads must be at least 1")
    return a


def log(msg: str) -> None:
    print(msg, flush=True)


def run_workload(wl, args, meter, tmp: Path, entry: dict) -> None:
    """Set up, check, time and measure every configuration on ``wl``; fills ``entry``."""
    from bench import gcomp_runner, protocol, report
    from bench.runner import Skip, make_runner, rel_diff

    # the reference output: gcomp's inference forward (also in training mode)
    ref_runner = gcomp_runner.make(wl, "inference")
    ref = ref_runner.output()
    runners = {}
    for c in ["gcomp"] + args.peers:
        rec = entry["configs"][c] = {}
        try:
            r = ref_runner if (c == "gcomp" and args.mode == "inference"
                               and args.precision == "fp32" and args.prefer == "speed") else \
                make_runner(c, wl, args.mode, precision=args.precision, prefer=args.prefer)
        except Skip as e:
            rec.update(status="skipped", reason=str(e))
            log(f"  {c}: skipped: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - record, keep the other configurations going
            rec.update(status="error", reason=f"{type(e).__name__}: {e}")
            log(f"  {c}: ERROR while setting up:\n{traceback.format_exc()}")
            continue
        d = rel_diff(r.output(), ref)
        rec.update(setup_s=r.setup_s, notes=r.notes, max_rel_diff=d)
        log(f"  {c}: setup {', '.join(f'{k} {v:.2f}s' for k, v in r.setup_s.items())}; "
            f"max rel diff {d:.1e}")
        tol = BF16_TOLERANCE if c == "gcomp" and args.precision == "bf16" else TOLERANCE
        if not d <= tol:
            rec.update(status="not-equivalent")
            raise EquivalenceError(f"{wl.key} {c}: output differs from gcomp's by {d:.3e} "
                                   f"(max relative), over the {tol:g} tolerance")
        runners[c] = r
    timing, cond = protocol.run_alternating(
        runners, args.warmup, args.reps, args.budget, args.max_other_load,
        on_busy=lambda: wait_quiet(args.wait_quiet, args.max_other_load, log=log),
        do_settle=not args.no_settle, log=log)
    entry.update(cond)
    known = [x for x in cond["other_cpu_cores_per_rep"] if x is not None]
    if known and max(known) > args.max_other_load:
        log(f"  WARNING: other processes used up to {max(known):.2f} cores during kept rounds")
    for c, t in timing.items():
        entry["configs"][c].update(t)
    if not args.no_memory:
        art_path = None
        if "gcomp" in runners:  # the memory child loads the artifact this mode timed
            art_path = str(runners["gcomp"].artifact.save(
                tmp / f"{wl.graph_name}-{wl.model_name}-{args.mode}.gcomp"))
        for c in runners:
            if entry["configs"][c]["status"] != "ok":
                continue
            m = meter.measure(c, wl, art_path)
            entry["configs"][c]["memory"] = m
            log(f"  memory {c}: " + (f"peak {m['peak_rss_mb']:.0f} MB, extra {m.get('extra_mb', 0):.0f} MB"
                                     if m["status"] == "ok" else m["reason"]))
    report.add_ratios(entry)
    log("  speed-up: " + ", ".join(f"{k} {v:.2f}x" for k, v in entry["speedup"].items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="gcomp-bench-"))
    os.environ["GCOMP_CACHE_DIR"] = str(tmp / "cache")  # cold compiles: no kernels cached
    import torch  # noqa: F401  (after the thread variables are set)
    if "dgl" in args.peers:
        import_dgl()
    apply_torch_threads(args.threads)
    from bench import report
    from bench import workload as W
    from bench.memory import MemoryMeter

    stamp = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.mode if args.precision == "fp32" else f"{args.mode}-{args.precision}"
    if args.prefer == "memory":
        name += "-prefer-memory"
    json_path = args.out / f"{name}-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    configs = ["gcomp"] + args.peers
    results = {
        "mode": args.mode,
        "precision": args.precision,
        "prefer": args.prefer,
        "date_utc": stamp.isoformat(timespec="seconds"),
        "command": "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "versions": versions(), "threads": args.threads,
        "thread_env": {k: os.environ.get(k) for k in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")},
        "protocol": {"warmup": args.warmup, "reps": args.reps, "order": configs,
                     "statistic": "median", "budget_s_per_config": args.budget,
                     "memory_iters": None if args.no_memory else args.memory_iters,
                     "tolerance_max_rel_diff": TOLERANCE,
                     "max_other_load_cores": args.max_other_load,
                     "settle": None if args.no_settle else
                     "before each call, wait until this process's threads are idle"},
        "configs": {c: CONFIGS[c] for c in configs},
        "workloads": [],
    }
    meter = MemoryMeter(args.threads, args.mode, args.memory_iters, args.budget)
    t_start = time.perf_counter()
    status = 0
    try:
        for gname in args.graphs:
            layers, hidden = DEFAULT_SIZES[gname]
            layers, hidden = args.layers or layers, args.hidden or hidden
            for model in args.models:
                wl = W.make(model, gname, layers, hidden, args.heads)
                log(f"[{time.perf_counter() - t_start:6.0f}s] {wl.key}: {layers} layers, "
                    f"hidden {hidden}, {wl.graph.num_nodes:,} nodes, {wl.graph.num_edges:,} edges")
                entry = {"graph": gname, "model": model, "workload": wl.describe(),
                         "configs": {}}
                entry["other_cpu_cores_before"] = wait_quiet(args.wait_quiet,
                                                             args.max_other_load, log=log)
                results["workloads"].append(entry)
                try:
                    run_workload(wl, args, meter, tmp, entry)
                finally:
                    report.write_json(results, json_path)
                del wl, entry
                gc.collect()
    except (EquivalenceError, GcompError) as e:  # GcompError: e.g. ggnn narrower than x
        results["error"] = str(e)
        report.write_json(results, json_path)
        log(f"\nFAILED: {e}\nPartial results: {json_path}")
        status = 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["baselines_rss_mb"] = {k: v.get("peak_mb") for k, v in meter.baselines.items()}
    results["wall_s"] = time.perf_counter() - t_start
    report.write_json(results, json_path)
    if status == 0:
        (args.out / f"{name}-latest.md").write_text(report.markdown(results))
        report.chart(results, args.out / f"{name}-latest.png")
        log(f"\n{report.markdown(results)}\nWrote {json_path}, {name}-latest.md, "
            f"{name}-latest.png in {args.out}")
    if args.floor:
        from bench import memory_floor
        memory_floor.main(["--threads", str(args.threads), "--out", str(args.out)])
    return status
