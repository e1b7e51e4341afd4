"""Accuracy parity on the public Planetoid split: the table in the README.

    python -m bench.accuracy            # writes bench/results/accuracy-<stamp>.json and -latest.md

Protocol of the GCN and GAT papers and PyG's examples: 2 layers, row-normalized features,
200 epochs of Adam, 5 seeds; reported per seed are the test accuracy at the epoch of best
validation accuracy and at the last epoch.  ``tests/test_accuracy.py`` asserts the same
protocol's means against the required figures.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

CASES = {
    # name: (model, dataset, build kwargs, (lr, weight decay), published, required mean)
    "gcn-cora": ("gcn", "cora", dict(hidden=16, dropout=0.5), (0.01, 5e-4), 0.815, 0.805),
    "gcn-citeseer": ("gcn", "citeseer", dict(hidden=16, dropout=0.5), (0.01, 5e-4), 0.703, 0.695),
    "gat-cora": ("gat", "cora", dict(hidden=8, heads=8, dropout=0.6), (0.005, 5e-4), 0.830, 0.820),
}


def run(model, dataset, kw, opt, seed, epochs=200) -> tuple[float, float]:
    """(test accuracy at the best validation epoch, test accuracy at the last epoch)."""
    import gcomp.models as models
    from gcomp.codegen.optimizer import OptimizerConfig
    from gcomp.compiler import compile_model
    from gcomp.runtime.data import load_graph, normalize_features
    from gcomp.runtime.trainer import Trainer
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


def main() -> int:
    from bench.env import machine, versions
    out = {"command": "python -m bench.accuracy", "machine": machine(), "versions": versions(),
           "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cases": {}}
    rows = ["| model, dataset | test acc. at best val. (mean ± std, 5 seeds) | at last epoch | "
            "published | required |", "|---|---|---|---|---|"]
    for case, (model, dataset, kw, opt, published, required) in CASES.items():
        t0 = time.time()
        res = [run(model, dataset, kw, opt, seed) for seed in range(5)]
        best, last = np.array([r[0] for r in res]), np.array([r[1] for r in res])
        out["cases"][case] = {"best_val_test": best.tolist(), "final_test": last.tolist(),
                              "published": published, "required": required,
                              "seconds": time.time() - t0}
        rows.append(f"| {case} | {best.mean():.1%} ± {best.std():.1%} | {last.mean():.1%} | "
                    f"{published:.1%} | {required:.1%} |")
        print(rows[-1], flush=True)
    res_dir = Path(__file__).resolve().parent / "results"
    res_dir.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (res_dir / f"accuracy-{stamp}.json").write_text(json.dumps(out, indent=1))
    (res_dir / "accuracy-latest.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
