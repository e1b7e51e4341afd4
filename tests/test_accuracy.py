"""Accuracy parity on the public Planetoid split (mean of 5 seeds, 200 epochs, Adam).

The protocol lives in ``bench/accuracy.py`` (which writes the README's table).

Protocol of the GCN and GAT papers and PyG's examples: row-normalized features, and
the test accuracy at the epoch of best validation accuracy.
"""

import numpy as np
import pytest

from bench.accuracy import CASES, run


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_planetoid_accuracy(case):
    model, dataset, kw, opt, published, required = CASES[case]
    results = [run(model, dataset, kw, opt, seed) for seed in range(5)]
    best_val_mean = float(np.mean([r[0] for r in results]))
    assert best_val_mean >= required, (case, results, best_val_mean, published)
