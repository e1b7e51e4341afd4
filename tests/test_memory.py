"""Memory planning: buffers share storage only when their lifetimes never overlap; and
what a bound graph holds on to after binding."""

import sys

import numpy as np
import pytest

import gcomp.models as models
from gcomp.codegen.lower import lower
from gcomp.codegen.optimizer import OptimizerConfig, add_optimizer
from gcomp.passes import training_pipeline
from gcomp.runtime.memory import nbytes, plan_memory


def _training_plan(name: str, features: int, optimizer: bool = False, ctx=None, **kw):
    """(plan, sizes) of a bundled model's training plan, at 1,000 nodes and 5,000 edges."""
    kw.setdefault("out_channels", 4)
    g = training_pipeline()(models.build(name, features, **kw).graph.copy(), ctx)
    plan, specs = lower(g)
    plan.loss, plan.grads = g.outputs[0].name, dict(g.meta["grads"])
    if optimizer:
        add_optimizer(plan, specs, OptimizerConfig())
    return plan, {"N": 1000, **{f"E:{gr['name']}": 5000 for gr in plan.graphs}, "NNZ:x": 3000}


def _root(plan, name):
    return plan.buffers[name].get("alias", name)


def _lifetimes(plan):
    life = {}
    for k, s in enumerate(plan.steps):
        for a in s["args"]:
            if "buf" in a:
                r = plan.buffers[a["buf"]].get("alias", a["buf"])
                lo, hi = life.get(r, (k, k))
                life[r] = (min(lo, k), max(hi, k))
    return life


def test_no_two_live_buffers_share_a_slot():
    for name in ("gcn", "gat", "gin", "sage", "ggnn"):
        plan, sizes = _training_plan(name, 16, optimizer=True, layers=3, dropout=0.5,
                                     hidden=16 if name == "ggnn" else 8)
        mem = plan_memory(plan, sizes)
        life = _lifetimes(plan)
        fed = {i["name"] for i in plan.inputs if i["role"] == "node"} - set(life)
        life.update({f: (-1, -1) for f in fed})  # read by feed steps only: before step 0
        by_storage = {}
        for buf, slot in mem.slots.items():
            storage, offset = mem.slot_at[slot]
            assert offset + nbytes(plan, buf, sizes) <= mem.storage_bytes[storage]
            by_storage.setdefault(storage, []).append((buf, offset))
        in_place = set()  # (input, output): the output may take the input's storage
        for k, s in enumerate(plan.steps):
            for i in s.get("in_place", ()):
                in_place.add((_root(plan, s["args"][i]["buf"]), _root(plan, s["args"][-1]["buf"])))
        for bufs in by_storage.values():  # byte ranges of live buffers never overlap...
            for i, (a, oa) in enumerate(bufs):
                for b, ob in bufs[i + 1:]:
                    (a0, a1), (b0, b1) = life[a], life[b]
                    apart = (oa + nbytes(plan, a, sizes) <= ob or
                             ob + nbytes(plan, b, sizes) <= oa)
                    # ...but where a step writes its output over an input read there last
                    handed = ((a, b) in in_place and a1 == b0 and oa == ob or
                              (b, a) in in_place and b1 == a0 and oa == ob)
                    assert apart or a1 < b0 or b1 < a0 or handed, (name, a, b, life[a], life[b])
        pinned = set(mem.pinned)
        # read after the step (a gradient that is a view, a bias's row of its weight
        # gradient's product reshaped, through the buffer it views)
        assert {_root(plan, g) for g in plan.grads.values()} <= pinned | set(plan.params)
        assert mem.planned_bytes < mem.unplanned_bytes  # reuse happened
        # close to the lower bound: the buffers live at the busiest step (4 KiB alignment
        # of each buffer is most of the gap at these sizes)
        peak = max(sum(nbytes(plan, b, sizes) for b in mem.slots if life[b][0] <= k <= life[b][1])
                   for k in range(-1, len(plan.steps)))
        assert mem.live_peak_bytes <= peak  # less where outputs take over inputs in place
        assert mem.planned_bytes <= 1.1 * peak, (name, mem.planned_bytes, peak)
        whole = plan_memory(plan, sizes, carve=False)  # no views at an offset (GPU)
        assert all(off == 0 for _, off in whole.slot_at)
        assert whole.planned_bytes >= peak


