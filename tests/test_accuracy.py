"""Accuracy parity on the public Planetoid split (mean of 5 seeds, 200 epochs, Adam).

Protocol of the GCN and GAT papers and PyG's examples: row-normalized features, and
the test accuracy at the epoch of best validation accuracy.
"""

import numpy as np
import pytest

import gcomp.models as models
from gcomp.codegen.optimizer import OptimizerConfig
from gcomp.compiler import compile_model
from gcomp.runtime.data import load_graph, normalize_features
from gcomp.runtime.trainer import Trainer

CASES = {
    # name: (model, dataset, build kwargs, optimizer, published, required mean)
    "gcn-cora": ("gcn", "cora", dict(hidden=16, dropout=0.5), (0.01, 5e-4), 0.815, 0.805),
    "gcn-citeseer": ("gcn", "citeseer", dict(hidden=16, dropout=0.5), (0.01, 5e-4), 0.703, 0.695),
    "gat-cora": ("gat", "cora", dict(hidden=8, heads=8, dropout=0.6), (0.005, 5e-4), 0.830, 0.820),
}


def run(model, dataset, kw, opt, seed, epochs=200):
    g = normalize_features(load_graph(dataset))
    m = models.build(model, g.num_features, out_channels=int(g.y.max()) + 1, layers=2, seed=seed,
                     **kw)
    tr = Trainer(compile_model(m, train=True, optimizer=OptimizerConfig(lr=opt[0],
                                                                        weight_decay=opt[1])),
                 g, seed=seed)
    best_val, test_at_best = -1.0, None
    for _ in range(epochs):
        tr.step()
        ev = tr.evaluate()
        if ev["val_acc"] > best_val:
            best_val, test_at_best = ev["val_acc"], ev["test_acc"]
    return test_at_best, ev["test_acc"]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_planetoid_accuracy(case):
    model, dataset, kw, opt, published, required = CASES[case]
    results = [run(model, dataset, kw, opt, seed) for seed in range(5)]
    best_val_mean = float(np.mean([r[0] for r in results]))
    assert best_val_mean >= required, (case, results, best_val_mean, published)
