"""The ONNX corpus (``models/onnx``: PyG exports and the fixtures PyG computed on them),
for the tests that compile or run it.  Kept apart from ``test_onnx`` so a GPU host, whose
TVM is the runtime alone, can import it: nothing here loads TVM's compiler."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import gcomp.models as models
from gcomp.runtime.data import GraphData

CORPUS = Path(models.__file__).parent / "onnx"
FIX = np.load(CORPUS / "fixtures.npz")
STEMS = sorted(p.stem for p in CORPUS.glob("*.onnx"))


def parse_stem(stem: str):
    """``gcn2w_opset18`` -> ("gcn", 2, True): layer type, layers, takes edge weights."""
    kind, layers, w = re.match(r"([a-z]+)(\d+)(w?)_", stem).groups()
    return kind, int(layers), bool(w)


def fixed_graph(stem: str) -> GraphData:
    """The graph the fixtures were computed on, with edge weights where the export takes
    them."""
    w = FIX["edge_weight"] if parse_stem(stem)[2] else None
    return GraphData("fixed", FIX["x"].shape[0], FIX["edge_index"], FIX["x"], w)
