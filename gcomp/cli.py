"""The ``gcomp`` command line.

    gcomp compile MODEL -t llvm -o OUT.gcomp [--in F --hidden H --out C --layers L --heads K]
    gcomp run ART --graph GRAPH --out Y.npy [--features X.npy]
    gcomp train MODEL --graph GRAPH --epochs N [--lr --weight-decay --dropout --seed ...] [--json]
    gcomp info ART [--json]
    gcomp explain MODEL [-t TARGET] [--graph GRAPH] [--train] [--json]
    gcomp opt FILE.ir [--passes P1,P2]      (pass debugging: replay a reproducer)

User errors print one line on stderr and exit with code 2 (``--debug`` shows
the traceback).  Commands that only run artifacts import no compiler code, so
they work with the TVM runtime alone (``TVM_USE_RUNTIME_LIB=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from gcomp.errors import GcompError
from gcomp.files import writable_dir, write_atomic
from gcomp.runtime.formats import MODES

EXIT_USER_ERROR = 2


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _files(*paths) -> list[Path]:
    """The given paths that exist (the inputs an output must not replace)."""
    return [Path(p) for p in paths if p and Path(p).exists()]


def _check_output_path(out: Path, inputs: list[Path], kind: str,
                       suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse to write over an input of this command, or to a file not named as the arrays
    written there (``suffixes``): a mistyped ``--out model.onnx`` would replace the model."""
    for i in inputs:
        if _same_file(out, i) or out.resolve() == i.resolve():
            raise GcompError(f"refusing to write the {kind} to {str(out)!r}: it is an input of "
                             "this command")
    if suffixes is not None and out.suffix not in suffixes:
        raise GcompError(f"--out {str(out)!r}: the {kind} is written as "
                         f"{' or '.join(suffixes)}; name a file ending so")
    if out.exists() and out.is_dir():
        raise GcompError(f"{str(out)!r} is a directory")
    if not out.parent.exists():
        raise GcompError(f"directory {str(out.parent)!r} does not exist")


def _save_npy_atomic(path: Path, array) -> None:
    import numpy as np
    write_atomic(path, lambda f: np.save(f, array), suffix=".npy")


# ---------------------------------------------------------------------- compile
_BUNDLED_MODEL_FLAGS = (("--in", "in_channels"), ("--hidden", "hidden"),
                        ("--out", "out_channels"), ("--layers", "layers"), ("--heads", "heads"),
                        ("--edge-weight", "edge_weight"), ("--dropout", "dropout"))


def _model_from_args(args):
    if str(args.model).endswith(".onnx"):
        from gcomp.frontend.onnx import import_onnx
        # train's --seed draws the split; compile's initializes parameters an export has
        flags = _BUNDLED_MODEL_FLAGS + ((("--seed", "seed"),) if args.command != "train" else ())
        given = _flags_given(args, flags)
        if given:
            raise GcompError(f"{', '.join(given)}: these shape a bundled model; an ONNX model "
                             "keeps the layers, sizes and weights it was exported with")
        roles = {"features": args.features_input, "edge_index": args.edge_index_input,
                 "edge_weight": args.edge_weight_input}
        return import_onnx(args.model, roles)
    import gcomp.models as models
    if args.model != "gat" and _flags_given(args, (("--heads", "heads"),)):
        raise GcompError(f"--heads: attention heads are GAT's; {args.model!r} has none")
    return models.build(args.model, in_channels=args.in_channels, hidden=args.hidden,
                        out_channels=args.out_channels, layers=args.layers, heads=args.heads,
                        seed=args.seed, edge_weight=args.edge_weight,
                        dropout=getattr(args, "dropout", 0.0))


def _optimizer_from_args(args):
    from gcomp.codegen.optimizer import OptimizerConfig
    return OptimizerConfig(name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                           momentum=args.momentum)


def cmd_compile(args) -> int:
    from gcomp.compiler import compile_model
    from gcomp.runtime.artifact import FORMAT, manifest_format
    from gcomp.runtime.data import graph_file

    out = Path(args.output)
    _check_output_path(out, _files(args.model, graph_file(args.graph)), "artifact")
    if out.exists() and not args.force:
        if manifest_format(out) != FORMAT:
            raise GcompError(f"{str(out)!r} exists and is not a gcomp artifact; not overwriting "
                             "it (use --force)")
    t0 = time.perf_counter()
    model = _model_from_args(args)
    ctx, timing = _pass_context(args)
    from gcomp.passes import default_pipeline, training_pipeline
    runs = set(default_pipeline().pipeline) | (set(training_pipeline().pipeline) if args.train
                                               else set())
    for name in args.print_after or []:  # a flag that prints nothing says why
        if name not in runs or name in ctx.disabled:
            why = ("it is disabled" if name in ctx.disabled
                   else "it runs in the training pipeline only (--train)")
            print(f"gcomp: note: --print-after {name} prints nothing: {why}", file=sys.stderr)
    graph = None
    if args.graph:
        from gcomp.runtime.data import load_graph
        graph = load_graph(args.graph)
    art = compile_model(model, args.target, mcpu=args.mcpu, train=args.train, ctx=ctx,
                        optimizer=_optimizer_from_args(args) if args.train else None,
                        arch=_arch_from_args(args), graph=graph, precision=args.precision)
    art.save(out)
    dt = time.perf_counter() - t0
    if timing is not None:
        print(timing.render(), file=sys.stderr)
    print(f"compiled {model.name} for {args.target} in {dt:.2f} s: {len(art.kernels())} "
          f"kernels, {art.info()['num_parameters']} parameters -> {out}", file=sys.stderr)
    return 0


