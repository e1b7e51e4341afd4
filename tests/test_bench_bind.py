"""python -m bench.bind: graph preparation timed for gcomp and PyG, each in its own process."""

import json

import numpy as np

from bench import bind
from gcomp.runtime.data import load_graph


def test_random_graphs_are_seeded_and_sized_by_name():
    a, b = bind._graph("random-0.01m"), bind._graph("random-0.01m")
    assert (a.num_nodes, a.num_edges, a.x.shape) == (200_000, 10_000, (200_000, 128))
    np.testing.assert_array_equal(a.edge_index, b.edge_index)
    assert int(a.edge_index.max()) < a.num_nodes


def test_bind_benchmark_records_both_systems(tmp_path):
    res = bind.main(["--graphs", "cora", "--reps", "1", "--out", str(tmp_path)])
    (row,) = res["graphs"]
    cora = load_graph("cora")
    for system in ("gcomp", "pyg-csr"):
        r = row[system]
        assert "error" not in r, r
        assert (r["nodes"], r["edges"]) == (cora.num_nodes, cora.num_edges)
        assert r["first_s"] > 0 and len(r["times_s"]) == 1 and r["peak_above_mb"] >= 0
    (saved,) = tmp_path.glob("bind-*.json")
    assert json.loads(saved.read_text())["graphs"][0]["graph"] == "cora"
    assert "| cora | 2,708 |" in (tmp_path / "bind-latest.md").read_text()
