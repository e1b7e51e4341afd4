"""python -m bench's options reach the systems it builds."""

from bench import workload as W
from bench.cli import parse_args
from bench.gcomp_runner import make
from bench.runner import rel_diff


def test_prefer_memory_compiles_gcomp_with_it():
    """``--prefer memory``: gcomp's artifact is compiled with the compiler's
    ``--prefer memory`` (GIN's middle layer, which aggregates at the hidden width, computes
    its aggregation again in the backward pass) and trains the same function as the
    default build."""
    assert parse_args(["--prefer", "memory"]).prefer == "memory"
    assert parse_args([]).prefer == "speed"
    wl = W.make("gin", "cora", 3, 16, 1)
    speed, memory = make(wl, "training"), make(wl, "training", prefer="memory")
    again = [s for s in memory.artifact.train_plan.steps if ".again" in s["node"]]
    assert again and not [s for s in speed.artifact.train_plan.steps if ".again" in s["node"]]
    for r in (speed, memory):
        r.step()
    assert rel_diff(memory.output(), speed.output()) <= 1e-5
