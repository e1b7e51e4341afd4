"""bench.compute_floor counts a training step's dense products from the bound plan."""

import gcomp.models as models
from bench.compute_floor import product_flops
from gcomp.codegen.lower import lower
from gcomp.passes import training_pipeline


def test_products_of_a_gcn_step():
    """3-layer GCN 16 -> 8 -> 8 -> 4 (A X precomputed, so its first layer is a 16 x 8
    product): forward x W per layer, dY W^T for layers 2 and 3 and x^T dY for every
    weight; 2 n K M operations each."""
    g = training_pipeline()(models.build("gcn", 16, hidden=8, out_channels=4,
                                         layers=3).graph.copy())
    plan, _ = lower(g)
    n = 1000
    run = [s for s in plan.steps if "when" not in s]  # dense features: no sparse variant
    total = sum(product_flops(plan, s, n) for s in run)
    km = 16 * 8 * 2 + 8 * 8 * 3 + 8 * 4 * 3
    assert total == 2 * n * km
    assert all(product_flops(plan, s, n) == 0 for s in run if s["op"] != "matmul")
