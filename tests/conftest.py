"""Shared fixtures: small random graphs with the awkward cases every test should see."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/pyg_ref.py

from gcomp.ir.interpreter import RefGraph  # noqa: E402
from gcomp.ir.types import GraphType  # noqa: E402
from gcomp.runtime.data import GraphData  # noqa: E402
from gcomp.runtime.synthetic import power_law_edges  # noqa: E402


def awkward_graph(num_nodes: int = 60, num_edges: int = 300, num_features: int = 8,
                  seed: int = 0, edge_weight: bool = False) -> GraphData:
    """Power-law graph with isolated nodes, self loops (some repeated) and duplicate edges."""
    rng = np.random.default_rng(seed)
    active = num_nodes - max(2, num_nodes // 10)  # the last nodes stay isolated
    ei = power_law_edges(active, num_edges, rng)
    loops = rng.integers(0, active, max(2, num_edges // 20))
    loops = np.concatenate([loops, loops[:2]])  # a node with two self loops
    dup = ei[:, rng.integers(0, num_edges, max(2, num_edges // 20))]
    ei = np.concatenate([ei, np.stack([loops, loops]), dup], axis=1)
    ei = ei[:, rng.permutation(ei.shape[1])]
    x = rng.standard_normal((num_nodes, num_features)).astype(np.float32)
    w = rng.uniform(0.1, 2.0, ei.shape[1]).astype(np.float32) if edge_weight else None
    y = rng.integers(0, 3, num_nodes)
    return GraphData("awkward", num_nodes, ei, x, w, y)


def ref_inputs(model_graph, g: GraphData, x=None) -> dict:
    """Interpreter inputs for a model with inputs x, edge_index[, edge_weight]."""
    inputs = {}
    for n in model_graph.inputs:
        if isinstance(n.ty, GraphType):
            inputs[n.name] = RefGraph.from_edge_index(g.edge_index, g.num_nodes)
        elif n.ty.is_node:
            inputs[n.name] = g.dense_x() if x is None else x
        else:
            inputs[n.name] = g.edge_weight
    return inputs


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as TVM's stores round)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> their float64 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def assert_bf16_step_close(trainers: dict) -> None:
    """One training step of ``trainers["bf16"]`` and ``trainers["fp32"]`` (same model,
    weights and graph): the losses within 2%, each weight gradient within 5% of float32's
    largest value (bfloat16 rounding)."""
    loss = {p: t.step() for p, t in trainers.items()}
    assert abs(loss["bf16"] - loss["fp32"]) < 2e-2 * abs(loss["fp32"])
    g32, g16 = trainers["fp32"].gradients(), trainers["bf16"].gradients()
    for k in g32:
        err = np.abs(g16[k] - g32[k]).max() / (np.abs(g32[k]).max() + 1e-12)
        assert err < 5e-2, (k, err)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
    """Compile into a per-session cache, so tests never depend on a user's cache."""
    os.environ["GCOMP_CACHE_DIR"] = str(tmp_path_factory.mktemp("gcomp-cache"))
