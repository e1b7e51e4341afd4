"""Training across MPI ranks: the ``Trainer`` interface over one graph shard per rank.

    # mpiexec -n 4 python train.py
    trainer = DistributedTrainer(artifact, load_graph("cora"), seed=0)
    for epoch in range(200):
        loss = trainer.step()     # the global loss, the same on every rank
    print(trainer.evaluate())     # global accuracies, the same on every rank
    trainer.save("ck.npz")        # rank 0 writes (atomically); the others wait

Every rank loads the whole graph file, rank 0 partitions it (``partition.py``)
and broadcasts the parts, each rank cuts its shard (``halo.py``).  Parameters,
optimizer state and the step counter are replicated and stay bitwise equal
(same all-reduced gradients, same update), so a checkpoint is what one process
would save and resumes on any number of ranks.
"""

from __future__ import annotations

import hashlib

import numpy as np

from gcomp.errors import InputError
from gcomp.distributed.halo import (Comm, DistExecutor, DistributedError, build_shard,
                                    fused_epilogues, local_graph)
from gcomp.distributed.launch import maybe_fault
from gcomp.distributed.partition import check_parts, partition_graph, partition_report
from gcomp.runtime.data import GraphData, check_graph, check_seed
from gcomp.runtime.trainer import Trainer, require_training


