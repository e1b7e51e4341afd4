"""Training with a training artifact: steps, evaluation, checkpoints.

    trainer = Trainer(artifact, load_graph("cora"), seed=0)
    for epoch in range(200):
        loss = trainer.step()          # forward, loss, backward, optimizer: compiled kernels
    print(trainer.evaluate())          # {"loss":..., "train_acc":..., "val_acc":..., "test_acc":...}
    trainer.save("ckpt.npz")           # atomic: temporary file + rename

A step feeds two scalars (the step counter for the optimizer and the dropout
masks) and runs the training plan's kernels; the features, labels and masks
were copied in once when the graph was bound.  Evaluation runs the forward
(eval-mode) plan over the same parameter tensors.  Labels below 0 (unlabelled
nodes) never count, whatever the masks say.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from gcomp.errors import ArtifactError, InputError
from gcomp.files import write_atomic
from gcomp.runtime.data import GraphData, check_graph, check_seed
from gcomp.runtime.executor import Executor
from gcomp.runtime.synthetic import random_split

RNG_STEP = "rng_step"
OPT_STEP = "opt_step"
CHECKPOINT_FORMAT = "gcomp-checkpoint"


def masks_of(graph: GraphData, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The graph's train/val/test masks; without a train mask, the nodes in neither of the
    others (a random split would train on given validation and test nodes); without any
    mask, a seeded 60/20/20 split.  Unlabelled nodes are left out."""
    if graph.y is None:
        raise InputError(f"graph {graph.name!r} has no labels (y); training needs them")
    given = (graph.train_mask, graph.val_mask, graph.test_mask)
    if all(m is None for m in given):
        masks = random_split(graph.num_nodes, np.random.default_rng(seed))
    else:
        masks = [m if m is not None else np.zeros(graph.num_nodes, bool) for m in given]
        if graph.train_mask is None:
            masks[0] = ~(masks[1] | masks[2])
    labelled = graph.y >= 0
    masks = [m & labelled for m in masks]
    if not masks[0].any():
        raise InputError(f"graph {graph.name!r}: the training mask selects no labelled node")
    return masks[0], masks[1], masks[2]


