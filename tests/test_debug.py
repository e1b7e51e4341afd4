"""The pass-debugging API: printing, dumping, timing, disabling, verifying, reproducing."""

import io

import pytest

import gcomp.models as models
from gcomp.cli import main
from gcomp.compiler import compile_model
from gcomp.debug import DumpIR, PassTiming, PrintAfter, PrintAfterChange, Reproducer, replay
from gcomp.errors import GcompError, IRError
from gcomp.ir import Op, parse_graph, print_graph
from gcomp.passes import (PASSES, Canonicalize, DeadCodeElimination, FuseAggregate, PassContext,
                          PassError, PassManager, default_pipeline)


def gcn():
    return models.build("gcn", 6, hidden=4, out_channels=3, layers=2)


def test_print_after_all_and_selected():
    out = io.StringIO()
    default_pipeline()(gcn().graph.copy(), PassContext(instruments=[PrintAfter(stream=out)]))
    text = out.getvalue()
    for name in default_pipeline().pipeline:
        assert f"// ----- IR after {name}" in text
    out = io.StringIO()
    default_pipeline()(gcn().graph.copy(),
                       PassContext(instruments=[PrintAfter({"fuse_aggregate"}, stream=out)]))
    assert out.getvalue().count("// ----- IR after") == 1
    assert "aggregate(" in out.getvalue() and "scatter(" not in out.getvalue()


def test_print_after_change_skips_unchanged_passes():
    out = io.StringIO()
    default_pipeline()(gcn().graph.copy(), PassContext(instruments=[PrintAfterChange(out)]))
    text = out.getvalue()
    assert "after fuse_aggregate (changed)" in text and "after cse (changed)" in text
    assert "after eval_mode" not in text  # no dropout: nothing changed
    assert "after hoist_graph_static (changed)" in text  # analysis only: annotations changed
    assert "after dce" not in text
    assert "#:" not in text  # annotations compared, printed with show_meta only
    out = io.StringIO()
    default_pipeline()(gcn().graph.copy(),
                       PassContext(instruments=[PrintAfterChange(out, show_meta=True)]))
    assert '"phase": "feed"' in out.getvalue()


def test_dump_ir_numbered_files_parse(tmp_path):
    default_pipeline()(gcn().graph.copy(), PassContext(instruments=[DumpIR(tmp_path)]))
    names = sorted(p.name for p in tmp_path.iterdir())
    expected = ["00_input.ir"] + [f"{i + 1:02d}_{name}.ir"
                                  for i, name in enumerate(default_pipeline().pipeline)]
    assert names == expected and "04_fuse_aggregate.ir" in names
    for p in tmp_path.iterdir():
        parse_graph(p.read_text())


def test_timing_table():
    t = PassTiming()
    default_pipeline()(gcn().graph.copy(), PassContext(instruments=[t]))
    table = t.render()
    assert [n for n, _, _ in t.times][0] == "eval_mode" and "total" in table.splitlines()[-1]
    assert all(ms >= 0 for _, ms, _ in t.times)


def test_disable_pass_keeps_messages_unfused():
    g = default_pipeline()(gcn().graph.copy(), PassContext(disabled=frozenset({"fuse_aggregate"})))
    ops = {n.op for n in g}
    assert Op.SCATTER in ops and Op.AGGREGATE not in ops
    # and the unfused graph still compiles and gives the same answer as the fused one
    from conftest import awkward_graph, rel_err
    m = gcn()
    graph = awkward_graph(num_features=6)
    a = compile_model(m).run(graph)[0]
    b = compile_model(m, ctx=PassContext(disabled=frozenset({"fuse_aggregate"}))).run(graph)[0]
    assert rel_err(b, a) < 1e-5


class Breaks(DeadCodeElimination):
    """A broken pass: retypes a node wrongly."""
    name = "breaks"

    def run(self, graph, ctx):
        from gcomp.ir.types import TensorType
        n = [n for n in graph if n.op == Op.RELU][0]
        n.ty = TensorType(("N", 99))
        return True