def _arch_from_args(args) -> str | None:
    """``--arch`` (CUDA only; default sm_90)."""
    arch = getattr(args, "arch", None)
    if arch is not None and args.target != "cuda":
        raise GcompError(f"--arch is for -t cuda, not -t {args.target}")
    return arch


def _pass_context(args):
    """The pass context that the pass-debugging flags ask for (and the timing instrument)."""
    from gcomp.debug import DumpIR, PassTiming, PrintAfter, PrintAfterChange, Reproducer
    from gcomp.passes import PASSES, PassContext

    for name in list(args.print_after or []) + list(args.disable_pass or []):
        if name not in PASSES:
            raise GcompError(f"unknown pass {name!r}; passes: {', '.join(sorted(PASSES))}")
    instruments = []
    # one printing instrument, so that a pass two flags name is printed once
    meta = args.show_meta
    if args.print_after_all:
        instruments.append(PrintAfter(stream=sys.stdout, show_meta=meta))
    elif args.print_after_change:
        instruments.append(PrintAfterChange(stream=sys.stdout, always=set(args.print_after or ()),
                                            show_meta=meta))
    elif args.print_after:
        instruments.append(PrintAfter(set(args.print_after), stream=sys.stdout, show_meta=meta))
    if args.dump_ir:
        instruments.append(DumpIR(args.dump_ir))
    if args.reproducer:
        instruments.append(Reproducer(args.reproducer))
    timing = PassTiming() if args.timing else None
    if timing:
        instruments.append(timing)
    ctx = PassContext(target=args.target, instruments=instruments,
                      disabled=frozenset(args.disable_pass or ()), options=_options(args),
                      tile_products=getattr(args, "tile_products", False))
    return ctx, timing


def _pass_flags(p) -> None:
    p.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    p.add_argument("--print-after", action="append", metavar="PASS",
                   help="print the IR after PASS (repeatable)")
    p.add_argument("--print-after-change", action="store_true",
                   help="print the IR after each pass that changed it (its annotations "
                        "included)")
    p.add_argument("--show-meta", action="store_true",
                   help="print the passes' annotations with the IR (fusion groups, phases, "
                        "hoisted values)")
    p.add_argument("--disable-pass", action="append", metavar="PASS", help="skip PASS (repeatable)")
    p.add_argument("--dump-ir", metavar="DIR", help="write numbered IR files after every pass")
    p.add_argument("--timing", action="store_true", help="print a per-pass timing table")
    _option_flags(p)
    p.add_argument("--reproducer", metavar="DIR",
                   help="when a pass fails, write its input IR and a replay command here")