def read_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(arrays, metadata) of a checkpoint written by ``Trainer.save``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes())
    except FileNotFoundError:
        raise InputError(f"checkpoint {str(path)!r} does not exist") from None
    except (ValueError, KeyError, OSError, EOFError, AttributeError, zipfile.BadZipFile) as e:
        raise InputError(f"{str(path)!r} is not a readable gcomp checkpoint (truncated or "
                         f"damaged?): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise InputError(f"{str(path)!r} is not a gcomp checkpoint")
    return arrays, meta


def check_checkpoint_path(path: str | Path) -> None:
    """An InputError where ``path`` holds a file that is not a gcomp checkpoint: a
    checkpoint replaces only an earlier one (a mistyped --checkpoint model.onnx or
    graph.npz would replace the user's file)."""
    p = Path(path)
    if not p.is_file():
        return
    try:
        with np.load(p, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
        ours = isinstance(meta, dict) and meta.get("format") == CHECKPOINT_FORMAT
    except Exception:  # noqa: BLE001 - anything unreadable as one is not a checkpoint
        ours = False
    if not ours:
        raise InputError(f"{str(p)!r} exists and is not a gcomp checkpoint; refusing to "
                         "replace it (remove it or name another file)")


def require_training(artifact) -> None:
    if artifact.train_plan is None:
        raise ArtifactError("this artifact was compiled for inference; compile it with "
                            "--train (compile_model(..., train=True)) to train")


class Trainer:
    def __init__(self, artifact, graph: GraphData, seed: int = 0,
                 variants: dict[str, bool] | None = None, reorder: str = "auto",
                 formats: str = "auto", loss_rows: bool = True):
        """``variants`` forces kernel variants on or off (``plan.variants``; default: chosen
        by the graph's statistics); ``reorder`` the node order (``runtime/reorder.py``);
        ``formats`` the adjacency format (``runtime/formats.py``); ``loss_rows``: number
        the training mask's nodes first, so that what only the loss reads is computed on
        those rows alone (``codegen/loss_rows.py``; False: every step on every row)."""
        require_training(artifact)
        graph = check_graph(graph)
        check_seed(seed)
        self.artifact = artifact
        self.graph = graph
        self.seed = int(seed)
        self.loss_rows = bool(loss_rows)
        lib = artifact.library()
        dev = artifact.device()  # the CPU, or the GPU of a cuda artifact (docs/cuda.md)
        self.store: dict = {}
        self.train_ex = Executor(artifact.train_plan, lib, artifact.params, self.store, dev)
        self.eval_ex = Executor(artifact.plan, lib, artifact.params, self.store, dev)
        for ex in (self.train_ex, self.eval_ex):
            ex.force_variants = dict(variants or {})
            ex.reorder, ex.formats = reorder, formats
        self._set_masks(graph, seed)
        self.step_count = 0
        self._bind_and_feed(graph, self.train_mask)

    def _set_masks(self, graph: GraphData, seed: int) -> None:
        """Train/val/test masks of ``graph``; its labels must fit the model's classes."""
        self.train_mask, self.val_mask, self.test_mask = masks_of(graph, seed)
        n_classes = self._num_classes()
        if int(graph.y.max()) >= n_classes:
            raise InputError(f"graph {graph.name!r} has labels up to {int(graph.y.max())}, but the "
                             f"model predicts {n_classes} classes")

    def _bind_and_feed(self, graph: GraphData, train_mask: np.ndarray) -> None:
        """Bind ``graph`` to the training executor; copy in features, labels and the mask."""
        x = graph.x if graph.x is not None else graph.dense_x()
        # its rows first: what the loss alone reads runs on them
        self.train_ex.loss_rows = train_mask if self.loss_rows else None
        self._binding = self.train_ex.bind(graph)
        self.bind_time_s = self._binding.bind_time_s
        feeds = {"labels": np.where(graph.y >= 0, graph.y, 0).astype(np.int32),
                 "train_mask": train_mask.astype(np.float32)}
        for inp in self.train_ex.node_inputs():
            if inp["name"] not in feeds:
                feeds[inp["name"]] = x
        self._binding = self.train_ex.feed(self._binding, feeds)
        self._x = x

    @property
    def node_order(self) -> str:
        """The node order the training graph was bound in (``runtime/reorder.py``)."""
        return self._binding.reorder["chosen"]

    def _num_classes(self) -> int:
        out = self.artifact.plan.outputs[0]
        return int(out["dims"][-1])

    # ------------------------------------------------------------------ training
    def step(self) -> float:
        """One training step; returns the loss before the update."""
        self.next_step()
        self.train_ex.execute(self._binding)
        return float(self._binding.buffers[self.artifact.train_plan.loss].numpy())

    def next_step(self) -> None:
        """Count a step and set the optimizer's and dropout's step inputs for it (``step``
        then runs its kernels; ``gcomp.debug.compare`` runs them one by one)."""
        self.step_count += 1
        self.train_ex.set(OPT_STEP, self.step_count)
        if RNG_STEP in self.store:
            # the seed offsets the dropout counter, so seeds give different masks
            self.train_ex.set(RNG_STEP, (self.step_count + self.seed * 1_000_003) % (1 << 31))

    def logits(self) -> np.ndarray:
        b = self.eval_ex.bind(self.graph)
        feeds = {i["name"]: self._x for i in self.eval_ex.node_inputs()}
        b = self.eval_ex.feed(b, feeds)
        self.eval_ex.execute(b)
        return self.eval_ex.outputs(b)[0]

    def evaluate(self) -> dict:
        """Eval-mode loss and accuracies on the train, validation and test masks."""
        z = self.logits().astype(np.float64)
        y = self.graph.y
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        tm = self.train_mask
        loss = float((lse[tm] - z[tm, y[tm]]).mean())
        pred = z.argmax(1)

        def acc(m):
            return float((pred[m] == y[m]).mean()) if m.any() else float("nan")
        return {"loss": loss, "train_acc": acc(self.train_mask), "val_acc": acc(self.val_mask),
                "test_acc": acc(self.test_mask)}

    def gradients(self) -> dict[str, np.ndarray]:
        """The gradients computed by the last step (before its update was applied)."""
        return {k: self._binding.buffers[g].numpy()
                for k, g in self.artifact.train_plan.grads.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter of the model, those training leaves as they are included (a
        parameter feeding only another output than the logits: ``gcomp info``'s
        ``untrained``)."""
        return {k: self.train_ex.get(k) for k in self.artifact.params}

    def set_parameters(self, params: dict[str, np.ndarray]) -> None:
        """Overwrite some of the model's parameters; each value must be finite and of the
        parameter's exact shape (a transposed [out, in] torch weight of the same size is
        refused, not reshaped).  Optimizer state is not a parameter."""
        names = list(self.artifact.params)
        checked = {}
        for k, v in params.items():
            if k not in names:
                raise InputError(f"{k!r} is not a parameter of the model; its parameters: "
                                 f"{', '.join(names)}")
            shape = tuple(self.train_ex.get(k).shape)
            try:
                a = np.asarray(v, dtype=np.float32)
            except (TypeError, ValueError) as e:
                raise InputError(f"parameter {k!r}: not an array of numbers ({e})") from None
            if a.shape != shape:
                raise InputError(f"parameter {k!r} has shape {list(shape)}, the value given "
                                 f"{list(a.shape)}")
            if not np.isfinite(a).all():
                raise InputError(f"parameter {k!r}: the value given holds NaN or Inf")
            checked[k] = a
        for k, a in checked.items():  # all or none
            self.train_ex.set(k, a)

    # ------------------------------------------------------------------ checkpoints
    def _fingerprint(self) -> str:
        """What a checkpoint's tensors belong to: the model (its inputs, outputs and ops),
        the names and shapes of its parameters and optimizer state, the optimizer and the
        precision.  Not the kernels or the plan: the same model compiled again elsewhere
        (another thread or rank count, another machine) measures other costs and may pick
        other kernels and formats, and its checkpoints must still resume."""
        m = self.artifact.manifest
        key = {"signature": m["signature"], "ops": m["ops"], "optimizer": m["optimizer"]["name"],
               "precision": m.get("precision", "fp32"),
               "params": {k: list(np.shape(v)) for k, v in self.artifact.params.items()},
               "state": {k: list(self.train_ex.get(k).shape)
                         for k in self.artifact.train_plan.state}}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write parameters, optimizer state and the step; atomic (``gcomp/files.py``).
        Replaces an earlier checkpoint, never another file (``check_checkpoint_path``)."""
        check_checkpoint_path(path)
        arrays = {f"param/{k}": v for k, v in self.parameters().items()}
        arrays.update({f"state/{k}": self.train_ex.get(k) for k in self.artifact.train_plan.state})
        meta = {"format": CHECKPOINT_FORMAT, "step": self.step_count, "seed": self.seed,
                "artifact": self._fingerprint()}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return write_atomic(path, lambda f: np.savez(f, **arrays))

    def load(self, path: str | Path, checkpoint: tuple[dict, dict] | None = None) -> None:
        """Resume from a checkpoint written by ``save`` for the same model
        (``_fingerprint``), with the same split: on a graph without masks, a trainer of the checkpoint's seed.
        ``checkpoint``: what ``read_checkpoint(path)`` returned, if the caller read it."""
        arrays, meta = checkpoint if checkpoint is not None else read_checkpoint(path)
        if meta.get("artifact") != self._fingerprint():
            raise InputError(f"checkpoint {str(path)!r} belongs to a different compiled model")
        if int(meta["seed"]) != self.seed and self.graph.train_mask is None:
            raise InputError(
                f"checkpoint {str(path)!r} was trained with seed {int(meta['seed'])}, which drew "
                f"its train/val/test split (graph {self.graph.name!r} has no masks); this "
                f"trainer's seed {self.seed} draws another: resume with seed "
                f"{int(meta['seed'])} (gcomp train --resume picks it when --seed is not given)")
        for k, v in arrays.items():
            name = k.split("/", 1)[1]
            if name not in self.store:
                raise InputError(f"checkpoint {str(path)!r} holds unknown tensor {name!r}")
            self.train_ex.set(name, v)
        self.step_count = int(meta["step"])
        self.seed = int(meta["seed"])
