"""What each optimization is worth: gcomp's training epoch with one of them turned off.

    python -m bench.ablation                       # arxiv-synth, 3 layers, hidden 32, all models
    python -m bench.ablation --graphs cora --models gcn,gat
    python -m bench.ablation --configs all,-loss-rows     # some configurations only
    python -m bench.ablation --configs all,-loss-rows --memory   # and each one's peak RSS
    python -m bench.ablation --precision bf16      # activations in bfloat16 (Mixed precision)

Per model, the configurations are: ``all`` (the default pipeline and bind-time choices), one
``-PASS`` per optional optimizing pass of the inference and training pipelines (compiled
with ``PassContext(disabled={PASS})``), and the bind-time decisions forced off:
``-sparse-features`` (dense first-layer kernels whatever the feature sparsity) and
``-reorder`` (the user's node order) and ``-loss-rows`` (every step on every row, not the
training mask's rows alone: ``gcomp/codegen/loss_rows.py``); and ``prefer-memory``, the
compiler's trade of speed for memory (``--prefer memory``: no wide buffer kept from the
feed, no loss rows), and ``prefer-memory/-PASS`` for each pass that acts only then
(``pack_relu_masks``).  A pass that changes neither pipeline's IR for a model
(GAT's attention fusion for GCN, say) is reported as ``no change``, not timed.  Every
configuration trains the same model from the same weights; before timing, each one's
eval-mode output is checked against ``all``'s (max relative difference <= 1e-3; with
``--precision bf16`` the bench's bfloat16 tolerance, 3e-2, since configurations may round
different values: ``prefer-memory``'s first layer reads the float32 features), so an
ablation never measures a different function.  Then rounds alternate over the
configurations (median of ``--reps``).  With ``--memory``, each configuration's saved
artifact also trains in a fresh process with the same choices, whose peak RSS above a
process that only imported the libraries is recorded (``bench/memory.py``).

A pass that the compiler cannot do without for some model (the plan would need a kernel that
does not exist, say) is reported with the compiler's error instead of a time.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from gcomp.passes import Instrument  # TVM is not loaded yet: threads are set first

# the passes a model compiles without (the others: eval_mode, canonicalize, dce, add_loss,
# autodiff), in pipeline order
OPTIONAL_PASSES = ("cse", "fuse_aggregate", "fuse_attention", "reorder_linear",
                   "hoist_graph_static", "elide_broadcasts", "split_concat_products",
                   "rematerialize", "fuse_bias_grads", "fuse_epilogues", "fuse_loss_grad")
# the passes that change nothing unless memory is preferred
MEMORY_PASSES = ("pack_relu_masks",)
DEFAULT_SIZES = {"cora": (2, 16), "pubmed-synth": (2, 16), "arxiv-synth": (3, 32)}


class Changes(Instrument):
    """The names of the passes that changed the IR (of either pipeline)."""

    def __init__(self):
        self.changed = set()

    def run_after_pass(self, pass_, graph, changed):
        if changed:
            self.changed.add(pass_.name)


def make_trainer(wl, disabled: frozenset, sparse: bool, reorder: str, loss_rows: bool = True,
                 changes=None, precision: str = "fp32", prefer: str = "speed"):
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.compiler import compile_model
    from gcomp.passes import PassContext
    from gcomp.runtime.trainer import Trainer
    t0 = time.perf_counter()
    art = compile_model(wl.model, train=True,
                        ctx=PassContext(disabled=disabled, instruments=changes or (),
                                        options={"prefer": prefer}),
                        optimizer=OptimizerConfig(name="adam", lr=0.01), precision=precision)
    compile_s = time.perf_counter() - t0
    variants = {} if sparse else {k: False for k in art.plan.variants}
    options = {"variants": variants, "reorder": reorder, "loss_rows": loss_rows}
    tr = Trainer(art, wl.graph, **options)
    bf16 = sum(v["dtype"] == "bfloat16" for v in art.train_plan.buffers.values())
    return tr, options, {"compile_s": compile_s, "bind_s": tr.bind_time_s,
                         "bfloat16_buffers": bf16, "kernel_calls": len(tr._binding.steps),
                         "planned_mb": tr._binding.memory.get("total_bytes", 0) / 2**20}


def configurations() -> dict[str, dict]:
    out = {"all": dict(disabled=frozenset(), sparse=True, reorder="auto")}
    for p in OPTIONAL_PASSES:
        out[f"-{p}"] = dict(disabled=frozenset({p}), sparse=True, reorder="auto")
    out["-sparse-features"] = dict(disabled=frozenset(), sparse=False, reorder="auto")
    out["-reorder"] = dict(disabled=frozenset(), sparse=True, reorder="none")
    out["-loss-rows"] = dict(disabled=frozenset(), sparse=True, reorder="auto", loss_rows=False)
    out["prefer-memory"] = dict(disabled=frozenset(), sparse=True, reorder="auto",
                                prefer="memory")
    for p in MEMORY_PASSES:
        out[f"prefer-memory/-{p}"] = dict(disabled=frozenset({p}), sparse=True,
                                          reorder="auto", prefer="memory")
    return out


def run_model(wl, reps: int, warmup: int, log, only: list[str] | None = None,
              memory=None, precision: str = "fp32") -> dict:
    """``memory``: a ``bench.memory.MemoryMeter`` that measures each configuration too."""
    from bench.cli import BF16_TOLERANCE, TOLERANCE
    from bench.protocol import settle, summarize
    from bench.runner import rel_diff
    tol = BF16_TOLERANCE if precision == "bf16" else TOLERANCE
    entry, trainers = {}, {}
    ref, changes = None, Changes()
    for name, cfg in configurations().items():
        if only is not None and name not in only:
            continue
        unused = cfg["disabled"] - changes.changed
        if name != "all" and cfg["disabled"] and unused == cfg["disabled"]:
            entry[name] = {"status": "no change"}
            log(f"  {name}: the pass changes nothing for this model")
            continue
        try:
            watched = name in ("all", "prefer-memory")  # where the passes' changes show
            tr, options, info = make_trainer(wl, **cfg, precision=precision,
                                             changes=changes if watched else None)
        except Exception as e:  # noqa: BLE001 - the compiler's reason is the result
            entry[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
            log(f"  {name}: cannot compile: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        out = tr.logits()
        if ref is None:
            ref = out
        d = rel_diff(out, ref)
        entry[name] = {"status": "ok", **info, "max_rel_diff": d}
        if not d <= tol:
            entry[name].update(status="not-equivalent")
            log(f"  {name}: output differs from 'all' by {d:.2e}; not timed")
            continue
        trainers[name] = tr
        if memory is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "model.gcomp")
                tr.artifact.save(path)
                entry[name]["memory"] = memory.measure("gcomp", wl, path, options)
            log(f"  {name}: peak RSS {entry[name]['memory'].get('extra_mb')} MB above the imports")
        log(f"  {name}: compile {info['compile_s']:.1f} s, {info['kernel_calls']} kernel calls")
    times = {k: [] for k in trainers}
    for rnd in range(warmup + reps):
        for k, tr in trainers.items():
            settle()
            t0 = time.perf_counter()
            tr.step()
            if rnd >= warmup:
                times[k].append(time.perf_counter() - t0)
    base = None
    for k, ts in times.items():
        entry[k].update(summarize(ts), times_s=ts)
        base = base or (entry["all"]["median_s"] if "all" in times else None)
        if base:
            entry[k]["slowdown"] = entry[k]["median_s"] / base
        log(f"  {k}: {entry[k]['median_s'] * 1e3:.1f} ms"
            + (f" ({entry[k]['slowdown']:.2f}x of all)" if base else ""))
    return entry


def markdown(results: dict) -> str:
    names = results.get("configs") or list(configurations())
    lines = ["# gcomp ablations: training epoch with one optimization off\n",
             f"{results['date_utc']} -- `{results['command']}`  ",
             f"{results['machine'].get('cpu_model', '?')}, threads = {results['threads']}, "
             f"{results.get('precision', 'fp32')}; median of "
             f"{results['reps']} alternating epochs; ms per epoch (slowdown vs `all`).\n"]
    for g, models in results["graphs"].items():
        lines += [f"## {g}\n", "| model | " + " | ".join(names) + " |",
                  "|---" * (len(names) + 1) + "|"]
        for m, e in models.items():
            cells = []
            for n in names:
                r = e.get(n, {})
                if r.get("status") != "ok" or "median_s" not in r:
                    cells.append(r.get("status", "-"))
                else:
                    cells.append(f"{r['median_s'] * 1e3:.1f}" +
                                 (f" ({r['slowdown']:.2f}x)" if "slowdown" in r else ""))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
        rss = {m: {n: e.get(n, {}).get("memory", {}).get("extra_mb") for n in names}
               for m, e in models.items()}
        if any(v is not None for r in rss.values() for v in r.values()):
            lines += ["Peak RSS MB above a process that only imported the libraries (a fresh "
                      "process per configuration):\n", "| model | " + " | ".join(names) + " |",
                      "|---" * (len(names) + 1) + "|"]
            lines += [f"| {m} | " + " | ".join("-" if v is None else f"{v:,.0f}"
                                               for v in r.values()) + " |"
                      for m, r in rss.items()]
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default="arxiv-synth")
    p.add_argument("--models", default="gcn,sage,gin,gat")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", action="store_true",
                   help="also each configuration's peak RSS, training in a fresh process")
    p.add_argument("--configs", default=None,
                   help="comma-separated configurations to run (default: all of them; 'all' "
                        "first is the baseline of the slowdowns)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the activations' precision of every configuration")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = p.parse_args(argv)
    only = None if a.configs is None else a.configs.split(",")
    unknown = sorted(set(only or ()) - set(configurations()))
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; they are "
                f"{', '.join(configurations())}")
    from bench.env import machine, set_threads, versions
    set_threads(a.threads)
    from bench import workload as W
    stamp = datetime.now(timezone.utc)
    from bench.memory import MemoryMeter
    meter = MemoryMeter(a.threads, "training", iters=3, timeout_s=900) if a.memory else None
    results = {"date_utc": stamp.isoformat(timespec="seconds"),
               "command": "python -m bench.ablation " + shlex.join(sys.argv[1:] if argv is None
                                                                    else argv),
               "machine": machine(), "versions": versions(), "threads": a.threads,
               "reps": a.reps, "warmup": a.warmup, "configs": only,
               "precision": a.precision, "graphs": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"ablation-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    for g in a.graphs.split(","):
        layers, hidden = DEFAULT_SIZES[g]
        results["graphs"][g] = {}
        for m in a.models.split(","):
            print(f"{g}/{m}: {layers} layers, hidden {hidden}", flush=True)
            wl = W.make(m, g, layers, hidden, 4)
            try:
                results["graphs"][g][m] = run_model(wl, a.reps, a.warmup,
                                                    lambda s: print(s, flush=True), only,
                                                    meter, a.precision)
            except Exception:  # noqa: BLE001 - keep the other models' results
                results["graphs"][g][m] = {"error": traceback.format_exc()}
                print(traceback.format_exc(), flush=True)
            path.write_text(json.dumps(results, indent=1))
    (a.out / "ablation-latest.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {path} and ablation-latest.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
