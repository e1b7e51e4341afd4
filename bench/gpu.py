"""gcomp's CUDA artifacts against PyG (and cuSPARSE SpMM) on one GPU, in the same run.

A GPU host often has no TVM compiler (``docs/cuda.md``), so this runs in two halves:

``python -m bench.gpu prepare DIR [--graphs arxiv-synth,reddit-synth] [--precisions fp32,bf16]
[--prefer speed|memory] [--knob GCOMP_CUDA_...=VALUE ...]``
    on any machine with nvcc: compile the CUDA artifacts the run needs into DIR
    (3-layer GCN, GraphSAGE, GIN, GAT with 4 heads, hidden 32: inference and training,
    in each precision; a bare sum aggregation, the SpMM, at F = 32 and 128, and at F = 32
    also with a warp per row (``GCOMP_CUDA_AGG_MIN_LANES=32``, the layout before four rows
    a warp became the default), timed beside the default, as is the SpMM on the graph's
    nodes in their given order (the GPU's default orders skewed graphs by degree);
    with bf16, also Cora's 2-layer GCN for the accuracy runs).  ``--prefer memory`` compiles with
    that pass option (no wide aggregations of the features kept across training steps);
    DIR's ``prepared.json`` records it, and the run's results say it.  ``--knob`` sets a
    schedule tuning knob (``KNOBS``) while compiling, recorded the same way: prepare one
    directory per setting and run each with ``--profile`` to compare kernel times.

``python -m bench.gpu run DIR [--graphs ...] [--peers pyg,pyg-csr,pyg-compile] [--reps 10]
[--out bench/results/gpu]``
    on the GPU host, TVM runtime only: every system on the same graph with the same weights.
    One epoch = forward, cross-entropy over the training mask, backward, Adam (lr 0.01);
    inference = one forward with the features already on the device.  Times are wall clock
    around the step with the device synchronized after it, median of ``--reps`` after
    ``--warmup`` runs.  Memory: PyG's peak allocated bytes above its inputs
    (``torch.cuda.max_memory_allocated``); gcomp's, the device memory its executor holds
    after the steps (``cudaMemGetInfo`` before and after, the allocator pool included).
    Before timing, gcomp's forward output is checked against PyG eager (relative error).
    ``--profile`` adds gcomp's per-kernel times of a training step (each kernel called
    ``PROFILE_REPEAT`` times between synchronizations).
    ``--cuda-graphs`` also times gcomp with each step after the first replayed as a CUDA
    graph (``Executor.cuda_graphs``), and compares its final loss or output with the eager
    run's.
    ``--precisions fp32,bf16`` also times gcomp's bfloat16 build of every case (its forward
    output against the float32 build's, its loss after the same steps) and trains Cora's
    GCN ``ACCURACY_EPOCHS`` epochs in each precision (test accuracy); the peers run
    float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

MODELS = ("gcn", "sage", "gin", "gat")
LAYERS, HIDDEN, HEADS = 3, 32, 4
SPMM_WIDTHS = (32, 128)
SPMM_VARIANT = "lanes32"  # the SpMM with a warp per 32-feature row (schedules/cuda.py)
# the CUDA schedules' tuning knobs, read while compiling (docs/cuda.md, Tuning knobs);
# spelled out: `run` parses these arguments on a GPU host without TVM's compiler
KNOBS = ("GCOMP_CUDA_AGG_MIN_LANES", "GCOMP_CUDA_AGG_COLUMNS", "GCOMP_CUDA_EDGE_GROUP",
         "GCOMP_CUDA_TN_ROWS", "GCOMP_CUDA_TN_WAVES", "GCOMP_CUDA_MM_RESULTS",
         "GCOMP_CUDA_MM_ROWS")
ACCURACY_EPOCHS = 200  # Cora, GCN 2 x 16, Adam lr 0.01, weight decay 5e-4: the runs of
                       # bench.cuda_emulated_accuracy, so the GPU's figures meet the emulator's


PREPARED = "prepared.json"  # how prepare compiled a directory's artifacts


def artifact_path(d: Path, graph: str, what: str, precision: str = "fp32") -> Path:
    suffix = "" if precision == "fp32" else f"-{precision}"
    return Path(d) / f"{graph}-{what}{suffix}.gcomp"


def accuracy_model():
    """Cora's GCN of the accuracy runs (``bench.cuda_emulated_accuracy``'s), and its
    optimizer."""
    import gcomp.models
    from gcomp.codegen.optimizer import OptimizerConfig
    return (gcomp.models.build("gcn", 1433, hidden=16, out_channels=7, layers=2, seed=0),
            OptimizerConfig(name="adam", lr=0.01, weight_decay=5e-4))


def spmm_model(width: int):
    """out = sum over in-edges of x_j: the aggregation alone (an SpMM with A's values 1)."""
    from gcomp.frontend.builder import GraphInput, MessagePassing, NodeInput, trace

    class Sum(MessagePassing):
        def __init__(self):
            super().__init__(aggr="sum")

        def forward(self, x, edge_index):
            return self.propagate(edge_index, x=x)

    return trace(Sum(), {"x": NodeInput(width), "edge_index": GraphInput()}, name="spmm")


def prepare(args) -> None:
    from gcomp.passes import PassContext
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    prepared = {"prefer": args.prefer, **({"knobs": args.knobs} if args.knobs else {})}
    (out / PREPARED).write_text(json.dumps(prepared))
    ctx = PassContext(options={"prefer": args.prefer})  # compile_model sets the target
    with ExitStack() as knobs:
        for key, value in args.knobs.items():
            knobs.enter_context(_environ(key, value))
        _compile_all(args, out, ctx)


def _compile_all(args, out: Path, ctx) -> None:
    import gcomp.models
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.compiler import compile_model
    from gcomp.runtime.synthetic import SIZES
    from gcomp.schedules.cuda import AGG_MIN_LANES_ENV, AGG_VECTOR
    for graph in args.graphs:
        _, _, features, classes = SIZES[graph]  # the model needs the sizes, not the graph
        for name in args.models:
            m = gcomp.models.build(name, features, hidden=HIDDEN, out_channels=classes,
                                   layers=LAYERS, heads=HEADS, seed=0)
            for prec in args.precisions:
                compile_model(m, "cuda", precision=prec).save(
                    artifact_path(out, graph, f"{name}-infer", prec))
                compile_model(m, "cuda", train=True, precision=prec, ctx=ctx,
                              optimizer=OptimizerConfig(name="adam", lr=0.01)
                              ).save(artifact_path(out, graph, f"{name}-train", prec))
            print(f"prepared {graph} {name} {'/'.join(args.precisions)}", flush=True)
    for width in SPMM_WIDTHS:
        compile_model(spmm_model(width), "cuda").save(artifact_path(out, "any", f"spmm{width}"))
        if width // AGG_VECTOR < 32:  # the layout the knob changes, for the run to compare
            with _environ(AGG_MIN_LANES_ENV, "32"):
                compile_model(spmm_model(width), "cuda").save(
                    artifact_path(out, "any", f"spmm{width}-{SPMM_VARIANT}"))
    print(f"prepared spmm {SPMM_WIDTHS}", flush=True)
    if len(args.precisions) > 1:
        m, opt = accuracy_model()
        for prec in args.precisions:
            compile_model(m, "cuda", train=True, precision=prec, optimizer=opt).save(
                artifact_path(out, "cora", "gcn-accuracy", prec))
        print("prepared cora gcn-accuracy", flush=True)


@contextmanager
def _environ(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


# ---------------------------------------------------------------------------- timing
def timed(step, sync, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


BATCH = 20  # calls between two syncs in the SpMM's back-to-back timing


def timed_batch(step, sync, reps: int, warmup: int, batch: int = BATCH) -> list[float]:
    """Per-call times of ``batch`` calls between two syncs: the GPU's time for the work
    once the host's launch and sync latencies overlap it (``timed``'s single calls pay
    them on both sides of the comparison)."""
    return [t / batch for t in timed(lambda: [step() for _ in range(batch)], sync, reps,
                                     warmup)]


def summary(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3, "reps": len(times)}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def device_used() -> int:
    import torch
    free, total = torch.cuda.mem_get_info()
    return total - free


# ---------------------------------------------------------------------------- gcomp
def gcomp_inference(art, w, reps, warmup, graphs=False,
                    reorder: str = "auto") -> tuple[dict, np.ndarray]:
    before = device_used()
    ex = art.executor()
    ex.cuda_graphs, ex.reorder = graphs, reorder
    b = ex.bind(w.graph)
    b = ex.feed(b, {"x": w.x})
    ex.execute(b)
    out = ex.outputs(b)[0]
    res = summary(timed(lambda: ex.execute(b), ex.sync, reps, warmup))
    res["device_bytes"] = device_used() - before
    res["bind_s"] = b.bind_time_s
    res["node_order"] = b.reorder["chosen"]
    return res, out


def gcomp_training(art, w, reps, warmup, profile: bool, graphs=False,
                   reorder: str = "auto") -> dict:
    """A training epoch's time and device memory; ``reorder``: the node order when the
    graph is bound (``auto``: the runtime's rule; ``none``: the graph's own)."""
    from gcomp.runtime.trainer import Trainer
    before = device_used()
    tr = Trainer(art, w.graph, reorder=reorder)
    tr.train_ex.cuda_graphs = graphs
    res = summary(timed(tr.step, tr.train_ex.sync, reps, warmup))
    res["device_bytes"] = device_used() - before
    res["node_order"] = tr.node_order
    res["final_loss"] = tr.step()
    if profile:
        res["kernels"] = kernel_profile(tr, reps)
    return res


PROFILE_REPEAT = 20  # back-to-back calls of a kernel per synchronized measurement


def kernel_profile(tr, reps: int) -> list[dict]:
    """Each kernel of one training step, ``PROFILE_REPEAT`` calls of it back to back between
    two synchronizations (so the host's call and the synchronization, about 10 us, are
    spread over the calls): median ms a call, slowest first.  The repeats rewrite the
    step's buffers (Adam's parameters among them): this runs after the step's results."""
    b, sync = tr._binding, tr.train_ex.sync
    times = np.zeros((reps, len(b.steps)))
    for r in range(reps):
        for k, (fn, args) in enumerate(b.steps):
            sync()
            t0 = time.perf_counter()
            for _ in range(PROFILE_REPEAT):
                fn(*args)
            sync()
            times[r, k] = (time.perf_counter() - t0) / PROFILE_REPEAT
    med = np.median(times, axis=0) * 1e3
    rows = [{"kernel": s["kernel"], "ms": float(m)} for s, m in zip(b.plan_steps, med)]
    return sorted(rows, key=lambda r: -r["ms"])


# ---------------------------------------------------------------------------- PyG
def pyg_case(config: str, w, mode: str, reps: int, warmup: int) -> tuple[dict, np.ndarray]:
    import torch
    import torch.nn.functional as F

    from bench.peers_pyg import build_module, csr_input
    dev = torch.device("cuda")
    module = build_module(w.model, csr=config == "pyg-csr").to(dev)
    x = torch.from_numpy(w.x).to(dev)
    if config == "pyg-csr":
        edge, _ = csr_input(w.model.config["model"], w.graph.edge_index, w.graph.num_nodes)
        edge = edge.to(dev)
    else:
        edge = torch.from_numpy(w.graph.edge_index).to(dev)
    y = torch.from_numpy(w.y).to(dev)
    mask = torch.from_numpy(w.train_mask).to(dev)
    with torch.no_grad():
        module.eval()
        out = module(x, edge).cpu().numpy()  # also fills GCNConv's cache
    fn = torch.compile(module) if config == "pyg-compile" else module
    opt = torch.optim.Adam(module.parameters(), lr=0.01)

    def infer():
        with torch.no_grad():
            fn(x, edge)

    def train():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fn(x, edge)[mask], y[mask])
        loss.backward()
        opt.step()

    step = infer if mode == "inference" else train
    module.train(mode == "training")
    res = {}
    if config == "pyg-compile":
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        res["compile_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res.update(summary(timed(step, torch.cuda.synchronize, reps, warmup)))
    res["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    del module, opt, fn
    torch.cuda.empty_cache()
    return res, out


def spmm_cases(d: Path, graph: str, reps: int, warmup: int) -> list[dict]:
    import torch

    from bench.peers_pyg import csr_adj_t
    from bench.workload import load
    from gcomp.runtime.artifact import load as load_artifact
    g = load(graph)[0]
    adj = csr_adj_t(g.edge_index, g.num_nodes).to("cuda")  # values = edge multiplicities
    rows = []
    for width in SPMM_WIDTHS:
        x = np.random.default_rng(0).standard_normal((g.num_nodes, width)).astype(np.float32)
        xt = torch.from_numpy(x).cuda()
        ref = torch.sparse.mm(adj, xt)
        theirs = summary(timed(lambda: torch.sparse.mm(adj, xt), torch.cuda.synchronize,
                               reps, warmup))
        theirs["back_to_back"] = summary(timed_batch(lambda: torch.sparse.mm(adj, xt),
                                                     torch.cuda.synchronize, reps, 1))
        row = {"graph": graph, "width": width, "cusparse": theirs}
        for what, key, order in ((f"spmm{width}", "gcomp", "auto"),
                                 (f"spmm{width}", "given", "none"),
                                 (f"spmm{width}-{SPMM_VARIANT}", SPMM_VARIANT, "auto")):
            path = artifact_path(d, "any", what)
            if key == SPMM_VARIANT and not path.exists():  # prepared before the variant
                continue
            ours, out = _spmm_timed(load_artifact(path), g, x, reps, warmup, order)
            row[key] = {**ours, "rel_err": rel_err(out, ref.cpu().numpy())}
        row["rel_err"] = row["gcomp"].pop("rel_err")
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
        del xt, ref
        torch.cuda.empty_cache()
    return rows


def aggregate(ex, b) -> None:
    """The SpMM's whole work: its sum over x, an input, runs when x is fed (the binding's
    feed steps), so executing the binding alone would time nothing."""
    for _, fn, fargs in b.feed_steps:
        fn(*fargs)
    ex.execute(b)


def spmm_bound(art, g, x, reorder: str = "auto"):
    """(executor, binding) of the SpMM artifact ``art`` with ``g`` bound in the node order
    ``reorder`` and ``x`` fed, run once (warm)."""
    ex = art.executor()
    ex.reorder = reorder
    b = ex.feed(ex.bind(g), {"x": x})
    ex.execute(b)
    return ex, b


def _spmm_timed(art, g, x, reps: int, warmup: int, reorder: str) -> tuple[dict, np.ndarray]:
    """gcomp's SpMM with the node order ``reorder`` (``auto``: the GPU's rule,
    ``runtime/reorder.py``; ``none``: the graph's own; the output comes back in the
    user's order)."""
    ex, b = spmm_bound(art, g, x, reorder)
    ours = summary(timed(lambda: aggregate(ex, b), ex.sync, reps, warmup))
    ours["back_to_back"] = summary(timed_batch(lambda: aggregate(ex, b), ex.sync, reps, 1))
    ours["kernels"] = [s["kernel"] for s, _, _ in b.feed_steps] + [
        s["kernel"] for s in b.plan_steps]
    return ours, ex.outputs(b)[0]


def accuracy_cases(d: Path, precisions: list[str]) -> list[dict]:
    """Cora's GCN trained ``ACCURACY_EPOCHS`` epochs from the same weights in each
    precision: test accuracy, final loss, median epoch ms."""
    from gcomp.runtime.artifact import load as load_artifact
    from gcomp.runtime.data import load_graph
    from gcomp.runtime.trainer import Trainer
    g = load_graph("cora")
    rows = []
    for prec in precisions:
        tr = Trainer(load_artifact(artifact_path(d, "cora", "gcn-accuracy", prec)), g)
        times = timed(tr.step, tr.train_ex.sync, ACCURACY_EPOCHS - 1, 0)
        final = tr.step()
        rows.append({"precision": prec, **tr.evaluate(), "final_loss": final,
                     **summary(times)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args, save) -> dict:
    """Every case of ``args``; ``save(result)`` after each, so a peer that brings the
    process down (a CUDA error in a torch.compile'd kernel) loses no earlier case.  gcomp
    runs before the peers, and pyg-compile last."""
    import torch

    from bench.workload import make
    from gcomp.runtime.artifact import load, tvm_version
    d = Path(args.dir)
    result = {"command": " ".join(sys.argv), "when": datetime.now(timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(), "versions": versions(tvm_version()),
              "layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "reps": args.reps,
              "warmup": args.warmup, "reorder": args.reorder, "cases": [], "spmm": [],
              **(json.loads((d / PREPARED).read_text()) if (d / PREPARED).exists()
                 else {"prefer": "speed"})}
    for graph in args.graphs:
        if not args.no_spmm:
            result["spmm"] += spmm_cases(d, graph, args.reps, args.warmup)
            save(result)
        for name in args.models:
            w = make(name, graph, LAYERS, HIDDEN, HEADS)
            for mode in args.modes:
                case = {"graph": graph, "model": name, "mode": mode, **w.describe()}
                result["cases"].append(case)
                outs = {}
                for prec in args.precisions:
                    key = gcomp_key(prec)
                    art = load(artifact_path(
                        d, graph, f"{name}-{'train' if mode == 'training' else 'infer'}", prec))
                    if any(not np.array_equal(art.params[k], v)
                           for k, v in w.model.params.items()):
                        raise SystemExit(f"{graph} {name}: the artifact holds other weights "
                                         "than the workload's model: prepare it again")
                    for graphs in (False, True) if args.cuda_graphs else (False,):
                        k = key + ("-graph" if graphs else "")
                        try:
                            if mode == "inference":
                                case[k], o = gcomp_inference(art, w, args.reps, args.warmup,
                                                             graphs, args.reorder)
                                if graphs:  # the replay against the eager launches
                                    case[k]["rel_err_vs_eager"] = rel_err(o, outs[prec])
                                else:
                                    outs[prec] = o
                            else:
                                case[k] = gcomp_training(art, w, args.reps, args.warmup,
                                                         args.profile and not graphs, graphs,
                                                         args.reorder)
                        except Exception as e:  # noqa: BLE001 - report it with the case, run the rest
                            traceback.print_exc()
                            case[k] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    del art
                    torch.cuda.empty_cache()
                    save(result)
                out = outs.get("fp32")
                for prec, o in outs.items():
                    if prec != "fp32" and out is not None:
                        case[gcomp_key(prec)]["rel_err_vs_fp32"] = rel_err(o, out)
                for config in sorted(args.peers, key=lambda c: c == "pyg-compile"):
                    try:
                        case[config], ref = pyg_case(config, w, mode, args.reps, args.warmup)
                        if out is not None and "rel_err_vs_pyg" not in case["gcomp"]:
                            case["gcomp"]["rel_err_vs_pyg"] = rel_err(out, ref)
                    except Exception as e:  # noqa: BLE001 - record a peer's failure (OOM) and go on
                        case[config] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                        torch.cuda.empty_cache()
                    best = [case[c]["median_ms"] for c in args.peers
                            if "median_ms" in case.get(c, {})]
                    for prec in args.precisions:
                        ours = case.get(gcomp_key(prec), {})
                        if best and "median_ms" in ours:
                            case["speedup_vs_best_pyg" + ("" if prec == "fp32" else f"_{prec}")
                                 ] = min(best) / ours["median_ms"]
                    save(result)
                print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "kernels"}
                                      if k.startswith("gcomp") and isinstance(v, dict) else v)
                                  for k, v in case.items()}), flush=True)
    if len(args.precisions) > 1 and not args.no_accuracy:
        result["accuracy"] = accuracy_cases(d, args.precisions)
        save(result)
    return result


def gcomp_key(precision: str) -> str:
    """A case's key for gcomp's build in ``precision``: ``gcomp`` (float32), ``gcomp-bf16``."""
    return "gcomp" if precision == "fp32" else f"gcomp-{precision}"


def merge(paths: list[str]) -> dict:
    """One result from several runs (say one process per model) on the same device."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["device"] for r in runs}
    if len(devices) != 1:
        raise SystemExit(f"results from different devices: {sorted(devices)}")
    res = dict(runs[0], command=" ; ".join(r["command"] for r in runs),
               cases=[c for r in runs for c in r["cases"]],
               spmm=[c for r in runs for c in r["spmm"]],
               accuracy=[c for r in runs for c in r.get("accuracy", [])])
    return res


def versions(tvm: str) -> dict:
    import platform

    import torch
    import torch_geometric

    import gcomp
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "torch_geometric": torch_geometric.__version__,
            "tvm": tvm, "gcomp": gcomp.__version__}


def markdown(res: dict) -> str:
    lines = [f"# gcomp vs PyG on {res['device']}", "",
             f"`{res['command']}` at {res['when']}; {res['versions']}.  "
             f"{res['layers']} layers, hidden {res['hidden']}, GAT {res['heads']} heads; "
             f"median of {res['reps']} after {res['warmup']} warm-ups"
             + (".  gcomp's training steps compiled with `--prefer memory`."
                if res.get("prefer") == "memory" else ".")
             + "".join(f"  Compiled with {k}={v}." for k, v in res.get("knobs", {}).items())
             + (f"  gcomp bound the graphs with `--reorder {res['reorder']}`."
                if res.get("reorder", "auto") != "auto" else ""),
             ""]
    if res["spmm"]:
        lines += ["| graph | F | gcomp SpMM ms | cuSPARSE ms | ratio | back to back "
                  f"({BATCH} calls a sync): gcomp / cuSPARSE ms, ratio | rel err | a warp per "
                  "row (GCOMP_CUDA_AGG_MIN_LANES=32) ms | nodes in the given order ms |",
                  "|---|---|---|---|---|---|---|---|---|"]

        def batched(r):
            ours, theirs = r["gcomp"].get("back_to_back"), r["cusparse"].get("back_to_back")
            if not ours or not theirs:  # results of runs before it was timed
                return "-"
            return (f"{ours['median_ms']:.3f} / {theirs['median_ms']:.3f}, "
                    f"{theirs['median_ms'] / ours['median_ms']:.2f}x")

        def cell(v):
            return f"{v['median_ms']:.3f} (rel err {v['rel_err']:.1e})" if v else "-"
        for r in res["spmm"]:
            lines.append(f"| {r['graph']} | {r['width']} | {r['gcomp']['median_ms']:.3f} | "
                         f"{r['cusparse']['median_ms']:.3f} | "
                         f"{r['cusparse']['median_ms'] / r['gcomp']['median_ms']:.2f}x | "
                         f"{batched(r)} | {r['rel_err']:.1e} | {cell(r.get(SPMM_VARIANT))} | "
                         f"{cell(r.get('given'))} |")
        lines.append("")
    peers = [p for p in ("pyg", "pyg-csr", "pyg-compile") if any(p in c for c in res["cases"])]
    bf16 = any("gcomp-bf16" in c for c in res["cases"])
    extra = (["gcomp bf16 ms / MiB", "bf16 vs best PyG", "bf16 rel diff", "loss fp32 / bf16"]
             if bf16 else [])
    cols = ["graph", "model", "mode", "gcomp ms", "gcomp MiB",
            *(f"{p} ms / MiB" for p in peers), "vs best PyG", *extra]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in res["cases"]:
        g = c.get("gcomp", {"error": "the process died in gcomp's run"})
        if "median_ms" not in g:
            lines.append(f"| {c['graph']} | {c['model']} | {c['mode']} | {g['error'][:60]} |")
            continue
        cells = []
        for p in peers:
            r = c.get(p, {})
            cells.append(f"{r['median_ms']:.2f} / {r['peak_extra_bytes'] / 2**20:.0f}"
                         if "median_ms" in r else r.get("error", "-")[:40])
        sp = f"{c['speedup_vs_best_pyg']:.2f}x" if "speedup_vs_best_pyg" in c else "-"
        row = "| " + " | ".join([c["graph"], c["model"], c["mode"], f"{g['median_ms']:.2f}",
                                  f"{g['device_bytes'] / 2**20:.0f}", *cells, sp]) + " |"
        if bf16:
            h = c.get("gcomp-bf16", {"error": "-"})
            if "median_ms" in h:
                sp16 = c.get("speedup_vs_best_pyg_bf16")
                loss = (f"{g['final_loss']:.4f} / {h['final_loss']:.4f}"
                        if "final_loss" in h else "-")
                # a training case has no forward output to compare: its losses do
                diff = f"{h['rel_err_vs_fp32']:.1e}" if "rel_err_vs_fp32" in h else "-"
                row += (f" {h['median_ms']:.2f} / {h['device_bytes'] / 2**20:.0f} | "
                        f"{f'{sp16:.2f}x' if sp16 else '-'} | {diff} | {loss} |")
            else:
                row += f" {h['error'][:40]} | - | - | - |"
        lines.append(row)
    replays = [(c, k) for c in res["cases"] for k in c if k.endswith("-graph")]
    if replays:
        lines += ["", "gcomp's steps replayed as one CUDA graph (`--cuda-graphs`), against "
                  "its eager launches:", "",
                  "| graph | model | mode | build | eager ms | CUDA graph ms | speed-up | "
                  "same result |", "|---|---|---|---|---|---|---|---|"]
        for c, k in replays:
            eager, g = c.get(k[:-len("-graph")], {}), c[k]
            if "median_ms" not in g or "median_ms" not in eager:
                lines.append(f"| {c['graph']} | {c['model']} | {c['mode']} | {k} | "
                             f"{g.get('error', eager.get('error', '-'))[:60]} | | | |")
                continue
            same = (f"loss {g['final_loss']:.6f} / {eager['final_loss']:.6f}"
                    if "final_loss" in g else f"rel err {g.get('rel_err_vs_eager', float('nan')):.1e}")
            lines.append(f"| {c['graph']} | {c['model']} | {c['mode']} | {k[:-len('-graph')]} | "
                         f"{eager['median_ms']:.3f} | {g['median_ms']:.3f} | "
                         f"{eager['median_ms'] / g['median_ms']:.2f}x | {same} |")
    if res.get("accuracy"):
        lines += ["", f"Cora, GCN 2 x 16, {ACCURACY_EPOCHS} epochs from the same weights "
                  "(Adam lr 0.01, weight decay 5e-4):", "",
                  "| precision | test accuracy | val accuracy | final loss | epoch ms |",
                  "|---|---|---|---|---|"]
        for r in res["accuracy"]:
            lines.append(f"| {r['precision']} | {r['test_acc']:.3f} | {r['val_acc']:.3f} | "
                         f"{r['final_loss']:.4f} | {r['median_ms']:.3f} |")
    for c in res["cases"]:
        if "kernels" in c.get("gcomp", {}):
            lines += ["", f"{c['graph']} {c['model']} training step, slowest kernels (ms): " +
                      ", ".join(f"{k['kernel']} {k['ms']:.3f}" for k in c["gcomp"]["kernels"][:8])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["prepare", "run", "report"])
    p.add_argument("dir", help="artifact directory (report: the result JSON files, "
                               "comma-separated)")
    p.add_argument("--graphs", default="arxiv-synth")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default="training,inference")
    p.add_argument("--peers", default="pyg,pyg-csr")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time gcomp with each step replayed as a CUDA graph")
    p.add_argument("--no-spmm", action="store_true")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip the Cora accuracy runs (a run of several processes makes them once)")
    p.add_argument("--prefer", default="speed", choices=["speed", "memory"],
                   help="prepare: the training steps' pass option (see gcomp compile)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help=f"prepare: a schedule tuning knob set while compiling ({', '.join(KNOBS)})")
    p.add_argument("--reorder", default="auto", choices=["auto", "none", "rcm", "degree"],
                   help="run: gcomp's node order when a graph is bound (auto: the "
                        "runtime's rule, degree order for skewed graphs on a GPU)")
    p.add_argument("--precisions", default="fp32",
                   help="fp32 and/or bf16: gcomp's builds to prepare and time")
    p.add_argument("--out", default="bench/results/gpu")
    args = p.parse_args(argv)
    for k in ("graphs", "models", "modes", "peers", "precisions"):
        setattr(args, k, [s for s in getattr(args, k).split(",") if s])
    if "fp32" not in args.precisions or set(args.precisions) - {"fp32", "bf16"}:
        p.error("--precisions: fp32, optionally with bf16")
    args.knobs = dict(k.split("=", 1) for k in args.knob if "=" in k)
    if len(args.knobs) != len(args.knob) or set(args.knobs) - set(KNOBS):
        p.error(f"--knob: NAME=VALUE with NAME one of {', '.join(KNOBS)}")
    if args.action == "prepare":
        prepare(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.action == "report":
        res = merge(args.dir.split(","))
        (out / "gpu-latest.json").write_text(json.dumps(res, indent=1))
        (out / "gpu-latest.md").write_text(markdown(res))
        print(markdown(res))
        return 0
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = out / f"gpu-{stamp}.json"
    res = run(args, lambda r: path.write_text(json.dumps(r, indent=1)))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