def _option_flags(p) -> None:
    """The pass context's options (``passes.manager.OPTIONS``)."""
    # passes.manager.OPTIONS["prefer"], spelled out: `gcomp run` builds this parser in a
    # runtime-only process, which must not import the compiler's passes
    p.add_argument("--prefer", default="speed", choices=["speed", "memory"],
                   help="memory: no wide buffers of the features' aggregations kept across "
                        "training steps (reorder_linear); aggregate at the narrow width each "
                        "step instead; hidden aggregations and products of the features "
                        "computed again in the backward pass instead of kept (rematerialize); "
                        "no loss rows and, with --precision bf16, no bfloat16 copy of the "
                        "features; with -t cuda also the backward aggregations "
                        "scattered with atomics (no transposed graph on the GPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="no atomics: results bit for bit the same run after run (with "
                        "--prefer memory on cuda, keeps the transposed graph)")


def _options(args) -> dict:
    """The pass context's options that ``_option_flags`` parsed."""
    return {"prefer": args.prefer, "deterministic": args.deterministic}


# ---------------------------------------------------------------------- explain
def cmd_explain(args) -> int:
    from gcomp.compiler import check_feature_width, compile_model
    from gcomp.debug.explain import explain, render

    graph_data = None
    if args.graph:
        from gcomp.runtime.data import load_graph
        graph_data = load_graph(args.graph)
    from gcomp.passes import PassContext
    model = _model_from_args(args)
    if graph_data is not None:  # explain what can run, as compile --graph refuses it
        check_feature_width(model, graph_data)
    art = compile_model(model, args.target, train=args.train,
                        ctx=PassContext(options=_options(args)),
                        optimizer=_optimizer_from_args(args) if args.train else None,
                        precision=args.precision)
    g = art.graphs["training"] if args.train else art.graphs["inference"]
    report = explain(g, {"inference": art.plan, "training": art.train_plan}, graph_data,
                     gpu=art.target["kind"] == "cuda")
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


# ---------------------------------------------------------------------- opt
def cmd_opt(args) -> int:
    """Run passes on an IR file (a reproducer or a printed graph) and print the result."""
    from pathlib import Path as _P

    from gcomp.debug.instruments import parse_pipeline, read_ir, replay
    from gcomp.ir.parser import parse_graph
    from gcomp.ir.printer import print_graph
    from gcomp.passes import PassManager

    path = _P(args.file)
    if args.passes is None:  # the header's passes and pass context: no flag may change them
        given = _flags_given(args, (
            ("--disable-pass", "disable_pass"), ("-t", "target"), ("--prefer", "prefer"),
            ("--deterministic", "deterministic"), ("--tile-products", "tile_products")))
        if given:
            raise GcompError(f"{', '.join(given)} with a reproducer's header: the header names "
                             f"the passes and the context they failed in; give --passes (and "
                             f"these flags) to run other passes or another context")
    ctx, timing = _pass_context(args)
    if args.passes is None:
        graph = replay(path, instruments=ctx.instruments)
    else:
        graph = PassManager(parse_pipeline(args.passes))(parse_graph(read_ir(path)), ctx)
    if timing is not None:
        print(timing.render(), file=sys.stderr)
    print(print_graph(graph, show_meta=args.show_meta), end="")
    return 0


# ---------------------------------------------------------------------- run
def cmd_run(args) -> int:
    import numpy as np

    from gcomp.runtime import artifact
    from gcomp.runtime.data import graph_file, load_features, load_graph

    out = Path(args.out)
    inputs = _files(args.artifact, graph_file(args.graph))
    if args.features:
        inputs.append(Path(args.features))
    _check_output_path(out, inputs, "output", (".npy", ".npz"))
    art = artifact.load(args.artifact)
    names = [o["name"] for o in art.plan.outputs]
    if len(names) > 1 and out.suffix != ".npz":
        raise GcompError(f"the model has {len(names)} outputs ({', '.join(names)}): give "
                         f"--out FILE.npz to write each under its name")
    graph = load_graph(args.graph)
    node_inputs = [i for i in art.plan.inputs if i["role"] == "node"]
    if args.features:
        x = load_features(args.features, graph.num_nodes)
    else:
        x = graph.x if graph.x is not None else graph.dense_x()
    features = {i["name"]: x for i in node_inputs}
    ex = art.executor()
    ex.reorder, ex.formats = args.reorder, args.format
    t0 = time.perf_counter()
    binding = ex.bind(graph, features)
    t1 = time.perf_counter()
    binding = ex.feed(binding, features)
    ex.execute(binding)
    ex.sync()  # GPU kernels run asynchronously: the run time includes them
    ys = [np.asarray(y) for y in ex.outputs(binding)]
    t2 = time.perf_counter()
    if out.suffix == ".npz":
        write_atomic(out, lambda f: np.savez(f, **dict(zip(names, ys))), suffix=".npz")
    else:
        _save_npy_atomic(out, ys[0])
    shapes = ", ".join(f"{n} {tuple(y.shape)}" for n, y in zip(names, ys))
    print(f"{graph.name}: {graph.num_nodes} nodes, {graph.num_edges} edges -> {shapes} in "
          f"{out} (bind {1e3 * (t1 - t0):.1f} ms, run {1e3 * (t2 - t1):.1f} ms)",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- train
class _Progress:
    """A one-line progress bar on a terminal (stderr); silent otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def update(self, epoch: int, loss: float, ev: dict | None) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * epoch / self.total)
        acc = f" train {ev['train_acc']:.3f} val {ev['val_acc']:.3f}" if ev else ""
        sys.stderr.write(f"\r[{'=' * done}{' ' * (width - done)}] epoch {epoch}/{self.total} "
                         f"loss {loss:.4f}{acc}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def cmd_train(args) -> int:
    from gcomp.distributed.launch import run_distributed, world_size
    if world_size() > 1:  # under mpiexec: one shard per rank (docs/distributed.md)
        return run_distributed(_train, args)
    return _train(args)


def _train(args, comm=None) -> int:
    """``comm``: the MPI communicator when this is one rank of a distributed run."""
    import resource

    import numpy as np

    from gcomp.runtime import artifact as artifact_mod
    from gcomp.runtime.data import graph_file, load_graph, normalize_features
    from gcomp.runtime.trainer import Trainer

    if args.epochs < 0:
        raise GcompError("--epochs must be >= 0")
    if comm is None:
        given = _flags_given(args, (("--parts", "parts"), ("--hosts", "hosts"),
                                    ("--partition", "partition")))
        if given:
            raise GcompError(f"{', '.join(given)}: these split the graph across MPI ranks; "
                             f"this is one process (start it with mpiexec -n K gcomp train ...)")
    if args.save_every < 0 or (args.save_every and not args.checkpoint):
        raise GcompError("--save-every K writes the --checkpoint every K epochs: give a "
                         "--checkpoint and K >= 1 (0: only at the end)")
    is_artifact = _is_artifact(args.model)
    if is_artifact:  # what the artifact fixed cannot change here
        fixed = _flags_given(args, _COMPILE_FLAGS)
        if fixed:
            raise GcompError(f"{', '.join(fixed)}: {args.model!r} is compiled; its model, "
                             f"optimizer and precision were fixed then (gcomp info shows "
                             f"them): compile again with these flags, or train a bundled model "
                             f"or .onnx file with them")
    if args.checkpoint:  # before training: a result that cannot be written is lost
        inputs = _files(args.model, graph_file(args.graph), args.parts)
        _check_output_path(Path(args.checkpoint), inputs, "checkpoint")
        writable_dir(args.checkpoint, "checkpoint")
        from gcomp.runtime.trainer import check_checkpoint_path
        check_checkpoint_path(args.checkpoint)
    checkpoint = None
    if args.resume:  # read once, before compiling: a bad checkpoint fails early
        from gcomp.runtime.trainer import read_checkpoint
        checkpoint = read_checkpoint(args.resume)
    if args.seed is None:  # a resumed run draws the split and dropout of the one it resumes
        args.seed = int(checkpoint[1]["seed"]) if checkpoint else 0
    if comm is not None and args.format not in ("auto", "csr"):
        raise GcompError(f"--format {args.format}: distributed training aggregates in CSR "
                         f"(a shard's rows gather halo rows, which no square layout holds)")
    if comm is not None and args.reorder not in ("auto", "none"):
        raise GcompError(f"--reorder {args.reorder}: distributed training keeps a shard's "
                         f"rows in the partition's order (its own nodes, then the halo rows "
                         f"it receives)")
    if comm is not None and args.parts:
        given = _flags_given(args, (("--partition", "partition"), ("--hosts", "hosts")))
        if given:
            raise GcompError(f"{', '.join(given)}: --parts gives the partition; these choose "
                             f"one when it is not given")
    graph = load_graph(args.graph)
    if args.normalize_features:
        graph = normalize_features(graph)
    if graph.y is None:
        raise GcompError(f"graph {graph.name!r} has no labels (y); training needs them")
    t0 = time.perf_counter()
    if is_artifact:
        art = artifact_mod.load(args.model)
    else:
        from gcomp.compiler import compile_model
        if graph.num_features is None:
            raise GcompError(f"graph {graph.name!r} has no node features")
        args.in_channels = graph.num_features
        args.out_channels = int(graph.y.max()) + 1
        # a weighted graph's weights go to the model that takes them (bundled: GCN)
        args.edge_weight = graph.edge_weight is not None and args.model == "gcn"
        def build():
            return compile_model(_model_from_args(args), args.target, train=True,
                                 optimizer=_optimizer_from_args(args), arch=_arch_from_args(args),
                                 graph=graph if args.format == "auto" else None,
                                 precision=args.precision)
        if comm is None:
            art = build()
        else:
            from gcomp.distributed.launch import in_turn
            art = in_turn(comm, build)
    compile_s = time.perf_counter() - t0
    lead = comm is None or comm.rank == 0  # the rank that prints
    if (graph.edge_weight is not None and lead
            and not any(i["role"] == "edge" for i in art.plan.inputs)):
        print(f"gcomp: note: the model takes no edge weights; the edge_weight of graph "
              f"{graph.name!r} is not used", file=sys.stderr)
    if comm is None:
        trainer = Trainer(art, graph, seed=args.seed, reorder=args.reorder, formats=args.format)
    else:
        from gcomp.distributed.trainer import DistributedTrainer
        parts = None
        if args.parts:
            import numpy as np
            try:
                parts = np.load(args.parts, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise GcompError(f"cannot read the partition {args.parts!r} (a .npy array of "
                                 f"one rank per node, gcomp partition --out): {e}") from None
            if not isinstance(parts, np.ndarray):  # an .npz archive
                parts.close()
                raise GcompError(f"the partition {args.parts!r} is an .npz archive; give a .npy "
                                 f"array of one rank per node (gcomp partition --out)")
        trainer = DistributedTrainer(art, graph, seed=args.seed, comm=comm, parts=parts,
                                     method=args.partition, hosts=args.hosts)
    if args.resume:
        trainer.load(args.resume, checkpoint)
    if args.best_val and not trainer.val_mask.any():
        raise GcompError(f"--best-val reports the epoch of best validation accuracy; graph "
                         f"{graph.name!r} has no labelled validation node (val_mask)")
    progress = _Progress(args.epochs, sys.stderr.isatty() and not args.json and lead)
    # evaluating is collective (halo exchanges): every rank evaluates when the printing
    # rank's bar shows accuracies, whether or not its own stderr is a terminal
    bar = progress.enabled if comm is None else comm.bcast(progress.enabled, root=0)
    times, loss = [], float("nan")
    best = {"best_val_acc": None, "best_test_acc": None, "best_epoch": None}
    for epoch in range(1, args.epochs + 1):
        t = time.perf_counter()
        loss = trainer.step()
        times.append(time.perf_counter() - t)  # the training step only, not evaluation
        if not np.isfinite(loss):
            progress.close()
            raise GcompError(f"the loss became {loss} at epoch {epoch}; lower --lr")
        show_eval = bar and (epoch % max(1, args.epochs // 50) == 0 or epoch == args.epochs)
        ev = trainer.evaluate() if (show_eval or args.best_val) else None
        if args.best_val and (best["best_epoch"] is None or ev["val_acc"] > best["best_val_acc"]):
            best = {"best_val_acc": ev["val_acc"], "best_test_acc": ev["test_acc"],
                    "best_epoch": epoch}
        progress.update(epoch, loss, ev)
        if args.checkpoint and args.save_every and epoch % args.save_every == 0:
            trainer.save(args.checkpoint)
    progress.close()
    ev = trainer.evaluate()
    if not math.isfinite(ev["loss"]):  # the last update diverged: its logits are not numbers
        raise GcompError(f"the loss became {ev['loss']} after the last step (epoch "
                         f"{args.epochs}); lower --lr")
    if args.checkpoint:
        trainer.save(args.checkpoint)
    csr = {s["formats"]["graph"]: "csr" for s in art.train_plan.steps if "formats" in s}
    result = {
        "model": art.manifest["model"].get("name"), "graph": graph.name, "epochs": args.epochs,
        "final_loss": loss, "eval_loss": ev["loss"], "train_acc": ev["train_acc"],
        "val_acc": ev["val_acc"], "test_acc": ev["test_acc"],
        "epoch_ms_median": float(np.median(times) * 1e3) if times else None,
        "bind_ms": trainer.bind_time_s * 1e3, "compile_s": compile_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "planned_mb": trainer._binding.memory["total_bytes"] / 2**20,
        "step": trainer.step_count,
        "node_order": trainer.node_order,
        # rows the steps only the loss needs run on (codegen/loss_rows.py; all: every row)
        "loss_rows": (trainer._binding.dims["L"] if comm is None else graph.num_nodes),
        # formats chosen at bind time, and those fixed at compile time (--graph); CSR
        # where no choice was made (--format csr), and a shard aggregates in CSR
        # whatever the artifact was specialized to
        "formats": (csr if comm is not None else
                    {**csr, **art.train_plan.specialized.get("formats", {}),
                     **{k: v["chosen"] for k, v in trainer._binding.formats.items()}}),
        **(best if args.best_val else {}),
    }
    if comm is not None:
        traffic = comm.allreduce(np.array([float(v) for v in trainer.traffic().values()]))
        rep = trainer.partition
        result.update(ranks=comm.size, edge_cut=rep["edge_cut"], halo_rows=rep["halo"],
                      edge_balance=rep["edge_balance"],
                      bytes_per_epoch=dict(zip(trainer.traffic(), traffic.tolist())))
        if not lead:
            return 0
    if args.json:  # JSON has no NaN: a loss never computed, an accuracy over no node
        print(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                          for k, v in result.items()}))
    else:
        print(f"{result['model']} on {graph.name}: {args.epochs} epochs, loss {loss:.4f}, "
              f"train {ev['train_acc']:.4f}, val {ev['val_acc']:.4f}, test {ev['test_acc']:.4f}, "
              f"{result['epoch_ms_median'] or 0:.2f} ms/epoch (median)")
    return 0


# ---------------------------------------------------------------------- partition
def cmd_partition(args) -> int:
    from gcomp.distributed.partition import format_report, timed_partition
    from gcomp.runtime.data import graph_file, load_graph

    graph = load_graph(args.graph)
    out = Path(args.out) if args.out else None
    if out is not None:
        _check_output_path(out, _files(graph_file(args.graph)), "partition", (".npy",))
    parts, rep = timed_partition(graph, args.parts, method=args.method, hosts=args.hosts,
                                 balance=args.balance, seed=args.seed)
    if out is not None:
        _save_npy_atomic(out, parts.astype("int32"))
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0


# ---------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from gcomp.runtime import artifact
    from gcomp.runtime.memory import graph_array_bytes, hub_partial_bytes, plan_memory

    art = artifact.load(args.artifact)
    info = art.info()
    if args.graph:  # the memory plan needs a graph's node and edge counts
        from gcomp.runtime.data import check_feature_width, load_graph
        from gcomp.runtime.graph import GraphStructure
        g = load_graph(args.graph)
        # a plan for a graph it cannot run would mislead
        check_feature_width(g, [(inp["name"], inp["dims"][1]) for inp in art.plan.inputs
                                if inp["role"] == "node" and len(inp.get("dims", ())) == 2
                                and inp.get("dtype", "float32") == "float32"])
        info["memory"] = {}
        for label, plan in (("inference", art.plan), ("training", art.train_plan)):
            if plan is None:
                continue
            structs: dict = {}
            for gs in plan.graphs:
                structs[gs["name"]] = (GraphStructure.from_edge_index(g.edge_index, g.num_nodes)
                                       if gs["parent"] is None
                                       else structs[gs["parent"]].derive(gs["mode"]))
            # loss rows (codegen/loss_rows.py) counted as every row: the most they take
            sizes = {"N": g.num_nodes, "L": g.num_nodes,
                     **{f"E:{k}": v.num_edges for k, v in structs.items()},
                     **{f"E:{k}|L": v.num_edges for k, v in structs.items()}}
            from gcomp.runtime.features import sparsity
            for v in plan.variants.values():  # sparse-feature buffers, if that variant runs
                x = g.x
                on = x is not None and v["threshold"] is not None and sparsity(x) >= v["threshold"]
                nnz = int(x.nnz if hasattr(x, "nnz") else (x != 0).sum()) if on else 0
                sizes[f"NNZ:{v['input']}"] = nnz
            params = sum(v.nbytes for v in art.params.values())
            # a GPU's buffers share whole allocations; the CPU's are carved from an arena
            mem = plan_memory(plan, sizes, carve=art.target["kind"] != "cuda").summary()
            mem["parameters_bytes"] = params
            mem["graph_arrays"] = graph_array_bytes(plan, structs)
            mem["graph_arrays_bytes"] = sum(mem["graph_arrays"].values())
            if art.target["kind"] == "cuda":
                mem["hub_partials_bytes"] = hub_partial_bytes(plan, structs)
            info["memory"][label] = {"graph": g.name, **mem}
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    m = info["model"]
    print(f"artifact   {args.artifact}")
    print(f"model      {m.get('name')} {json.dumps({k: v for k, v in m.items() if k != 'name'})}")
    print(f"target     {json.dumps(info['target'])}"
          + (f", device code {info['device_code_format']}" if info["device_code_format"] else ""))
    print(f"versions   gcomp {info['gcomp_version']}, TVM {info['tvm_version']}, "
          f"format {info['format_version']}")
    print(f"precision  {info['precision']}"
          + (" (node-sized activations stored as bfloat16)" if info["precision"] == "bf16"
             else "")
          + ("; products on AMX tiles" if "amx" in info["cpu_features"] else "")
          + ("; products on AVX-512 BF16 dot products" if "avx512_bf16" in info["cpu_features"]
             else ""))
    if not info["deterministic"]:
        print("results    not bit for bit reproducible: backward aggregations add with atomics "
              "(compiled with --prefer memory; --deterministic avoids them)")
    for io_ in ("inputs", "outputs"):
        for s in info["signature"][io_]:
            print(f"{io_[:-1]:<10} {s['name']}: {s['type']} ({s['role']})")
    print(f"ops        {', '.join(f'{k} x{v}' for k, v in info['ops'].items())}")
    train = (f", {info['steps']['train']} training-step steps" if "train" in info["steps"]
             else "")
    print(f"kernels    {info['num_kernels']} ({info['steps']['bind']} bind-time steps, "
          f"{info['steps']['run']} run steps{train})")
    opt = info.get("optimizer")
    if opt:  # what gcomp train of this artifact cannot change
        shown = {k: v for k, v in opt.items() if k != "name"}
        print(f"training   {opt['name']} {json.dumps(shown, sort_keys=True)}")
        if info["untrained"]:
            print(f"untrained  {', '.join(info['untrained'])} (the loss does not depend on "
                  "them: training leaves them as they are)")
    else:
        print("training   none (an inference artifact; compile with --train to train)")
    print(f"parameters {info['num_parameters']} in {len(info['parameters'])} tensors")
    for k, shape in info["parameters"].items():
        print(f"           {k}: {shape}")
    print(f"sizes      kernels {info['sizes']['kernels_so_bytes']} B, parameters "
          f"{info['sizes']['params_bytes']} B")
    spec = info.get("specialized")
    if spec:  # the decisions made at compile time for one graph (gcomp compile --graph)
        rest = {k: v for k, v in spec.items() if k not in ("graph", "nodes", "edges")}
        print(f"specialized to graph {spec['graph']!r} ({spec['nodes']} nodes, {spec['edges']} "
              f"edges): {json.dumps(rest, sort_keys=True)}")
    for label, mem in info.get("memory", {}).items():
        mb = 2 ** 20
        print(f"memory     {label} on {mem['graph']}: {mem['total_bytes'] / mb:.1f} MiB planned "
              f"peak ({mem['pinned_bytes'] / mb:.1f} pinned + {mem['planned_bytes'] / mb:.1f} "
              f"shared by {mem['buffers']} buffers that would take "
              f"{mem['without_reuse_bytes'] / mb:.1f} without reuse; at most "
              f"{mem['live_peak_bytes'] / mb:.1f} of them live at once)")
        arrays = sorted(mem["graph_arrays"].items(), key=lambda kv: -kv[1])
        print(f"           and {mem['graph_arrays_bytes'] / mb:.1f} MiB of graph arrays ("
              + ", ".join(f"{k} {v / mb:.1f}" for k, v in arrays[:4])
              + (", ..." if len(arrays) > 4 else "") + ")"
              + (f" and {mem['hub_partials_bytes'] / mb:.1f} MiB of hub-task partials"
                 if "hub_partials_bytes" in mem else ""))
    return 0


# ---------------------------------------------------------------------- main
def _reorder_flag(p) -> None:
    p.add_argument("--reorder", default="auto", choices=["auto", "none", "rcm", "degree"],
                   help="node order for the kernels (auto: chosen by the cost model)")
    p.add_argument("--format", default="auto", choices=list(MODES),
                   help="adjacency format of the aggregations (auto: chosen by the cost model)")


def _is_artifact(model: str) -> bool:
    """Whether ``model`` names an artifact: a .gcomp file, or a file of another name that
    holds a manifest (a renamed artifact, as gcomp run and info take; loading one of
    another format says so)."""
    from gcomp.runtime.artifact import manifest_format
    return str(model).lower().endswith(".gcomp") or manifest_format(model) is not None


def _flags_given(args, flags) -> list[str]:
    """The flags of ``(flag, dest)`` pairs given on the command line (``args.argv``),
    whatever their values: a flag set to its default is given too."""
    if not hasattr(args, "given"):  # parsed once per command
        parser = _parser()
        actions = list(parser._actions)
        for a in parser._actions:  # every subcommand's options, their defaults suppressed
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    actions += sub._actions
        for a in actions:
            if a.option_strings:
                a.default = argparse.SUPPRESS
        args.given = set(vars(parser.parse_args(args.argv)))
    return [flag for flag, dest in flags if dest in args.given]


def _seed(text: str) -> int:
    """A seed: numpy's generators take non-negative integers."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _model_flags(p) -> None:
    p.add_argument("--in", dest="in_channels", type=int, default=1433, help="input features")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--out", dest="out_channels", type=int, default=7, help="output features")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="attention heads (gat)")
    p.add_argument("--seed", type=_seed, default=0, help="parameter initialization seed")
    p.add_argument("--edge-weight", action="store_true", help="gcn: take edge weights")


def _role_flags(p) -> None:
    """Which ONNX inputs are which (default: inferred from names, ranks and dtypes)."""
    p.add_argument("--features-input", metavar="NAME", help="ONNX: the node-feature input")
    p.add_argument("--edge-index-input", metavar="NAME", help="ONNX: the edge-index input")
    p.add_argument("--edge-weight-input", metavar="NAME", help="ONNX: the edge-weight input")


def _precision_flag(p) -> None:
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: store node-sized activations in bfloat16, compute in float32 "
                        "(weights, optimizer state, inputs and outputs stay float32)")


# gcomp train's flags that only compiling MODEL uses (a .gcomp artifact fixed them)
_COMPILE_FLAGS = (("--optimizer", "optimizer"), ("--lr", "lr"), ("--weight-decay", "weight_decay"),
                  ("--momentum", "momentum"), ("--dropout", "dropout"), ("--layers", "layers"),
                  ("--hidden", "hidden"), ("--heads", "heads"), ("--precision", "precision"),
                  ("-t", "target"), ("--arch", "arch"), ("--features-input", "features_input"),
                  ("--edge-index-input", "edge_index_input"),
                  ("--edge-weight-input", "edge_weight_input"))


def _training_flags(p) -> None:
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.0, help="sgd momentum")
    p.add_argument("--dropout", type=float, default=0.0)


