"""Export the ONNX test corpus: PyG GCN, GraphSAGE (mean), GIN and GAT as users export them.

    python -m gcomp.models.export_onnx OUTDIR        (or: python models/export_onnx.py OUTDIR)

Needs torch, torch-geometric and onnxscript (the ``[export]`` extra).  For each layer type,
with 2 and 3 layers, it writes ``<model><layers>_opset<v>.onnx`` for opsets 16,
17 and 18 with ``torch.onnx.export(..., dynamo=False, dynamic_axes=...)``, and
``<model><layers>_dynamo.onnx`` (opset 20) with ``dynamo=True`` where torch can
export the model (torch 2.13 cannot export GATConv); GCN also as
``gcn2w_opset18`` / ``gcn2w_dynamo``, taking edge weights.  ``fixtures.npz``
holds the fixed graph (``x``, ``edge_index``: isolated nodes, self loops, one
repeated, duplicate edges; ``edge_weight``) and PyG's output for every file
(``out.<file stem>``).  The models are
small (16 input, 8 hidden, 4 output channels) so the files stay a few KB; the
committed copies in ``models/onnx/`` are the fixtures of ``tests/test_onnx.py``.

The architectures match the bundled models (``gcomp.models``): ReLU between
layers (ELU for GAT), GIN's MLP is Linear -> ReLU -> Linear with a trainable
eps, GAT's hidden layers concatenate 4 heads and its last layer averages 1.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

IN, HIDDEN, OUT, HEADS = 16, 8, 4, 4
OPSETS = (16, 17, 18)
KINDS = ("gcn", "sage", "gin", "gat")


def fixed_graph(num_nodes: int = 30, seed: int = 0):
    """Features, an edge index with isolated nodes, self loops (one repeated) and duplicates,
    and edge weights."""
    rng = np.random.default_rng(seed)
    active = num_nodes - 3  # nodes 27..29 have no edges
    src = rng.integers(0, active, 70)
    dst = rng.integers(0, active, 70)
    loops = np.array([0, 5, 5, 9])
    ei = np.concatenate([np.stack([src, dst]), np.stack([loops, loops]),
                         np.stack([src[:4], dst[:4]])], axis=1)
    ei = ei[:, rng.permutation(ei.shape[1])].astype(np.int64)
    x = rng.standard_normal((num_nodes, IN)).astype(np.float32)
    w = rng.uniform(0.2, 2.0, ei.shape[1]).astype(np.float32)
    return x, ei, w


def build(kind: str, layers: int, seed: int = 0):
    """The PyG model ``kind`` with ``layers`` layers (eval mode, deterministic weights)."""
    import torch
    from torch_geometric import nn as pnn

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sizes = [IN] + [HIDDEN] * (layers - 1) + [OUT]
            convs = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                last = i == layers - 1
                if kind == "gcn":
                    convs.append(pnn.GCNConv(a, b))
                elif kind == "sage":
                    convs.append(pnn.SAGEConv(a, b, aggr="mean"))
                elif kind == "gin":
                    mlp = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(),
                                              torch.nn.Linear(b, b))
                    convs.append(pnn.GINConv(mlp, train_eps=True))
                else:
                    cin = a if i == 0 else a * HEADS
                    convs.append(pnn.GATConv(cin, b, heads=1 if last else HEADS,
                                             concat=not last))
            self.convs = torch.nn.ModuleList(convs)

        def forward(self, x, edge_index, edge_weight=None):
            for i, conv in enumerate(self.convs):
                x = conv(x, edge_index) if edge_weight is None else conv(x, edge_index, edge_weight)
                if i < len(self.convs) - 1:
                    x = torch.nn.functional.elu(x) if kind == "gat" else x.relu()
            return x

    net = Net().eval()
    with torch.no_grad():  # non-trivial eps and biases, so the tests see them
        for name, p in net.named_parameters():
            if name.endswith("eps") or name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return net


def export(net, x, ei, path: Path, opset: int | None, w=None) -> None:
    """``opset``: a TorchScript export at that opset; None: ``dynamo=True`` (opset 20).
    ``w``: also pass edge weights (GCN)."""
    import torch

    args = (torch.from_numpy(x), torch.from_numpy(ei))
    names = dict(input_names=["x", "edge_index"], output_names=["out"])
    axes = {"x": {0: "num_nodes"}, "edge_index": {1: "num_edges"}, "out": {0: "num_nodes"}}
    shapes = {"x": {0: "num_nodes"}, "edge_index": {1: "num_edges"}}
    if w is not None:
        args += (torch.from_numpy(w),)
        names["input_names"].append("edge_weight")
        axes["edge_weight"] = shapes["edge_weight"] = {0: "num_edges"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if opset is not None:
            torch.onnx.export(net, args, str(path), opset_version=opset, dynamo=False,
                              dynamic_axes=axes, **names)
        else:
            from torch.export import Dim
            dims = {}
            shapes = {k: {a: dims.setdefault(d, Dim(d)) for a, d in v.items()}
                      for k, v in shapes.items()}
            torch.onnx.export(net, args, str(path), opset_version=20, dynamo=True,
                              dynamic_shapes=shapes, external_data=False, verbose=False, **names)


def strip_debug_info(path: Path) -> None:
    """Drop the exporters' stack traces and doc strings (most of a small file's bytes)."""
    import onnx

    m = onnx.load(str(path))

    def strip(g):
        g.doc_string = ""
        for seq in (g.input, g.output, g.value_info):
            for v in seq:
                v.doc_string = ""
                del v.metadata_props[:]
        for n in g.node:
            n.doc_string = ""
            del n.metadata_props[:]
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    strip(a.g)

    strip(m.graph)
    del m.graph.value_info[:]
    onnx.save(m, str(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?", default=str(Path(__file__).parent / "onnx"))
    ap.add_argument("--no-dynamo", action="store_true", help="skip the dynamo=True exports")
    args = ap.parse_args(argv)
    try:
        import torch
        import torch_geometric  # noqa: F401
    except ImportError as e:
        print(f"export_onnx needs torch and torch-geometric (pip install gcomp[export]): {e}",
              file=sys.stderr)
        return 2
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    x, ei, w = fixed_graph()
    arrays = {"x": x, "edge_index": ei, "edge_weight": w}
    jobs = [(kind, layers, False) for kind in KINDS for layers in (2, 3)] + [("gcn", 2, True)]
    for kind, layers, weighted in jobs:
        net = build(kind, layers)
        ew = w if weighted else None
        with torch.no_grad():
            ref = net(torch.from_numpy(x), torch.from_numpy(ei),
                      None if ew is None else torch.from_numpy(ew)).numpy()
        tag = f"{kind}{layers}{'w' if weighted else ''}"
        variants = [(f"{tag}_opset{v}", v) for v in ((18,) if weighted else OPSETS)]
        if not args.no_dynamo:
            variants.append((f"{tag}_dynamo", None))
        for stem, opset in variants:
            path = out / f"{stem}.onnx"
            try:
                export(net, x, ei, path, opset, ew)
            except Exception as e:  # torch's dynamo exporter fails on some layers
                print(f"{stem}: torch could not export it ({type(e).__name__}); skipped",
                      file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            strip_debug_info(path)
            arrays[f"out.{stem}"] = ref
            print(f"{path} ({path.stat().st_size} bytes)", file=sys.stderr)
    np.savez_compressed(out / "fixtures.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