def test_verify_after_each_pass_names_the_pass(tmp_path):
    g = gcn().graph.copy()
    pm = PassManager([Canonicalize(), Breaks()])
    with pytest.raises(IRError, match=r"(?s)pass 'breaks' failed: invalid IR .*%relu: type is f32\[N,99\].*>> %relu.*\(passes that ran before it: canonicalize\)"):
        pm(g, PassContext())


def test_reproducer_replays_the_failure(tmp_path, monkeypatch, capsys):
    rep = Reproducer(tmp_path)
    pm = PassManager([Canonicalize(), Breaks()])
    monkeypatch.setitem(PASSES, "breaks", Breaks)
    with pytest.raises(IRError):
        pm(gcn().graph.copy(), PassContext(instruments=[rep]))
    text = rep.path.read_text()
    assert text.startswith(f"# gcomp reproducer: gcomp opt {rep.path} --passes breaks")
    assert "# pipeline before it: canonicalize" in text
    with pytest.raises(IRError, match="breaks"):
        replay(rep.path)
    assert main(["opt", str(rep.path)]) == 2  # the CLI replays it: same failure, exit code 2
    assert "pass 'breaks' failed" in capsys.readouterr().err


class Picky(DeadCodeElimination):
    """Fails, recording the pass context it ran in."""
    name = "picky"
    seen: list = []

    def run(self, graph, ctx):
        Picky.seen.append((ctx.target, ctx.tile_products, ctx.option("prefer"),
                           ctx.option("deterministic")))
        raise RuntimeError("kaput")


@pytest.mark.parametrize("ctx_args", [
    {},
    {"target": "cuda", "options": {"prefer": "memory", "deterministic": True}},
    {"tile_products": True, "options": {"prefer": "memory"}},
])
def test_reproducer_replays_in_the_pass_context_of_the_failure(tmp_path, monkeypatch, capsys,
                                                                ctx_args):
    monkeypatch.setitem(PASSES, "picky", Picky)
    monkeypatch.setattr(Picky, "seen", [])
    rep = Reproducer(tmp_path / "a dir")  # a path the header must quote
    with pytest.raises(PassError):
        PassManager([Canonicalize(), Picky()])(gcn().graph.copy(),
                                               PassContext(instruments=[rep], **ctx_args))
    with pytest.raises(PassError, match="kaput"):
        replay(rep.path)
    assert main(["opt", str(rep.path)]) == 2
    assert "pass 'picky' failed: kaput" in capsys.readouterr().err
    assert len(Picky.seen) == 3 and len(set(Picky.seen)) == 1  # the same context each time


@pytest.mark.parametrize("name", ["gin", "gat"])
def test_each_dumped_ir_replays_to_the_next(tmp_path, name):
    """The dump after pass k, replayed through pass k + 1, prints as the dump after it:
    the annotations passes leave (phases, fusion groups, hoisting, the gradient map) are
    written as #: JSON and read back, so a replay sees what the pass saw."""
    from gcomp.passes import training_pipeline
    m = models.build(name, 8, hidden=8, out_channels=3, layers=2, heads=2)
    training_pipeline()(m.graph.copy(), PassContext(instruments=[DumpIR(tmp_path)]))
    files = sorted(tmp_path.glob("*.ir"))
    assert len(files) == len(training_pipeline().pipeline) + 1
    assert "#: graph" in files[-1].read_text() and '#: {"' in files[-1].read_text()
    for before, after in zip(files, files[1:]):
        replayed = replay(before, passes=after.stem.split("_", 1)[1])
        assert print_graph(replayed, show_meta=True) == after.read_text(), after.name