@pytest.mark.parametrize("name,fewer", [("sage", 1), ("gin", 2)])
def test_memory_preferred_keeps_no_hidden_aggregation_through_the_step(name, fewer):
    """``prefer="memory"``: the hidden layers' aggregations that a weight gradient reads
    (GraphSAGE's mean, GIN's sum with (1 + eps) h) are computed again in the backward
    pass instead of living from the forward pass to it.  At the arxiv benchmark's widths
    (hidden 32, 40 classes) the busiest step then holds at least ``fewer`` [N, 32]
    buffers less than the same plan without ``rematerialize``."""
    from gcomp.passes import PassContext
    memory = {"prefer": "memory"}
    shape = dict(hidden=32, layers=3, out_channels=40)
    kept, sizes = _training_plan(name, 16, ctx=PassContext(
        options=memory, disabled={"rematerialize"}), **shape)
    again, _ = _training_plan(name, 16, ctx=PassContext(options=memory), **shape)
    hidden = sizes["N"] * 32 * 4
    saved = plan_memory(kept, sizes).live_peak_bytes - plan_memory(again, sizes).live_peak_bytes
    assert saved >= fewer * hidden, (saved, hidden)


def test_info_reports_planned_memory(tmp_path, capsys):
    import json

    from gcomp.cli import main
    art = tmp_path / "g.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "-o", str(art)]) == 0
    assert main(["info", str(art), "--graph", "cora", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    for label in ("inference", "training"):
        m = mem[label]
        assert m["graph"] == "cora" and m["total_bytes"] == m["pinned_bytes"] + m["planned_bytes"]
        assert m["total_bytes"] >= 2708 * 1433 * 4  # the features at least
        # the graph arrays the kernels read, as numpy holds them for Cora's 10,556 edges
        # plus a self loop per node: CSR, and for the training step's backward the CSC too
        e = 10556 + 2708
        arrays = m["graph_arrays"]
        assert arrays["convs.0.graph.indices"] == 4 * e
        assert arrays["convs.0.graph.indptr"] == 8 * 2709
        assert ("convs.0.graph.csc_indices" in arrays) == (label == "training")
        assert m["graph_arrays_bytes"] == sum(arrays.values())


def test_info_counts_no_transposed_graph_for_atomic_scatters(tmp_path, capsys):
    """CUDA with ``--prefer memory``: the backward aggregations scatter over the forward
    CSR, so the training plan holds no CSC arrays (``--deterministic`` keeps them), and
    ``gcomp info`` says the results are not bit for bit reproducible."""
    import json

    from gcomp.cli import main
    art = tmp_path / "g.gcomp"
    arrays = {}
    for flags in ([], ["--deterministic"]):
        assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "-t", "cuda",
                     "--prefer", "memory", "-o", str(art), *flags]) == 0
        assert main(["info", str(art), "--graph", "cora"]) == 0
        text = capsys.readouterr().out
        assert ("not bit for bit reproducible" in text) == (not flags)
        assert main(["info", str(art), "--graph", "cora", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["deterministic"] == bool(flags)
        arrays[bool(flags)] = info["memory"]["training"]["graph_arrays"]
    assert not any(".csc_" in k for k in arrays[False])
    assert arrays[True]["convs.0.graph.csc_indices"] == 4 * (10556 + 2708)


def test_info_counts_hub_partials_of_cuda_aggregations(tmp_path, capsys):
    """The largest hub-task scratch of a CUDA plan's aggregations: Cora's rows longer than
    128 edges cut into tasks, times the widest aggregation's width (float32).  Trained
    for speed, GCN aggregates the 1,433 input features once per feed; with memory
    preferred the widest aggregation is the hidden 16 (the backward's scatters have
    no partials)."""
    import json

    from gcomp.cli import main
    art = tmp_path / "g.gcomp"
    for prefer, width in (("speed", 1433), ("memory", 16)):
        assert main(["compile", "gcn", "--in", "1433", "--hidden", "16", "--out", "7", "--train",
                     "-t", "cuda", "--prefer", prefer, "-o", str(art)]) == 0
        assert main(["info", str(art), "--graph", "cora", "--json"]) == 0
        mem = json.loads(capsys.readouterr().out)["memory"]["training"]
        tasks = mem["graph_arrays"]["convs.0.graph.hub_tasks"] // (3 * 8)
        assert tasks >= 2  # Cora's largest rows (169 edges with the self loop) are split
        assert mem["hub_partials_bytes"] == tasks * width * 4


def test_features_only_the_feed_reads_share_storage_with_the_run():
    """GCN training: the features feed ``A X`` (once per feed) and no run step reads
    them, so the run's intermediates reuse their storage, cut into several slots; results
    stay those of the interpreter (test_training)."""
    plan, sizes = _training_plan("gcn", 64, hidden=8, layers=2)
    mem = plan_memory(plan, sizes)
    assert "x" not in mem.pinned and "x" in mem.slots
    x_storage, x_at = mem.slot_at[mem.slots["x"]]
    x_end = x_at + nbytes(plan, "x", sizes)
    sharing = [b for b, s in mem.slots.items() if b != "x" and mem.slot_at[s][0] == x_storage
               and mem.slot_at[s][1] < x_end and x_at < mem.slot_at[s][1] + nbytes(plan, b, sizes)]
    assert len(sharing) >= 2  # 64 features wide: several 8-wide buffers fit in its place
    whole = plan_memory(plan, sizes, carve=False)  # no views at an offset (GPU)
    assert all(off == 0 for _, off in whole.slot_at)
    assert mem.planned_bytes + mem.pinned_bytes < whole.planned_bytes + whole.pinned_bytes


def test_elementwise_outputs_take_over_inputs_read_last():
    """GCN training: the loss gradient is written over the logits (read there for the last
    time); relu's gradient over the incoming gradient, but not over relu's output while a
    later step still reads it."""
    plan, sizes = _training_plan("gcn", 16, hidden=8, layers=2)
    mem = plan_memory(plan, sizes)
    life = _lifetimes(plan)
    ce = next(s for s in plan.steps if s["op"] == "cross_entropy_grad")
    logits, dlogits = ce["args"][1]["buf"], ce["args"][-1]["buf"]
    assert mem.slots[dlogits] == mem.slots[logits]
    merged = [(s["args"][i]["buf"], s["args"][-1]["buf"]) for s in plan.steps
              for i in s.get("in_place", ())
              if mem.slots.get(s["args"][i]["buf"]) == mem.slots.get(s["args"][-1]["buf"])]
    for a, b in merged:  # only inputs read for the last time there
        assert life[a][1] == life[b][0], (a, b)
    assert mem.live_peak_bytes < mem.unplanned_bytes


def test_an_input_read_later_keeps_its_storage():
    """b = f(a) may take a's storage only if no later step reads a; c = g(a, b), where both
    end, takes the first one offered."""
    from gcomp.runtime.plan import Plan

    def buf():
        return {"dims": ["N", 8], "dtype": "float32"}
    plan = Plan(inputs=[{"name": "x", "role": "node", "dims": ["N", 8]}],
                outputs=[{"name": "c", "buffer": "c", "role": "node"}],
                buffers={n: buf() for n in "xabc"},
                steps=[{"kernel": "k0", "args": [{"buf": "x"}, {"buf": "a"}]},
                       {"kernel": "k1", "args": [{"buf": "a"}, {"buf": "b"}], "in_place": [0]},
                       {"kernel": "k2", "args": [{"buf": "a"}, {"buf": "b"}, {"buf": "d"}],
                        "in_place": [0, 1]},
                       {"kernel": "k3", "args": [{"buf": "d"}, {"buf": "c"}]}])
    plan.buffers["d"] = buf()
    mem = plan_memory(plan, {"N": 1000})
    assert mem.slots["b"] != mem.slots["a"]  # a is read again by k2
    assert mem.slots["d"] == mem.slots["a"]  # both a and b end at k2: a, offered first
    assert mem.live_peak_bytes == 2 * 1000 * 8 * 4  # a and b at k1 and k2; d in a's place


def test_an_input_also_read_elsewhere_in_the_step_keeps_its_storage():
    """out = a @ w + a (a residual): a is offered in place as the epilogue's extra but is
    also the product's x, which a kernel working in column tiles reads again after storing
    the first tile, so out gets storage of its own."""
    from gcomp.runtime.plan import Plan

    def buf():
        return {"dims": ["N", 8], "dtype": "float32"}
    plan = Plan(inputs=[{"name": "x", "role": "node", "dims": ["N", 8]}],
                outputs=[{"name": "c", "buffer": "c", "role": "node"}],
                buffers={"x": buf(), "a": buf(), "out": buf(), "c": buf(),
                         "w": {"dims": [8, 8], "dtype": "float32"}}, params=["w"],
                steps=[{"kernel": "k0", "args": [{"buf": "x"}, {"buf": "a"}]},
                       {"kernel": "mm", "args": [{"buf": "a"}, {"buf": "w"}, {"buf": "a"},
                                                 {"buf": "out"}], "in_place": [2]},
                       {"kernel": "k2", "args": [{"buf": "out"}, {"buf": "c"}]}])
    mem = plan_memory(plan, {"N": 1000})
    assert mem.slots["out"] != mem.slots["a"]
    plan.steps[1]["args"][0] = {"buf": "x"}  # x @ w + a: now a may be overwritten
    mem = plan_memory(plan, {"N": 1000})
    assert mem.slots["out"] == mem.slots["a"]


def test_a_binding_keeps_none_of_the_graph_structures_it_built(monkeypatch):
    """The CSR/CSC structures, with what derived them (argsorts, self-loop origins, the
    edges into the loss rows), are freed when the bind returns, not at the garbage
    collector's next pass: the binding holds only the kernels' arrays, and no structure
    is in a reference cycle.  GCN's self loops, a training mask (loss rows), and GAT,
    whose attention kernels read the CSC."""
    import gc
    import weakref

    import gcomp.runtime.executor as executor
    from conftest import awkward_graph
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer

    built = []
    structures_of = executor.structures_of

    def recorded(*args):
        st = structures_of(*args)
        built.extend(weakref.ref(s) for s in st.values())
        return st
    monkeypatch.setattr(executor, "structures_of", recorded)
    for name in ("gcn", "gat"):
        g = awkward_graph(num_nodes=90, num_edges=500, num_features=6, seed=7)
        rng = np.random.default_rng(1)
        g.y = rng.integers(0, 3, g.num_nodes)
        g.train_mask = rng.random(g.num_nodes) < 0.3
        g.val_mask = g.test_mask = ~g.train_mask
        art = compile_model(models.build(name, 6, hidden=8, out_channels=3, layers=2, heads=2,
                                         seed=3), train=True)
        built.clear()
        gc.disable()
        try:
            tr = Trainer(art, g, formats="csr")
            assert tr._binding.dims["L"] < g.num_nodes  # the loss rows' structures too
            assert built and all(r() is None for r in built), name
        finally:
            gc.enable()


HEAP_SCRIPT = """
import numpy as np
from gcomp.runtime.host_heap import release_free_heap

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS:"))
if not release_free_heap():
    raise SystemExit(3)
big = np.ones(20 << 20, np.uint8)
del big  # raises glibc's mmap threshold to 20 MB: 8 MB arrays come from the heap
freed, kept = [], []
for _ in range(12):
    freed.append(np.ones(8 << 20, np.uint8))
    kept.append(np.ones(1 << 16, np.uint8))
del freed
before = rss_mb()
release_free_heap()
print(before, rss_mb())
"""


def test_free_heap_pages_go_back_to_the_system():
    """Arrays freed between live ones leave pages the process holds (glibc's heap, once a
    larger free has raised its mmap threshold); ``release_free_heap`` returns them.  In a
    fresh process: a long-lived one's heap has holes that would take the live arrays."""
    import subprocess
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim on Linux")
    p = subprocess.run([sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True)
    if p.returncode == 3:
        pytest.skip("this C library has no malloc_trim")
    assert p.returncode == 0, p.stderr
    before, after = map(float, p.stdout.split())
    assert before - after >= 64, (before, after)  # of the 96 MB freed
