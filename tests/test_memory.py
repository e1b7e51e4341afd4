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
    for name in ("gcn", "gat", "gin", "sage"):
        g = training_pipeline()(models.build(name, 16, hidden=8, out_channels=4, layers=3,
                                              dropout=0.5).graph.copy())
        plan, specs = lower(g)
        plan.loss, plan.grads = g.outputs[0].name, dict(g.meta["grads"])
        add_optimizer(plan, specs, OptimizerConfig())
        sizes = {"N": 1000, **{f"E:{gr['name']}": 5000 for gr in plan.graphs}, "NNZ:x": 3000}
        mem = plan_memory(plan, sizes)
        life = _lifetimes(plan)
        by_slot = {}
        for buf, slot in mem.slots.items():
            assert nbytes(plan, buf, sizes) <= mem.slot_bytes[slot]
            by_slot.setdefault(slot, []).append(buf)
        for bufs in by_slot.values():
            for i, a in enumerate(bufs):
                for b in bufs[i + 1:]:
                    (a0, a1), (b0, b1) = life[a], life[b]
                    assert a1 < b0 or b1 < a0, (name, a, b, life[a], life[b])
        pinned = set(mem.pinned)
        assert set(plan.grads.values()) <= pinned | set(plan.params)  # read after the step
        assert mem.planned_bytes < mem.unplanned_bytes  # reuse happened


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
        assert m["pinned_bytes"] >= 2708 * 1433 * 4  # the features at least