def test_annotations_must_be_json_objects_on_known_values():
    text = "graph g(%x: f32[N,4]) {\n  #: %y {}\n  return %x\n}\n"
    with pytest.raises(IRError, match="names %y, which is not an input"):
        parse_graph(text)
    bad = "graph g(%x: f32[N,4]) {\n  %r = relu(%x) : f32[N,4]  #: [1]\n  return %r\n}\n"
    with pytest.raises(IRError, match="line 2: bad annotation"):
        parse_graph(bad)
    ok = bad.replace("#: [1]", '#: {"phase": "run"}  ').replace("return %r", "return %r  # a comment")
    assert parse_graph(ok).node("r").meta == {"phase": "run"}


def test_unusable_directories_and_ir_files_are_named(tmp_path, monkeypatch, capsys):
    """--dump-ir / --reproducer at a file or under a missing root, gcomp opt on a directory
    or an artifact: one error naming the path, before any pass runs.  A reproducer that
    cannot be written when a pass fails leaves the pass's error to be raised."""
    taken = tmp_path / "taken.txt"
    taken.write_text("mine")
    out = tmp_path / "m.gcomp"
    for flag in ("--dump-ir", "--reproducer"):
        assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                     flag, str(taken)]) == 2
        assert f"cannot use '{taken}' as the" in capsys.readouterr().err
    assert taken.read_text() == "mine" and not out.exists()
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["opt", str(out), "--passes", "cse"]) == 2
    assert "is not IR text" in capsys.readouterr().err
    assert main(["opt", str(tmp_path), "--passes", "cse"]) == 2
    assert "is a directory, not an IR file" in capsys.readouterr().err
    with pytest.raises(GcompError, match="does not exist"):
        replay(tmp_path / "none.ir")
    rep = Reproducer(tmp_path / "repro")
    (tmp_path / "repro").rmdir()
    (tmp_path / "repro").write_text("in the way")
    monkeypatch.setitem(PASSES, "breaks", Breaks)
    with pytest.raises(IRError, match="breaks"):
        PassManager([Breaks()])(gcn().graph.copy(), PassContext(instruments=[rep]))
    assert rep.path is None and "no reproducer written" in capsys.readouterr().err


def test_opt_refuses_flags_a_reproducer_header_overrides(tmp_path, monkeypatch, capsys):
    rep = Reproducer(tmp_path)
    monkeypatch.setitem(PASSES, "breaks", Breaks)
    with pytest.raises(IRError):
        PassManager([Canonicalize(), Breaks()])(gcn().graph.copy(), PassContext(instruments=[rep]))
    for flags in (["--disable-pass", "breaks"], ["-t", "cuda"], ["--deterministic"]):
        assert main(["opt", str(rep.path), *flags]) == 2
        assert f"{flags[0]} with a reproducer's header" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["opt", str(rep.path), "--passes", "cse", "-t", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_malformed_reproducer_header_is_named(tmp_path):
    path = tmp_path / "repro.ir"
    path.write_text("# gcomp reproducer: gcomp opt x.ir --passes dce --prefer fastest\n"
                    + print_graph(gcn().graph))
    with pytest.raises(GcompError, match=r"repro.ir: malformed reproducer header .*fastest"):
        replay(path)
    path.write_text(print_graph(gcn().graph))
    with pytest.raises(GcompError, match="no --passes given and no reproducer header"):
        replay(path)


def test_cli_compile_debug_flags(tmp_path, capsys):
    out = tmp_path / "m.gcomp"
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                 "--print-after", "fuse_aggregate", "--timing", "--dump-ir", str(tmp_path / "ir"),
                 "--disable-pass", "cse"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("// ----- IR after fuse_aggregate") == 1
    assert "pass" in captured.err and "fuse_aggregate" in captured.err  # the timing table
    assert not any("cse" in p.name for p in (tmp_path / "ir").iterdir())
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                 "--print-after-all"]) == 0
    assert capsys.readouterr().out.count("// ----- IR after") == len(default_pipeline().pipeline)
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                 "--print-after-change", "--train"]) == 0
    assert "after autodiff (changed)" in capsys.readouterr().out
    # both flags: the named pass once (changed or not), the other changed passes once each
    for named, state in (("fuse_aggregate", "changed"), ("eval_mode", "unchanged")):
        assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                     "--print-after", named, "--print-after-change"]) == 0
        text = capsys.readouterr().out
        assert text.count(f"// ----- IR after {named} ") == 1
        assert f"// ----- IR after {named} ({state})" in text
        assert text.count("// ----- IR after cse ") == 1
        assert "after dce" not in text
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                 "--print-after-all", "--print-after-change"]) == 0
    assert capsys.readouterr().out.count("// ----- IR after") == len(default_pipeline().pipeline)
    assert main(["explain", "gcn", "--train"]) == 0
    assert "once per feed" in capsys.readouterr().out
    from gcomp.runtime.artifact import load
    for prefer, hoisted in (("speed", True), ("memory", False)):  # GCN's 64-wide A X
        assert main(["compile", "gcn", "--in", "64", "--out", "3", "-o", str(out), "--train",
                     "--prefer", prefer]) == 0
        assert bool(load(out).train_plan.feed_steps) == hoisted
    assert main(["compile", "gcn", "--in", "6", "--out", "3", "-o", str(out),
                 "--print-after", "autodiff", "--print-after", "cse", "--disable-pass", "cse"]) == 0
    err = capsys.readouterr().err
    assert "--print-after autodiff prints nothing: it runs in the training pipeline only" in err
    assert "--print-after cse prints nothing: it is disabled" in err
    assert main(["compile", "gcn", "-o", str(out), "--disable-pass", "fusion"]) == 2
    assert "unknown pass 'fusion'" in capsys.readouterr().err