def _parser() -> argparse.ArgumentParser:
    # no abbreviated options: a prefix such as --edge-weight would be taken for
    # --edge-weight-input, with a confusing error about that option
    p = argparse.ArgumentParser(prog="gcomp", description="An optimizing compiler for GNNs.",
                                allow_abbrev=False)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", allow_abbrev=False,
                       help="compile a model into an artifact")
    c.add_argument("model", help="bundled model (gcn, sage, gin, gat, ggnn) or an .onnx file")
    c.add_argument("-t", "--target", default="llvm", choices=["llvm", "cuda"])
    c.add_argument("-o", "--output", required=True, help="artifact path (.gcomp)")
    _model_flags(c)
    _role_flags(c)
    c.add_argument("--mcpu", default=None, help="llvm CPU (default: this machine's)")
    c.add_argument("--arch", default=None,
                   help="cuda: GPU architecture, e.g. sm_80, sm_90 (default), sm_100; the "
                        "artifact holds its SASS plus PTX for newer GPUs (docs/cuda.md)")
    c.add_argument("--force", action="store_true", help="overwrite a file that is not an artifact")
    c.add_argument("--graph", default=None,
                   help="specialize to this graph (.npz, cora, citeseer): compile only the "
                        "kernel variants its statistics choose")
    c.add_argument("--train", action="store_true",
                   help="also compile a training step (forward, loss, backward, optimizer)")
    _precision_flag(c)
    _training_flags(c)
    _pass_flags(c)
    c.set_defaults(func=cmd_compile)

    e = sub.add_parser("explain", allow_abbrev=False,
                       help="show the compiler's decisions and the numbers behind them")
    e.add_argument("model", help="bundled model (gcn, sage, gin, gat, ggnn) or an .onnx file")
    e.add_argument("-t", "--target", default="llvm", choices=["llvm", "cuda"])
    e.add_argument("--graph", default=None, help="also show the decisions for this graph")
    e.add_argument("--train", action="store_true", help="explain the training step")
    _precision_flag(e)
    _option_flags(e)
    e.add_argument("--json", action="store_true")
    _model_flags(e)
    _role_flags(e)
    _training_flags(e)
    e.set_defaults(func=cmd_explain)

    o = sub.add_parser("opt", allow_abbrev=False,
                       help="run passes on an IR file (replays reproducers)")
    o.add_argument("file", help="IR text (gcomp's printed form)")
    o.add_argument("--passes", default=None,
                   help="comma-separated pass names (default: the reproducer header's, run "
                        "in the pass context its header names)")
    o.add_argument("-t", "--target", default="llvm", choices=["llvm", "cuda"])
    o.add_argument("--tile-products", action="store_true",
                   help="bfloat16 products run on AMX tiles (what compile_model sets for "
                        "--precision bf16 on a CPU with them)")
    _pass_flags(o)
    o.set_defaults(func=cmd_opt)

    t = sub.add_parser("train", allow_abbrev=False,
                       help="train a model on a graph")
    t.add_argument("model", help="bundled model (gcn, sage, gin, gat, ggnn), an .onnx file or "
                                 "a --train artifact")
    _role_flags(t)
    t.add_argument("--graph", required=True, help="graph .npz with y (and masks), or a bundled name")
    t.add_argument("--epochs", type=int, default=200)
    t.add_argument("-t", "--target", default="llvm", choices=["llvm", "cuda"],
                   help="when compiling MODEL here: cuda trains on the GPU (docs/cuda.md)")
    t.add_argument("--arch", default=None, help="cuda: GPU architecture (default sm_90)")
    _precision_flag(t)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=16)
    t.add_argument("--heads", type=int, default=4, help="attention heads (gat)")
    t.add_argument("--seed", type=_seed, default=None,
                   help="initialization, split and dropout seed (default 0; with --resume, "
                        "the checkpoint's)")
    t.add_argument("--normalize-features", action="store_true",
                   help="row-normalize features to sum 1 (PyG's NormalizeFeatures)")
    t.add_argument("--checkpoint", default=None, help="write a checkpoint here at the end")
    t.add_argument("--save-every", type=int, default=0, help="also every K epochs")
    t.add_argument("--resume", default=None, help="start from this checkpoint")
    t.add_argument("--json", action="store_true", help="print the result as one JSON line")
    _reorder_flag(t)
    t.add_argument("--partition", default="auto", choices=["auto", "metis", "range", "random"],
                   help="under mpiexec: how to split the graph across ranks (docs/distributed.md)")
    t.add_argument("--hosts", type=int, default=None,
                   help="under mpiexec: partition across this many hosts first, then their ranks")
    t.add_argument("--parts", default=None,
                   help="under mpiexec: a .npy with the rank of every node (gcomp partition --out)")
    t.add_argument("--best-val", action="store_true",
                   help="evaluate every epoch; also report the test accuracy at the epoch of "
                        "best validation accuracy (the Planetoid protocol)")
    _training_flags(t)
    t.set_defaults(func=cmd_train)

    r = sub.add_parser("run", allow_abbrev=False,
                       help="run an artifact on a graph")
    r.add_argument("artifact")
    r.add_argument("--graph", required=True, help="graph .npz or a bundled dataset (cora, citeseer)")
    r.add_argument("--features", default=None, help="node features .npy (default: the graph's x)")
    r.add_argument("--out", required=True, help="where to write the output (.npy; .npz holds "
                   "every output of a model with several, by name)")
    _reorder_flag(r)
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("info", allow_abbrev=False,
                       help="describe an artifact")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true")
    i.add_argument("--graph", default=None, help="also report the planned memory for this graph")
    i.set_defaults(func=cmd_info)

    pa = sub.add_parser("partition", allow_abbrev=False,
                        help="split a graph across ranks and report the cost")
    pa.add_argument("graph", help="graph .npz or a bundled name")
    pa.add_argument("-k", "--parts", type=int, required=True, help="number of parts (ranks)")
    pa.add_argument("--method", default="auto", choices=["auto", "metis", "range", "random"])
    pa.add_argument("--hosts", type=int, default=None,
                    help="hierarchical: split across hosts first, then each host's ranks")
    pa.add_argument("--balance", default="edges", choices=["edges", "nodes"],
                    help="balance in-edges plus nodes (default) or nodes only")
    pa.add_argument("--seed", type=_seed, default=0)
    pa.add_argument("--out", default=None, help="save the part of every node (.npy)")
    pa.add_argument("--json", action="store_true")
    pa.set_defaults(func=cmd_partition)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # which flags were given
    try:
        return args.func(args)
    except GcompError as e:
        if args.debug:
            raise
        print(f"gcomp: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("gcomp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (gcomp info ... | head): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing stdout at exit cannot fail
        return 0


if __name__ == "__main__":
    sys.exit(main())
