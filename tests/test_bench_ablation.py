"""bench.ablation times each optional pass turned off, on the same function, and says which
passes change nothing for a model instead of timing them."""

from bench import workload as W
from bench.ablation import MEMORY_PASSES, OPTIONAL_PASSES, run_model
from gcomp.passes import PASSES, default_pipeline, training_pipeline


def test_every_optional_pass_is_a_pass_of_a_pipeline():
    in_pipelines = {p.name for p in default_pipeline().passes + training_pipeline().passes}
    assert set(OPTIONAL_PASSES) | set(MEMORY_PASSES) <= in_pipelines <= set(PASSES)
    # the rest are what every compile needs
    assert in_pipelines - set(OPTIONAL_PASSES) - set(MEMORY_PASSES) == {"eval_mode", "canonicalize", "dce",
                                                   "add_loss", "autodiff"}


def test_gcn_on_cora():
    entry = run_model(W.make("gcn", "cora", 2, 16, 1), reps=1, warmup=0, log=lambda s: None)
    # GAT's attention fusion and the GRU's split products have nothing to do in a GCN
    assert entry["-fuse_attention"] == {"status": "no change"}
    assert entry["-split_concat_products"] == {"status": "no change"}
    timed = {k: e for k, e in entry.items() if e["status"] == "ok"}
    assert {"all", "-fuse_aggregate", "-fuse_epilogues", "-sparse-features"} <= set(timed)
    for e in timed.values():
        assert e["max_rel_diff"] <= 1e-3 and e["median_s"] > 0 and e["slowdown"] > 0
    # without message fusion the per-edge messages are kernels of their own
    assert timed["-fuse_aggregate"]["kernel_calls"] > timed["all"]["kernel_calls"]
    assert timed["-fuse_epilogues"]["kernel_calls"] > timed["all"]["kernel_calls"]


def test_some_configurations_only_and_their_memory():
    """``--configs all,-loss-rows,prefer-memory --memory``: the baseline, every step on
    every row and the compiler's memory trade, each one the same function, each one's
    peak RSS measured in a process of its own; GraphSAGE's plan with ``--prefer memory``
    keeps no [N, 1433] mean of Cora's features."""
    from bench.memory import MemoryMeter
    meter = MemoryMeter(threads=2, mode="training", iters=1, timeout_s=600)
    entry = run_model(W.make("sage", "cora", 2, 16, 1), reps=1, warmup=0, log=lambda s: None,
                      only=["all", "-loss-rows", "prefer-memory"], memory=meter)
    assert set(entry) == {"all", "-loss-rows", "prefer-memory"}
    assert all(e["status"] == "ok" and e["max_rel_diff"] <= 1e-3 for e in entry.values())
    for e in entry.values():
        assert e["memory"]["status"] == "ok" and e["memory"]["extra_mb"] > 0, e["memory"]
    mean_mb = 2708 * 1433 * 4 / 2**20  # less the narrow buffers the trade adds
    assert entry["prefer-memory"]["planned_mb"] <= entry["all"]["planned_mb"] - 0.9 * mean_mb


def test_bfloat16_configurations():
    """``--precision bf16``: every configuration compiles with bfloat16 activations (and
    stays the same function as ``all``, within the bench's bfloat16 tolerance:
    ``prefer-memory`` rounds other values, reading the float32 features)."""
    entry = run_model(W.make("gcn", "cora", 2, 16, 1), reps=1, warmup=0, log=lambda s: None,
                      only=["all", "-loss-rows", "prefer-memory"], precision="bf16")
    fp32 = run_model(W.make("gcn", "cora", 2, 16, 1), reps=1, warmup=0, log=lambda s: None,
                     only=["all"])
    assert all(e["status"] == "ok" and e["bfloat16_buffers"] > 0 for e in entry.values())
    assert fp32["all"]["bfloat16_buffers"] == 0