def test_cli_opt_runs_named_passes(tmp_path, capsys):
    f = tmp_path / "g.ir"
    f.write_text(print_graph(gcn().graph))
    assert main(["opt", str(f), "--passes", "canonicalize,cse,fuse_aggregate,dce"]) == 0
    out = capsys.readouterr().out
    g = parse_graph(out)
    assert sum(n.op == Op.AGGREGATE for n in g) == 2 and not any(n.op == Op.GATHER for n in g)
    assert main(["opt", str(f), "--passes", "nope"]) == 2
    assert main(["opt", str(tmp_path / "missing.ir")]) == 2


def test_training_needs_autodiff():
    with pytest.raises(GcompError, match="add_loss and autodiff"):
        compile_model(gcn(), train=True, ctx=PassContext(disabled=frozenset({"autodiff"})))


def test_inference_needs_eval_mode():
    """Without it dropout would draw a random mask at inference (it did, silently)."""
    m = models.build("gcn", 4, hidden=8, out_channels=3, dropout=0.5)
    with pytest.raises(GcompError, match="needs the eval_mode pass"):
        compile_model(m, ctx=PassContext(disabled={"eval_mode"}))
    compile_model(models.build("gcn", 4, hidden=8, out_channels=3),  # no dropout: no harm
                  ctx=PassContext(disabled={"eval_mode"}))


def test_a_pass_may_run_twice(tmp_path, capsys):
    f = tmp_path / "g.ir"
    f.write_text(print_graph(gcn().graph))
    assert main(["opt", str(f), "--passes", "canonicalize,fuse_aggregate,canonicalize",
                 "--timing"]) == 0
    out, err = capsys.readouterr()
    assert any(n.op == Op.AGGREGATE for n in parse_graph(out))
    assert err.count("canonicalize") == 2


