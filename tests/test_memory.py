"""Memory planning: buffers share storage only when their lifetimes never overlap."""

import gcomp.models as models
from gcomp.codegen.lower import lower
from gcomp.codegen.optimizer import OptimizerConfig, add_optimizer
from gcomp.passes import training_pipeline
from gcomp.runtime.memory import nbytes, plan_memory


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
        g = training_pipeline()(models.build(name, 16, hidden=16 if name == "ggnn" else 8,
                                              out_channels=4, layers=3,
                                              dropout=0.5).graph.copy())
        plan, specs = lower(g)
        plan.loss, plan.grads = g.outputs[0].name, dict(g.meta["grads"])
        add_optimizer(plan, specs, OptimizerConfig())
        sizes = {"N": 1000, **{f"E:{gr['name']}": 5000 for gr in plan.graphs}, "NNZ:x": 3000}
        mem = plan_memory(plan, sizes)
        life = _lifetimes(plan)
        fed = {i["name"] for i in plan.inputs if i["role"] == "node"} - set(life)
        life.update({f: (-1, -1) for f in fed})  # read by feed steps only: before step 0
        by_storage = {}
        for buf, slot in mem.slots.items():
            storage, offset = mem.slot_at[slot]
            assert offset + nbytes(plan, buf, sizes) <= mem.storage_bytes[storage]
            by_storage.setdefault(storage, []).append((buf, offset))
        for bufs in by_storage.values():  # byte ranges of live buffers never overlap
            for i, (a, oa) in enumerate(bufs):
                for b, ob in bufs[i + 1:]:
                    (a0, a1), (b0, b1) = life[a], life[b]
                    apart = (oa + nbytes(plan, a, sizes) <= ob or
                             ob + nbytes(plan, b, sizes) <= oa)
                    assert apart or a1 < b0 or b1 < a0, (name, a, b, life[a], life[b])
        pinned = set(mem.pinned)
        assert set(plan.grads.values()) <= pinned | set(plan.params)  # read after the step
        assert mem.planned_bytes < mem.unplanned_bytes  # reuse happened
        # close to the lower bound: the buffers live at the busiest step (4 KiB alignment
        # of each buffer is most of the gap at these sizes)
        peak = max(sum(nbytes(plan, b, sizes) for b in mem.slots if life[b][0] <= k <= life[b][1])
                   for k in range(-1, len(plan.steps)))
        assert peak == mem.live_peak_bytes
        assert mem.planned_bytes <= 1.1 * peak, (name, mem.planned_bytes, peak)
        whole = plan_memory(plan, sizes, carve=False)  # no views at an offset (GPU)
        assert all(off == 0 for _, off in whole.slot_at)
        assert whole.planned_bytes >= peak


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


def test_features_only_the_feed_reads_share_storage_with_the_run():
    """GCN training: the features feed ``A X`` (once per feed) and no run step reads
    them, so the run's intermediates reuse their storage, cut into several slots; results
    stay those of the interpreter (test_training)."""
    g = training_pipeline()(models.build("gcn", 64, hidden=8, out_channels=4,
                                         layers=2).graph.copy())
    plan, specs = lower(g)
    plan.loss, plan.grads = g.outputs[0].name, dict(g.meta["grads"])
    sizes = {"N": 1000, **{f"E:{gr['name']}": 5000 for gr in plan.graphs}, "NNZ:x": 3000}
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
