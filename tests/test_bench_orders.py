"""bench.orders on Cora: each binding takes the order it was asked for, the SpMM is checked
against scipy inside the run, and the report has a row per case."""

import json

from bench import orders


def test_orders_run_on_cora(tmp_path):
    res = orders.main(["--graph", "cora", "--models", "gcn", "--widths", "8", "--reps", "1",
                       "--warmup", "0", "--threads", "1", "--out", str(tmp_path)])
    assert [e["case"] for e in res["results"]] == ["SpMM F=8", "gcn training step"]
    assert any("agg" in k for k in res["results"][0]["kernels"])  # the timed calls aggregate
    for e in res["results"]:
        assert e["chosen"] == {"none": "given", "degree": "degree", "rcm": "rcm"}
        assert all(v > 0 for v in e["median_ms"].values())
    assert json.loads((tmp_path / "orders.json").read_text())["graph"] == "cora"
    md = (tmp_path / "orders-latest.md").read_text()
    assert "| SpMM F=8 |" in md and "| gcn training step |" in md