def test_instruments_and_names_given_as_python_values():
    """One instrument, a comma-separated string of pass names: taken as the CLI takes
    them (a string was read letter by letter, one instrument was not iterable); unknown
    names are refused, not matched against nothing."""
    timing = PassTiming()
    ctx = PassContext(instruments=timing, disabled="cse,dce")
    assert ctx.disabled == {"cse", "dce"} and ctx.instruments == (timing,)
    out = io.StringIO()
    default_pipeline()(gcn().graph.copy(), PassContext(instruments=[PrintAfter("cse", out)]))
    assert out.getvalue().count("IR after") == 1 and "IR after cse" in out.getvalue()
    with pytest.raises(GcompError, match="unknown pass\\(es\\) fuse_agregate"):
        PrintAfter({"fuse_agregate"})
    with pytest.raises(GcompError, match="unknown pass\\(es\\) nope"):
        PrintAfterChange(always={"nope"})
    with pytest.raises(GcompError, match="instruments must be Instrument objects"):
        PassContext(instruments=[print])


def test_timing_and_print_after_all_report_annotation_changes():
    """hoist_graph_static only annotates; it reports the change as --print-after-change
    sees it (--timing said 'no' and --print-after-all '(unchanged)')."""
    timing, out = PassTiming(), io.StringIO()
    default_pipeline()(gcn().graph.copy(),
                       PassContext(instruments=[timing, PrintAfter("hoist_graph_static", out)]))
    assert dict((n, c) for n, _, c in timing.times)["hoist_graph_static"]
    assert "IR after hoist_graph_static -----" in out.getvalue()


def test_debug_outputs_never_write_over_files(tmp_path, monkeypatch, capsys):
    """A dump directory holding dumps is refused (gcomp opt of a dumped file, dumping
    into its directory, wrote over it and mixed two runs); a reproducer written where one
    exists (replaying it) takes a new name."""
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "gcn", "--in", "8", "-o", "m.gcomp", "--dump-ir", "ir"]) == 0
    before = (tmp_path / "ir" / "03_cse.ir").read_text()
    assert main(["opt", "ir/03_cse.ir", "--passes", "fuse_aggregate,dce",
                 "--dump-ir", "ir"]) == 2
    assert "already holds dumps" in capsys.readouterr().err
    assert (tmp_path / "ir" / "03_cse.ir").read_text() == before
    (tmp_path / "repro").mkdir()
    given = tmp_path / "repro" / "repro_autodiff.ir"
    given.write_text(before)
    assert main(["opt", str(given), "--passes", "autodiff", "--reproducer", "repro"]) == 2
    assert given.read_text() == before
    assert (tmp_path / "repro" / "repro_autodiff_2.ir").read_text().startswith(
        "# gcomp reproducer: gcomp opt repro/repro_autodiff_2.ir --passes autodiff")


def test_dump_ir_of_a_training_compile_holds_each_pipeline_input(tmp_path):
    """--train runs the inference pipeline and then the training one from the model
    again: its input is dumped too, so each dump still replays to the next."""
    from gcomp.passes import training_pipeline
    compile_model(gcn(), train=True, ctx=PassContext(instruments=[DumpIR(tmp_path)]))
    files = sorted(tmp_path.glob("*.ir"))
    k = len(default_pipeline().pipeline) + 1
    assert [f.name for f in files].count(f"{k:02d}_input.ir") == 1
    assert len(files) == k + 1 + len(training_pipeline().pipeline)
    assert files[k].read_text() == files[0].read_text()  # the model, both times
    after = files[k + 1]
    replayed = replay(files[k], passes=after.stem.split("_", 1)[1])
    assert print_graph(replayed, show_meta=True) == after.read_text()


def test_unknown_disabled_pass():
    with pytest.raises(GcompError, match="unknown pass"):
        PassManager([FuseAggregate()])(gcn().graph.copy(),
                                       PassContext(disabled=frozenset({"nope"})))
    assert PassError


