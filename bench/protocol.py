"""The timing protocol: warm-ups, then repetitions with the configurations alternating.

Every round calls each configuration once, in a fixed order (gcomp, pyg, pyg-csr, pyg-compile,
dgl, gcomp, ...), so slow drifts of a noisy machine hit all of them alike.  ``warmup`` rounds
are discarded, ``reps`` rounds are kept; the median is the reported figure.

Before each call the harness waits until this process is idle (``settle``): thread pools
keep spinning after a call -- TVM's workers for ~0.2 s of CPU, OpenMP's for a while -- and on
two cores a spinning pool left behind by one system slows the next one down severalfold.
Each call thus starts on a machine as quiet as a fresh process would find it.

The machine is shared.  CPU time used by other processes is measured over every round; a
timed round during which they kept more than ``max_other`` cores busy is discarded (and
recorded) and run again, at most ``reps`` times per workload.

A configuration whose projected total (setup + calls so far + its last call's time x calls
still to make) passes ``budget_s`` is dropped from the rotation and reported as skipped.
"""

from __future__ import annotations

import gc
import statistics
import time

from gcomp.codegen.cpu_load import CpuMonitor


def settle(max_s: float = 2.0, window_s: float = 0.02, idle_cpu_s: float = 0.002) -> float:
    """Sleep until this process's threads stop using CPU (at most ``max_s``); returns the time
    waited."""
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < max_s:
        c0 = time.process_time()
        time.sleep(window_s)
        if time.process_time() - c0 < idle_cpu_s:
            break
    return time.perf_counter() - t_start


def summarize(times: list[float]) -> dict:
    if not times:
        return {}
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "p25_s": q[0], "p75_s": q[2]}


def run_alternating(runners: dict, warmup: int, reps: int, budget_s: float,
                    max_other: float = 0.25, on_busy=None, do_settle: bool = True,
                    log=print):
    """Time ``runners`` (config -> Runner).

    A timed round during which other processes kept more than ``max_other`` cores busy is
    discarded and run again (at most ``reps`` times in all; after that rounds are kept
    whatever the load); ``on_busy()`` is called before the redo (e.g. to wait for quiet).
    Returns (config -> result dict, conditions of the run)."""
    res = {c: {"status": "ok", "warmup_s": [], "times_s": [],
               "spent_s": sum(r.setup_s.values())} for c, r in runners.items()}
    for c, st in res.items():
        if st["spent_s"] > budget_s:
            st.update(status="skipped", reason=f"setup took {st['spent_s']:.0f} s, over the "
                                               f"{budget_s:.0f} s budget")
    kept_load, discarded, settle_s = [], [], []
    mon = CpuMonitor()
    rnd = 0
    while True:
        timed = rnd >= warmup
        kept = len(kept_load)
        if kept == reps:
            break
        if rnd == warmup:  # breakdowns count timed calls only
            for r in runners.values():
                for v in r.parts.values():
                    v.clear()
        active = [c for c in runners if res[c]["status"] == "ok"]
        if not active:
            break
        gc.collect()
        parts_len = {c: {k: len(v) for k, v in runners[c].parts.items()} for c in active}
        mon.cores()  # start of this round
        times = {}
        for c in active:
            st = res[c]
            settle_s.append(settle() if do_settle else 0.0)
            t0 = time.perf_counter()
            runners[c].step()
            dt = times[c] = time.perf_counter() - t0
            st["spent_s"] += dt
            left = (warmup - rnd - 1 if not timed else 0) + reps - kept - (1 if timed else 0)
            if left > 0 and st["spent_s"] + dt * left > budget_s:
                st.update(status="skipped",
                          reason=f"projected {st['spent_s'] + dt * left:.0f} s (last call "
                                 f"{dt:.2f} s, {left} calls to go) over the {budget_s:.0f} s "
                                 "per-configuration budget")
                log(f"    {c}: skipped ({st['reason']})")
        load = mon.cores()
        rnd += 1
        line = "  ".join(f"{c} {t * 1e3:.1f}" for c, t in times.items()) + "  (ms)" + \
            (f"  [other processes: {load:.2f} cores]" if load is not None else "")
        if not timed:
            for c, t in times.items():
                res[c]["warmup_s"].append(t)
            continue
        if load is not None and load > max_other and len(discarded) < reps:
            discarded.append({"other_cpu_cores": load, "times_s": times})
            for c in active:  # forget this round's breakdowns too
                for k, v in runners[c].parts.items():
                    del v[parts_len[c][k]:]
            log(f"    (discarded, machine busy) {line}")
            if on_busy:
                on_busy()
            continue
        for c, t in times.items():
            res[c]["times_s"].append(t)
        kept_load.append(load)
        log(f"    rep {len(kept_load)}: {line}")
    for c, r in runners.items():
        st = res[c]
        if st["status"] == "ok":
            st.update(summarize(st["times_s"]))
            if r.parts:
                st["parts_median_s"] = {k: statistics.median(v) for k, v in r.parts.items() if v}
    return res, {"other_cpu_cores_per_rep": kept_load, "discarded_rounds": discarded,
                 "settle_s_median": statistics.median(settle_s) if settle_s else None,
                 "settle_s_max": max(settle_s, default=None)}
