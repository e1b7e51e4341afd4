"""What every system under test provides, and the table of configurations.

A ``Runner`` is one configuration, set up for one workload and mode:

``step()``     one timed unit of work: a forward pass (inference) or one epoch (training)
``output()``   the eval-mode forward output as numpy, for the equivalence check
``parts``      optional breakdown of step() (e.g. gcomp feed / execute), appended per call
``setup_s``    one-time costs in seconds, reported apart from the step time (gcomp compile
               and bind, torch.compile's first call, DGL graph construction, ...)

Factories import their libraries lazily, so a memory-measuring child process only loads
what its one configuration needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

MODES = ("inference", "training")

# configuration -> peer (the "best" of a peer is picked among its configurations)
CONFIGS = {
    "gcomp": "gcomp",
    "pyg": "pyg",            # PyG, edge_index input
    "pyg-csr": "pyg",        # PyG, sparse CSR adj_t input
    "pyg-compile": "pyg",    # PyG, torch.compile of the edge_index model
    "dgl": "dgl",            # DGL, full graph
}
PEER_CONFIGS = [c for c in CONFIGS if c != "gcomp"]


class Skip(Exception):
    """A configuration that cannot run here; the reason goes into the results."""


@dataclass
class Runner:
    config: str
    step: Callable[[], object]
    output: Callable[[], np.ndarray]
    setup_s: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)  # name -> per-call seconds that step() appends
    artifact: object = None  # gcomp: the compiled artifact (the memory child runs it saved)

    @property
    def peer(self) -> str:
        return CONFIGS[self.config]


def make_runner(config: str, workload, mode: str, precision: str = "fp32",
                prefer: str = "speed") -> Runner:
    """Build ``config`` for ``workload``; raises Skip when it cannot run in ``mode``.
    ``precision``: gcomp's activations (the peers run float32); ``prefer``: the compiler's
    ``--prefer`` for gcomp."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if config == "gcomp":
        from bench import gcomp_runner
        return gcomp_runner.make(workload, mode, precision=precision, prefer=prefer)
    if config in ("pyg", "pyg-csr", "pyg-compile"):
        from bench import peers_pyg
        return peers_pyg.make(config, workload, mode)
    if config == "dgl":
        from bench import peers_dgl
        return peers_dgl.make(workload, mode)
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (the measure the test suite uses)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if a.shape != ref.shape:
        return float("inf")
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-12))