def test_explain_reports_decisions_with_numbers(capsys):
    import json
    assert main(["explain", "sage", "--in", "1433", "--hidden", "16", "--out", "7", "--graph",
                 "cora", "--json", "--train"]) == 0
    r = json.loads(capsys.readouterr().out)
    # training: SAGE's first mean aggregation is of the features, fed once: it stays at
    # 1433 features and runs once per feed, not in every step
    assert any(x["width_before"] == x["width_after"] == 1433 and x["hoisted"]
               for x in r["reorder"])
    assert any(p.startswith("aggregate") for p in r["per_feed"])
    assert main(["explain", "sage", "--in", "1433", "--hidden", "16", "--out", "7", "--graph",
                 "cora", "--json"]) == 0
    inference = json.loads(capsys.readouterr().out)
    # inference: it moves from 1433 to 16 features
    assert any(x["width_before"] == 1433 and x["width_after"] == 16 and
               x["edge_work_after"] == 10556 * 16 for x in inference["reorder"])
    assert r["fusion"] and all(f["bytes_saved_per_row"] > 0 for f in r["fusion"])
    sf = r["sparse_features"][0]
    assert sf["graph_sparsity"] > 0.98 and sf["chosen"] in ("sparse", "dense")
    assert (sf["chosen"] == "sparse") == (sf["graph_sparsity"] >= sf["threshold"])
    assert len(sf["calibration"]) >= 5 and r["graph"]["nodes"] == 2708
    assert main(["explain", "gcn", "--in", "1433", "--out", "7"]) == 0
    assert "computed once per bound graph (hoisted): self_loops" in capsys.readouterr().out


def test_explain_of_a_graph_without_features(capsys, tmp_path):
    """A graph file with edges and a node count but no features (given when it runs)."""
    import numpy as np
    g = tmp_path / "nox.npz"
    np.savez(g, edge_index=np.random.default_rng(0).integers(0, 50, (2, 200)), num_nodes=50)
    assert main(["explain", "gcn", "--in", "8", "--out", "3", "--graph", str(g)]) == 0
    assert "this graph has no features" in capsys.readouterr().out


def test_explain_refuses_a_graph_the_model_cannot_take(capsys, tmp_path):
    """As compile --graph does (explain described formats for a graph that cannot run)."""
    import numpy as np
    g = tmp_path / "six.npz"
    rng = np.random.default_rng(0)
    np.savez(g, edge_index=rng.integers(0, 50, (2, 200)), x=rng.random((50, 6)))
    assert main(["explain", "gcn", "--in", "8", "--out", "3", "--graph", str(g)]) == 2
    assert "graph 'six' has 6 features per node; the model's input 'x' takes 8" in \
        capsys.readouterr().err


def test_explain_says_how_out_edges_are_aggregated(capsys):
    """A 3-layer GCN's training step aggregates over out-edges three times (each layer's
    backward): gathers over the CSC arrays, or on CUDA with memory preferred scatters with
    atomics, and then the graph needs no CSC (unless ``--deterministic``)."""
    import json
    base = ["explain", "gcn", "--in", "8", "--out", "3", "--layers", "3", "--train", "--json"]
    for flags, how in (([], "gather"), (["-t", "cuda", "--prefer", "memory"], "scatter"),
                       (["-t", "cuda", "--prefer", "memory", "--deterministic"], "gather")):
        assert main(base + flags) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["out_edges"]["training"] == {"gather": 0, "scatter": 0, how: 3}, flags
        assert r["csc"] == (how == "gather")
        assert "inference" not in r["out_edges"]
    assert main(base[:-1] + ["-t", "cuda", "--prefer", "memory"]) == 0
    assert "3 scatters over the forward CSR with atomic adds" in capsys.readouterr().out


def test_explain_names_the_fused_attention_backward(capsys):
    import json
    assert main(["explain", "gat", "--layers", "2", "--train", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ops = [b.split()[0] for b in r["attention_backward"]]
    assert sorted(ops) == ["attention_grad_dst"] * 2 + ["attention_grad_src"] * 2
    assert main(["explain", "gat", "--layers", "2", "--json"]) == 0  # inference: none
    assert "attention_backward" not in json.loads(capsys.readouterr().out)