class DistributedTrainer(Trainer):
    def __init__(self, artifact, graph: GraphData, seed: int = 0, comm: Comm | None = None,
                 parts: np.ndarray | None = None, method: str = "auto", hosts: int | None = None):
        """``graph``: the whole graph (every rank loads it); ``parts``: a partition to use
        (default: rank 0 computes one with ``method``/``hosts`` and broadcasts it)."""
        require_training(artifact)
        check_seed(seed)  # before any rank partitions with it
        if artifact.target.get("kind") != "llvm":  # before loading its (GPU) runtime
            raise InputError("distributed training runs CPU (llvm) artifacts for now; one rank "
                             "per GPU is described in docs/distributed.md")
        if artifact.manifest.get("precision", "fp32") != "fp32":
            # the halo exchange sends float32 rows
            raise DistributedError("distributed training runs float32 artifacts; this one "
                                   f"was compiled with --precision "
                                   f"{artifact.manifest['precision']}")
        self.comm = comm or Comm()
        rank, size = self.comm.rank, self.comm.size
        graph = check_graph(graph)
        self.artifact, self.graph, self.seed = artifact, graph, int(seed)
        self._set_masks(graph, seed)
        if parts is None:
            failed = None
            if rank == 0:
                try:
                    parts = partition_graph(graph, size, method, hosts, seed=seed)
                except Exception as e:  # noqa: BLE001 - the other ranks wait for the partition
                    failed = e
            sent = self.comm.bcast(str(failed) if failed is not None else parts,
                                   what="partition broadcast")
            if failed is not None:
                raise failed
            if isinstance(sent, str):  # rank 0 could not partition: fail with it, not wait
                raise DistributedError(f"rank 0 could not partition the graph: {sent}")
            parts = sent
        self.parts = check_parts(parts, graph.num_nodes, size)
        self.partition = partition_report(graph, self.parts, size)
        self.shard = sh = build_shard(graph, self.parts, rank, size)
        lib = artifact.library()
        dev = artifact.device()
        self.store: dict = {}
        self.train_ex = DistExecutor(artifact.train_plan, lib, artifact.params, self.store, dev,
                                     sh, self.comm, graph)
        self.eval_ex = DistExecutor(artifact.plan, lib, artifact.params, self.store, dev,
                                    sh, self.comm, graph)
        self.train_ex.epilogues = self.eval_ex.epilogues = fused_epilogues(
            (artifact.ir or {}).values())
        self.step_count = 0
        # a shard's rows keep their order [owned interior | boundary | halo] (halo.py): its
        # steps run on every row (codegen/loss_rows.py is for one process)
        self.loss_rows = False
        own = sh.gids[:sh.n_own]
        local_train = np.zeros(sh.n_local, bool)
        local_train[:sh.n_own] = self.train_mask[own]
        total = int(self.train_mask.sum())
        self.train_ex.loss_scale = float(local_train.sum()) / total
        for s in artifact.train_plan.steps:  # the loss gradient's seed: local / global count
            if s["op"] == "cross_entropy_grad":
                seed_buf = s["args"][0]["buf"]
                if seed_buf not in artifact.train_plan.consts:
                    raise InputError("distributed training needs the loss to be the last op")
                self.train_ex.set(seed_buf, self.train_ex.loss_scale)
        self._local = local_graph(sh, graph)
        self._bind_and_feed(self._local, local_train)

    def step(self) -> float:
        """One training step on every rank; returns the global loss before the update."""
        maybe_fault(self.rank, self.step_count + 1)
        return super().step()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    # ------------------------------------------------------------------ evaluation
    def local_logits(self) -> np.ndarray:
        """Eval-mode logits of this rank's owned nodes (global ids: ``shard.gids[:n_own]``)."""
        b = self.eval_ex.bind(self._local)
        b = self.eval_ex.feed(b, {i["name"]: self._x for i in self.eval_ex.node_inputs()})
        self.eval_ex.execute(b)
        return self.eval_ex.outputs(b)[0][:self.shard.n_own]

    def logits(self) -> np.ndarray:
        """Logits of all nodes, in the user's order, on every rank (an all-gather)."""
        z = self.local_logits()
        parts = self.comm.comm.allgather((self.shard.gids[:self.shard.n_own], z))
        out = np.empty((self.graph.num_nodes, z.shape[1]), z.dtype)
        for ids, v in parts:
            out[ids] = v
        return out

    def evaluate(self) -> dict:
        z = self.local_logits().astype(np.float64)
        own = self.shard.gids[:self.shard.n_own]
        y = self.graph.y[own]
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        pred = z.argmax(1)
        tm = self.train_mask[own]
        sums = [float((lse[tm] - z[tm, y[tm]]).sum()), float(tm.sum())]
        for m in (self.train_mask, self.val_mask, self.test_mask):
            mo = m[own]
            sums += [float((pred[mo] == y[mo]).sum()), float(mo.sum())]
        s = self.comm.allreduce(np.array(sums), "evaluation all-reduce")

        def ratio(a, n):
            return float(a / n) if n else float("nan")
        return {"loss": ratio(s[0], s[1]), "train_acc": ratio(s[2], s[3]),
                "val_acc": ratio(s[4], s[5]), "test_acc": ratio(s[6], s[7])}

    def set_parameters(self, params: dict[str, np.ndarray]) -> None:
        """As ``Trainer``'s, called on every rank with the same values: the replicated
        parameters stay equal only so (each rank training its own values would train no
        model at all; refused on every rank)."""
        super().set_parameters(params)
        digest = hashlib.sha256()
        for k in sorted(params):
            digest.update(k.encode() + self.train_ex.get(k).tobytes())
        differs = self.comm.bcast(digest.hexdigest(), what="set_parameters") != \
            digest.hexdigest()
        if self.comm.allreduce(np.array([float(differs)]), what="set_parameters")[0]:
            raise InputError("set_parameters was given other values on some ranks; give "
                             "every rank the same (rank 0's, broadcast)")

    # ------------------------------------------------------------------ checkpoints
    def save(self, path):
        """Rank 0 writes (parameters and state are the same on every rank); all wait for it."""
        err = None
        if self.rank == 0:
            try:
                path = super().save(path)
            except Exception as e:  # noqa: BLE001 - re-raised after the others know
                err = e
        failed = self.comm.bcast(err is not None, what="checkpoint")
        if err is not None:
            raise err
        if failed:
            raise InputError(f"rank 0 could not write the checkpoint {str(path)!r}")
        return path

    def traffic(self) -> dict:
        """Bytes this rank moves per training step (and what an all-gather would move)."""
        return dict(self.train_ex.traffic)
