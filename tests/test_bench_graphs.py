"""bench.workload keeps the synthetic graphs it makes in ``GCOMP_BENCH_GRAPHS``, so the
benchmark's later processes read a Reddit-size graph instead of making it again: what
they read back is the graph made from the seed, array for array."""

import numpy as np

from bench import workload
from gcomp.runtime.synthetic import named


def test_synthetic_graphs_are_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("GCOMP_BENCH_GRAPHS", str(tmp_path))
    made = workload._graph("pubmed-synth")
    assert (tmp_path / "pubmed-synth.npz").exists()
    assert not list(tmp_path.glob("*.tmp.npz"))
    again = workload._graph("pubmed-synth")  # read from the file this time
    ref = named("pubmed-synth")
    for g in (made, again):
        assert g.name == "pubmed-synth" and g.num_nodes == ref.num_nodes
        for k in ("edge_index", "x", "y", "train_mask", "val_mask", "test_mask"):
            assert np.array_equal(getattr(g, k), getattr(ref, k)), k


def test_bundled_graphs_are_not_copied(tmp_path, monkeypatch):
    monkeypatch.setenv("GCOMP_BENCH_GRAPHS", str(tmp_path))
    assert workload._graph("cora").num_nodes == 2708
    assert not list(tmp_path.iterdir())
