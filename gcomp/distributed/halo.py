"""One rank's shard of a graph, and an executor that keeps its halo rows current.

A rank's *local graph* has rows ``[owned interior | owned boundary | halo]``:
owned nodes whose in-neighbours are all owned (interior), the other owned
nodes (boundary), then halo copies of remote in-neighbours grouped by owner.
Its edges are exactly the global in-edges of owned nodes, in the global CSR
order, so every owned row sums the same terms in the same order as one process
does; halo rows have no in-edges.  Every graph value of the plan (self loops
included) is cut from the global structure the same way, and keeps the global
canonical edge ids (``perm``), so edge dropout masks match one process, as node
dropout masks do through the global node ids (``_node_ids``).

``DistExecutor`` runs the compiled plan unchanged on the local graph and adds
communication between its kernels, decided once per binding from the plan's
steps (``_schedule``):

* a kernel that reads a node tensor at edge *sources* (``indices``: aggregation
  over in-edges, ``gather`` of sources, ``edge_dot``, ``sym_norm``; fused GAT
  attention and its backward read two, the source scores and features) needs
  that tensor's halo rows to hold the owners' values.  The exchange is posted right
  after the tensor's producer (non-blocking Isend/Irecv; receives land directly
  in the halo rows) and waited for just before the reader.  An in-edge
  aggregation runs its interior rows while the messages are in flight, then
  waits, then runs its boundary rows (views of the same kernel's arguments).
  Halo validity is tracked: row-wise kernels keep it (input features and
  node dropout keyed by global id are valid on halo rows, so the first layer
  of GraphSAGE or GIN exchanges nothing).
* a kernel that writes node rows through *out*-edges (``csc_*``: the backward
  of an aggregation or of attention, scatter onto sources, out-degrees) leaves
  partial sums on halo rows: they are sent to their owners and added there (a
  reduce).  A fused epilogue keeps them linear: terms it adds are zeroed on halo
  rows first, and a factor such as relu'(h) is read there, exchanged like a source
  read (``_linear_extras``).
* a kernel that sums over node rows into a non-node tensor (weight gradients
  ``x.T @ dy``, bias gradients, sums over nodes) sees owned rows only (a view),
  and its result is all-reduced (batched, before its first reader: usually the
  optimizer).  Sums over edges are all-reduced as they are.
* the loss is a mean over the global training count: the loss gradient's seed
  is scaled by ``local count / global count`` and the loss value likewise before
  its all-reduce, so losses and gradients equal one process's up to summation
  order.

Every rank then applies the same optimizer update to the same parameters.
Waits poll with a deadline (``GCOMP_DIST_TIMEOUT``, seconds): a rank that died
or hangs makes the others fail with an error instead of hanging.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from gcomp.errors import GcompError
from gcomp.runtime.data import GraphData
from gcomp.runtime.executor import Binding, Executor, edge_input_values
from gcomp.runtime.graph import GraphStructure

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(GcompError):
    """A distributed run cannot go on (a peer failed, timed out, or an op is unsupported)."""


def timeout_s() -> float:
    text = os.environ.get("GCOMP_DIST_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise DistributedError(f"GCOMP_DIST_TIMEOUT={text!r}: give the seconds a rank waits "
                               f"for the others, a positive number (default {DEFAULT_TIMEOUT_S})")
    return value


# ---------------------------------------------------------------------- communicator
class Comm:
    """mpi4py communicator with deadline-bounded waits and traffic counters."""

    def __init__(self, comm=None, timeout: float | None = None):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout_s() if timeout is None else timeout
        self.wait_s = 0.0  # time spent blocked in waits (benchmarks: compute = step - wait)

    def wait(self, reqs: list, what: str) -> None:
        if not reqs:
            return
        Testall = self.MPI.Request.Testall
        if Testall(reqs):
            return
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        spins, nap = 0, 0.0
        while not Testall(reqs):
            spins += 1
            if spins > 50:  # back off: ranks may share cores
                nap = min(1e-3, nap * 2 or 2e-5)
                time.sleep(nap)
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"no answer from the other ranks after {self.timeout:.0f} s "
                    f"({what}); a rank failed or hangs (GCOMP_DIST_TIMEOUT sets the limit)")
        self.wait_s += time.monotonic() - t0

    def allreduce(self, a: np.ndarray, what: str = "all-reduce", op=None) -> np.ndarray:
        out = np.empty_like(a)
        if self.size == 1:
            out[...] = a
            return out
        req = self.comm.Iallreduce(np.ascontiguousarray(a), out, op=op or self.MPI.SUM)
        self.wait([req], what)
        return out

    def barrier(self, what: str = "barrier") -> None:
        if self.size > 1:
            self.wait([self.comm.Ibarrier()], what)

    def bcast(self, obj, root: int = 0, what: str = "broadcast"):
        """Broadcast a picklable object with a bounded wait (size first, then bytes)."""
        if self.size == 1:
            return obj
        import pickle
        data = pickle.dumps(obj) if self.rank == root else b""
        n = np.array([len(data)], np.int64)
        self.wait([self.comm.Ibcast(n, root)], what)
        buf = (np.frombuffer(data, np.uint8).copy() if self.rank == root
               else np.empty(n[0], np.uint8))
        self.wait([self.comm.Ibcast(buf, root)], what)
        return obj if self.rank == root else pickle.loads(buf.tobytes())


# ---------------------------------------------------------------------- shard
@dataclass
class Shard:
    rank: int
    size: int
    gids: np.ndarray  # local row -> global node id
    n_own: int
    n_int: int  # owned rows [0, n_int) have only owned in-neighbours
    halo_ranges: dict  # peer -> (start, stop) local rows of the halo it owns
    send_idx: dict  # peer -> local owned rows it needs (in its halo order)
    num_global: int
    edge_index: np.ndarray  # (2, E_local) local ids, for the executor's statistics
    _global: dict = field(default_factory=dict)  # graph value key -> global GraphStructure

    @property
    def n_local(self) -> int:
        return len(self.gids)

    def peers(self) -> list[int]:
        return sorted(set(self.halo_ranges) | set(self.send_idx))


def build_shard(graph: GraphData, parts: np.ndarray, rank: int, size: int) -> Shard:
    """Rank ``rank``'s shard; every rank computes its own from the same ``parts``."""
    src, dst = graph.edge_index
    n = graph.num_nodes
    ps, pd = parts[src], parts[dst]
    mine_in = pd == rank
    remote_in = mine_in & (ps != rank)
    owned = np.nonzero(parts == rank)[0]
    boundary = np.zeros(n, bool)
    boundary[dst[remote_in]] = True
    own_b = boundary[owned]
    owned = np.concatenate([owned[~own_b], owned[own_b]])
    halo = np.unique(src[remote_in])
    halo = halo[np.lexsort((halo, parts[halo]))]  # by owner, then global id
    gids = np.concatenate([owned, halo]).astype(np.int64)
    g2l = np.full(n, -1, np.int64)
    g2l[gids] = np.arange(len(gids))
    halo_ranges = {}
    if len(halo):
        owners, starts = np.unique(parts[halo], return_index=True)
        stops = list(starts[1:]) + [len(halo)]
        halo_ranges = {int(p): (len(owned) + int(a), len(owned) + int(b))
                       for p, a, b in zip(owners, starts, stops)}
    out = (ps == rank) & (pd != rank)
    pairs = np.unique(pd[out].astype(np.int64) * n + src[out])  # sorted by peer, then gid
    send_idx = {}
    if len(pairs):
        peer, gid = pairs // n, pairs % n
        for p in np.unique(peer):
            send_idx[int(p)] = g2l[gid[peer == p]]
    local_ei = np.stack([g2l[src[mine_in]], g2l[dst[mine_in]]])
    return Shard(rank, size, gids, len(owned), int((~own_b).sum()), halo_ranges, send_idx, n,
                 local_ei)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for each (s, c)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offs = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - offs)


def local_structures(shard: Shard, graph: GraphData, plan_graphs: list) -> dict:
    """Each graph value of a plan, cut to the in-edges of owned nodes (global order, ids)."""
    g2l = np.full(shard.num_global, -1, np.int64)
    g2l[shard.gids] = np.arange(shard.n_local)
    owned = shard.gids[:shard.n_own]
    key_of, out = {}, {}
    for gs in plan_graphs:
        if gs["parent"] is None:
            key = ("input",)
            if key not in shard._global:
                shard._global[key] = GraphStructure.from_edge_index(graph.edge_index,
                                                                    graph.num_nodes)
        else:
            key = key_of[gs["parent"]] + (gs["mode"],)
            if key not in shard._global:
                shard._global[key] = shard._global[key_of[gs["parent"]]].derive(gs["mode"])
        key_of[gs["name"]] = key
        G = shard._global[key]
        counts = (G.indptr[owned + 1] - G.indptr[owned]).astype(np.int64)
        sel = _ranges(G.indptr[owned].astype(np.int64), counts)
        indptr = np.zeros(shard.n_local + 1, np.int64)
        indptr[1:shard.n_own + 1] = np.cumsum(counts)
        indptr[shard.n_own + 1:] = indptr[shard.n_own]
        indices = g2l[G.indices[sel]]
        if len(indices) and indices.min() < 0:
            raise DistributedError("internal: an in-edge source is neither owned nor halo")
        rows = np.repeat(np.arange(shard.n_own, dtype=np.int32), counts)
        perm = G.perm[sel]
        origin = None
        if gs["parent"] is not None:
            P, Pl = shard._global[key_of[gs["parent"]]], out[gs["parent"]]
            go = G.origin[sel]
            origin = np.full(len(sel), -1, np.int64)
            ok = go >= 0
            prow = P.rows[go[ok]]
            origin[ok] = Pl.indptr[g2l[prow]] + (go[ok] - P.indptr[prow])
        out[gs["name"]] = GraphStructure(shard.n_local, indptr, indices.astype(np.int32), rows,
                                         lambda p=perm: p, origin)
    return out


def local_graph(shard: Shard, graph: GraphData) -> GraphData:
    x = None if graph.x is None else graph.x[shard.gids]
    y = None if graph.y is None else graph.y[shard.gids]
    return GraphData(f"{graph.name}[rank {shard.rank}/{shard.size}]", shard.n_local,
                     shard.edge_index, x, None, y)


# ---------------------------------------------------------------------- executor
def _family(kernel: str) -> str:
    return kernel[3:].rsplit("_", 1)[0]  # gc_<family>_<digest>


REPLICATED = ("adam", "sgd", "momentum", "transpose")
NO_HALO_PROPAGATION = ("matmul",)


def fused_epilogues(ir_texts) -> dict[str, list[tuple[str, bool, tuple[str, ...]]]]:
    """anchor node -> its fused members as (op, computed operand?, input names), read from
    an artifact's printed IR (``artifact.ir``: lines ``%m = op[...](%a, %b) : T  #:
    {"fused_into": "anchor", ...}``, ``"operand": true`` for an operand the epilogue
    computes; artifacts written before 2026-11-28 annotate ``# fused_into='anchor'``)."""
    import json
    import re
    pat = re.compile(r"^\s*%(\S+) = ([a-z_]+)\b[^(]*\(([^)]*)\)[^#]*#(.*)$")
    old = re.compile(r"fused_into='([^']+)'")
    out: dict[str, list[tuple[str, bool, tuple[str, ...]]]] = {}
    for text in ir_texts:
        for line in (text or "").splitlines():
            m = pat.match(line)
            if not m:
                continue
            note = m.group(4)
            if note.startswith(":"):
                meta = json.loads(note[1:])
                anchor, operand = meta.get("fused_into"), bool(meta.get("operand"))
            else:
                o = old.search(note)
                anchor, operand = (o.group(1) if o else None), "operand=True" in note
            if anchor is not None:
                args = tuple(a.strip().lstrip("%") for a in m.group(3).split(",") if a.strip())
                out.setdefault(anchor, []).append((m.group(2), operand, args))
    return out


class DistExecutor(Executor):
    """Runs a plan on one shard, with halo exchanges, reduces and all-reduces between kernels."""

    feeds_in_place = False  # _schedule rewrites the bound steps: inputs are copied in

    def __init__(self, plan, lib, params, store, device, shard: Shard, comm: Comm,
                 global_graph: GraphData):
        super().__init__(plan, lib, params, store, device)
        self.shard, self.comm, self.global_graph = shard, comm, global_graph
        self.reorder = "none"  # rows stay [interior | boundary | halo]
        self.formats = "csr"  # a shard's aggregations gather halo rows: no square layout
        self.force_variants = {k: False for k in plan.variants}  # sparse-X kernels sum over rows
        self.invalid_inputs = {"train_mask"}  # zero on halo rows (masks count owned nodes only)
        self.loss_scale = 1.0  # local / global training count (set by the trainer)
        self.traffic: dict = {}
        self._bind_valid: dict = {}
        self.epilogues: dict[str, list] = {}  # fused_epilogues(artifact.ir.values())

    # ---- hooks
    def _structures(self, graph, order):
        return local_structures(self.shard, self.global_graph, self.plan.graphs)

    def _node_ids(self, graph, order):
        return self.shard.gids

    def _edge_input(self, graph, inp):  # perm holds global edge ids: index the global values
        return edge_input_values(self.global_graph, inp)

    # ---- plan analysis helpers
    def _root(self, name: str) -> str:
        return self.plan.buffers[name].get("alias", name)

    def _lead(self, name: str):
        dims = self.plan.buffers[self._root(name)]["dims"]
        return dims[0] if dims else None

    def _is_node(self, name: str) -> bool:
        return self._lead(name) == "N"

    def _is_edge(self, name: str) -> bool:
        lead = self._lead(name)
        return isinstance(lead, str) and lead.startswith("E:")

    def _view(self, b: Binding, root: str) -> np.ndarray:
        a = np.from_dlpack(b.buffers[root])
        return a.reshape(a.shape[0], -1) if a.ndim != 1 else a

    def _classify(self, s: dict) -> dict:
        """What the distributed runtime must do around plan step ``s``."""
        fam = _family(s["kernel"])
        garrs = {a["array"] for a in s["args"] if "graph" in a}
        bufs = [(i, a["buf"]) for i, a in enumerate(s["args"]) if "buf" in a]
        c = {"family": fam, "reads_src": [], "out": None, "kind": "local", "owned_views": []}
        if fam in REPLICATED or any("features" in a for a in s["args"]):
            if any("features" in a for a in s["args"]):
                raise DistributedError("sparse-feature kernels are not supported across ranks")
            c["kind"] = "replicated"
            return c
        if not bufs:
            return c
        if fam == "cross_entropy_fused":
            # the loss and its gradient (passes/fuse_loss_grad.py): the loss is summed
            # across ranks; the gradient is written on owned rows, as a row-wise step's
            # output whose halo rows nothing needs
            (_, loss), (_, grad) = bufs[-2:]
            c.update(kind="loss", out=loss, writes=[grad],
                     inputs=[n for _, n in bufs[:-2]],
                     owned_views=[i for i, n in bufs if self._is_node(n)])
            return c
        out_i, out = bufs[-1]
        ins = bufs[:-1]
        c["out"] = out
        c["inputs"] = [n for _, n in ins]
        if garrs:
            nodes = [n for _, n in ins if self._is_node(n)]
            if "csc_indptr" in garrs:
                c["kind"] = "reduce" if self._is_node(out) else "local"
                if fam == "attention_grad_src":
                    # reads its own row's scores and features (s_src, x, dy, stats): on
                    # halo rows too, whose partial sums go to their owners
                    c["reads_src"], c["zero_halo"] = nodes[:2], []
                elif c["kind"] == "reduce":
                    c["zero_halo"], c["reads_src"] = self._linear_extras(s, ins)
            else:
                c["kind"] = "graph"
                if "indices" in garrs:
                    # fused attention and its backward read scores and features at sources
                    # (s_src, s_dst, x, ...): the others, their first node tensor
                    c["reads_src"] = ([nodes[0], nodes[2]] if fam.startswith("attention_")
                                      else nodes[:1])
            return c
        node_in = [n for _, n in ins if self._is_node(n)]
        edge_in = [n for _, n in ins if self._is_edge(n)]
        if self._is_node(out):
            c["kind"] = "rowwise"
        elif self._is_edge(out):
            c["kind"] = "local"
        elif node_in:
            if fam == "reduce" and s["op"] != "sum":
                raise DistributedError(f"a {s['op']} over all nodes (%{s['node']}) is not "
                                       "supported across ranks")
            c["kind"] = "loss" if fam == "cross_entropy" else "rowsum"
            c["owned_views"] = [i for i, n in ins if self._is_node(n)]
        elif edge_in:
            if fam == "reduce" and s["op"] != "sum":
                raise DistributedError(f"a {s['op']} over all edges (%{s['node']}) is not "
                                       "supported across ranks")
            c["kind"] = "edgesum"
        return c

    def _linear_extras(self, s: dict, ins: list) -> tuple[list[str], list[str]]:
        """(row extras to zero on halo rows, row extras read there) of an out-edge
        aggregation's fused epilogue.  Halo rows hold partial sums that their owners add
        up, so an epilogue must keep the result linear in them: terms added (``+ extra``,
        the gradient accumulation autodiff emits, or ``+ s * t``, a product with a node
        tensor), whose extras' halo rows are zeroed, and an activation's gradient
        (``elementwise_grad``: the partial sums times relu'(h)), whose h is read on halo
        rows as the owners hold it, so the scaled partial sums add up to the scaled sum.
        The aggregated tensor itself may be a term (GIN's ``+ (1 + eps) * dy``): the
        shard's edges end at owned rows, so the sum reads it only there.  Anything else
        is refused."""
        node_in = [n for _, n in ins if self._is_node(n)]
        extras = node_in[1:]  # node_in[0] is the aggregated tensor
        vec = [n for _, n in ins if not self._is_node(n) and not self._is_edge(n)]
        if not extras and not vec:
            return [], []
        ops = self.epilogues.get(s["node"])
        # products computed in the epilogue, each with a node tensor (fuse_epilogues):
        # zero on halo rows, whatever their other factors (a scalar such as GIN's 1 + eps)
        factors = {a for op, operand, args in ops or () if operand and op == "mul"
                   and any(x in self.plan.buffers and self._is_node(x) for x in args)
                   for a in args}
        scales = [args[-1] for op, operand, args in ops or ()
                  if op == "elementwise_grad" and not operand and len(args) == 2]
        if (ops is None or any(not operand and op not in ("add", "reshape", "elementwise_grad")
                               or operand and op != "mul" for op, operand, _ in ops)
                or any(v not in factors for v in vec)
                or any(v in args for op, _, args in ops if op != "elementwise_grad"
                       for v in scales)):  # a term would be zeroed, its scale must not
            raise DistributedError(
                f"%{s['node']}: an aggregation over out-edges with a fused epilogue "
                f"({', '.join(op for op, *_ in ops or [('unknown',)])}) cannot be split "
                "across ranks; compile with the fuse_epilogues pass disabled")
        return ([self._root(n) for n in extras if n not in scales],
                [self._root(n) for n in extras if n in scales])

    def _zero_halo_op(self, b: Binding, roots: list[str]):
        views = [self._view(b, r) for r in roots]
        n_own = self.shard.n_own

        def run():
            for v in views:
                v[n_own:] = 0
        return run

    def _owned(self, t):
        return t._create_view((self.shard.n_own,) + tuple(int(d) for d in t.shape[1:]))

    @staticmethod
    def _rows(t, a: int, z: int):
        """Rows [a, z) of a CPU tensor as a tensor whose data pointer starts there (kernels
        want a zero byte_offset, which ``_create_view`` with an offset does not give)."""
        import tvm_ffi
        return tvm_ffi.from_dlpack(np.from_dlpack(t)[a:z])  # kernels ask 4-byte alignment

    # ---- communication primitives (closures over numpy views of the buffers)
    def _exchange_ops(self, b: Binding, root: str, tag: int):
        """(post, wait) for refreshing the halo rows of ``root`` from their owners."""
        sh, comm = self.shard, self.comm
        arr = self._view(b, root)
        sends = {p: np.empty((len(i),) + arr.shape[1:], arr.dtype) for p, i in sh.send_idx.items()}
        reqs: list = []
        row_bytes = arr[0:1].nbytes
        self.traffic["exchange_bytes"] = self.traffic.get("exchange_bytes", 0) + row_bytes * sum(
            len(i) for i in sh.send_idx.values())
        self.traffic["naive_bytes"] = self.traffic.get("naive_bytes", 0) + row_bytes * (
            sh.num_global - sh.n_own)  # an all-gather: every row this rank does not own

        def post():
            for p, (a, z) in sh.halo_ranges.items():
                reqs.append(comm.comm.Irecv(arr[a:z], source=p, tag=tag))
            for p, idx in sh.send_idx.items():
                np.take(arr, idx, axis=0, out=sends[p])
                reqs.append(comm.comm.Isend(sends[p], dest=p, tag=tag))

        def wait():
            comm.wait(reqs, f"halo exchange of {root}")
            reqs.clear()
        return post, wait

    def _reduce_ops(self, b: Binding, root: str, tag: int):
        """(post, wait) for adding the halo rows' partial sums of ``root`` into their owners."""
        sh, comm = self.shard, self.comm
        arr = self._view(b, root)
        recvs = {p: np.empty((len(i),) + arr.shape[1:], arr.dtype) for p, i in sh.send_idx.items()}
        reqs: list = []
        self.traffic["reduce_bytes"] = self.traffic.get("reduce_bytes", 0) + arr[0:1].nbytes * (
            sh.n_local - sh.n_own)
        self.traffic["naive_bytes"] = self.traffic.get("naive_bytes", 0) + arr[0:1].nbytes * (
            sh.num_global - sh.n_own)  # a reduce-scatter of partial sums for every row

        def post():
            for p, idx in sh.send_idx.items():
                reqs.append(comm.comm.Irecv(recvs[p], source=p, tag=tag))
            for p, (a, z) in sh.halo_ranges.items():
                reqs.append(comm.comm.Isend(arr[a:z], dest=p, tag=tag))

        def wait():
            comm.wait(reqs, f"halo reduce of {root}")
            reqs.clear()
            for p, idx in sh.send_idx.items():
                arr[idx] += recvs[p]
        return post, wait

    def _allreduce_op(self, b: Binding, roots: list[str]):
        views = [np.from_dlpack(b.buffers[r]) for r in roots]
        sizes = [v.size for v in views]
        buf = np.empty(sum(sizes), np.float64)
        self.traffic["allreduce_bytes"] = self.traffic.get("allreduce_bytes", 0) + buf.nbytes
        comm = self.comm

        def run():
            o = 0
            for v, n in zip(views, sizes):
                buf[o:o + n] = v.reshape(-1)
                o += n
            red = comm.allreduce(buf, "gradient all-reduce")
            o = 0
            for v, n in zip(views, sizes):
                v.reshape(-1)[...] = red[o:o + n]
                o += n
        return run

    def _loss_op(self, b: Binding, root: str):
        v = np.from_dlpack(b.buffers[root])

        def run():
            v[...] = v * self.loss_scale if self.loss_scale > 0 else 0.0
        return run

    # ---- bind phase: run with blocking communication
    def _run_bind_steps(self, binding: Binding, steps: list) -> None:
        self.traffic = {}
        valid: dict[str, bool] = {}
        for i, (s, fn, args) in enumerate(steps):
            c = self._classify(s)
            for k, src in enumerate(self._root(r) for r in c["reads_src"]):
                if not valid.get(src, False):
                    # blocking, so tags only need to stay below MPI_TAG_UB (>= 32767)
                    post, wait = self._exchange_ops(binding, src, 30000 + (2 * i + k) % 2000)
                    post()
                    wait()
                    valid[src] = True
            if c["owned_views"]:
                args = tuple(self._owned(a) if j in c["owned_views"] else a
                             for j, a in enumerate(args))
            if c.get("zero_halo"):
                self._zero_halo_op(binding, c["zero_halo"])()
                valid.update({r: False for r in c["zero_halo"]})
            fn(*args)
            out = c["out"] and self._root(c["out"])
            if c["kind"] == "reduce":
                post, wait = self._reduce_ops(binding, out, 31000 + i)
                post()
                wait()
                valid[out] = False
            elif c["kind"] in ("rowsum", "edgesum"):
                self._allreduce_op(binding, [out])()
            elif c["kind"] == "rowwise":
                valid[out] = all(valid.get(self._root(n), False) for n in c["inputs"]
                                 if self._is_node(n))
            elif out and self._is_node(out):
                valid[out] = False
        self._bind_valid = valid

    def _run_feed_steps(self, binding: Binding) -> None:
        """Feed-phase kernels run like the bind phase (blocking exchanges); the run
        schedule, made at bind, stays, and so do its traffic counters."""
        run_traffic, bind_valid = self.traffic, self._bind_valid
        self._run_bind_steps(binding, binding.feed_steps)
        self.traffic, self._bind_valid = run_traffic, bind_valid

    # ---- run phase: a schedule of kernels and communication
    def bind(self, graph, features=None) -> Binding:
        cached = self._binding
        b = super().bind(graph, features)
        if b is not cached:
            self._schedule(b)
        return b

    def _schedule(self, b: Binding) -> None:
        self.bind_traffic, self.traffic = self.traffic, {}
        written = set()
        for s in b.plan_steps:
            c = self._classify(s)
            for w in filter(None, [c["out"], *c.get("writes", ())]):
                written.add(self._root(w))
        valid = {k: v for k, v in self._bind_valid.items() if k not in written}
        for inp in self.node_inputs():
            valid[inp["name"]] = inp["name"] not in self.invalid_inputs
        used = self._halo_uses(b, dict(valid))
        n = len(b.steps)
        before: list[list] = [[] for _ in range(n)]
        after: list[list] = [[] for _ in range(n)]
        prologue, epilogue = [], []
        main = [[(fn, args)] for fn, args in b.steps]
        last_write: dict[str, int] = {}  # root -> step after which its owned rows are final
        pending_reduce: dict[str, object] = {}  # root -> wait of its reduce
        pending_sum: list[str] = []
        pending_set: set = set()
        tag = [0]

        def next_tag():
            tag[0] = (tag[0] + 1) % 30000
            return tag[0]

        for i, (s, (fn, args)) in enumerate(zip(b.plan_steps, b.steps)):
            c = self._classify(s)
            roots = [self._root(a["buf"]) for a in s["args"] if "buf" in a]
            for r in roots:  # finish reduces before anything touches the buffer
                if r in pending_reduce:
                    before[i].append((pending_reduce.pop(r), ()))
            if pending_set & set(roots):
                before[i].append((self._allreduce_op(b, list(pending_sum)), ()))
                pending_sum.clear()
                pending_set.clear()
            stale = [r for r in (self._root(x) for x in c["reads_src"]) if not valid.get(r, False)]
            for src in stale:
                post, wait = self._exchange_ops(b, src, next_tag())
                w = last_write.get(src)
                if w is None:
                    (prologue if src not in written else before[i]).append((post, ()))
                else:
                    after[w].append((post, ()))
                if c["family"] == "csr_agg" and c["kind"] == "graph" and self.shard.n_own > 0:
                    main[i] = self._split(s, fn, args, wait)
                else:
                    before[i].append((wait, ()))
                valid[src] = True
            if not stale and c["family"] == "csr_agg" and c["kind"] == "graph" and \
                    self._is_node(c["out"]):
                main[i] = [(fn, self._owned_rows(s, args, "csr_agg"))]  # halo rows: no edges
            if c["owned_views"]:
                main[i] = [(fn, tuple(self._owned(a) if j in c["owned_views"] else a
                                      for j, a in enumerate(args)))]
            if c.get("zero_halo"):
                before[i].append((self._zero_halo_op(b, c["zero_halo"]), ()))
                valid.update({r: False for r in c["zero_halo"]})
            for w in map(self._root, c.get("writes", ())):  # owned rows final, halo rows not
                last_write[w] = i
                valid[w] = False
            out = c["out"] and self._root(c["out"])
            if not out:
                continue
            if c["kind"] == "reduce":
                post, wait = self._reduce_ops(b, out, next_tag())
                after[i].append((post, ()))
                pending_reduce[out] = wait
                last_write.pop(out, None)
                valid[out] = False
            elif c["kind"] in ("rowsum", "edgesum", "loss"):
                if c["kind"] == "loss":
                    after[i].append((self._loss_op(b, out), ()))
                if out not in pending_set:
                    pending_sum.append(out)
                    pending_set.add(out)
            elif self._is_node(out):
                valid[out] = self._keeps_halo(c, valid) and out in used
                last_write[out] = i
                if c["kind"] == "rowwise" and not valid[out] and len(main[i]) == 1:
                    # its halo rows would be garbage anyway: compute owned rows only
                    main[i] = [(fn, self._owned_rows(s, args, "rowwise"))]
        for wait in pending_reduce.values():
            epilogue.append((wait, ()))
        if pending_sum:
            epilogue.append((self._allreduce_op(b, list(pending_sum)), ()))
        steps = list(prologue)
        for i in range(n):
            steps += before[i] + main[i] + after[i]
        b.steps = steps + epilogue
        b.plan_steps = []  # the schedule interleaves communication; see self.traffic

    def _keeps_halo(self, c: dict, valid: dict) -> bool:
        """Would this step's output be right on halo rows?  Row-wise steps whose node inputs
        are; not dense matmuls: sending their (narrower) output rows costs less than
        recomputing K-wide products on halo rows."""
        return c["kind"] == "rowwise" and c["family"] not in NO_HALO_PROPAGATION and all(
            valid.get(self._root(x), False) for x in c["inputs"] if self._is_node(x))

    def _halo_uses(self, b: Binding, valid: dict) -> set:
        """Buffers whose halo rows are read without an exchange (by a source read, or by a
        row-wise step whose output is), so row-wise steps must compute their halo rows."""
        used, feeds = set(), {}
        for s in b.plan_steps:
            c = self._classify(s)
            for src in (self._root(x) for x in c["reads_src"]):
                if valid.get(src, False):
                    used.add(src)
                valid[src] = True
            valid.update({r: False for r in c.get("zero_halo", [])})
            valid.update({self._root(w): False for w in c.get("writes", ())})
            out = c["out"] and self._root(c["out"])
            if out and self._is_node(out) and c["kind"] not in ("rowsum", "edgesum", "loss"):
                valid[out] = self._keeps_halo(c, valid)
                if valid[out]:
                    feeds[out] = [self._root(x) for x in c["inputs"] if self._is_node(x)]
        stack = list(used)
        while stack:
            for x in feeds.get(stack.pop(), ()):
                if x not in used:
                    used.add(x)
                    stack.append(x)
        return used

    def _owned_rows(self, s: dict, args: tuple, how: str) -> tuple:
        """``args`` restricted to the owned rows (prefix views): every node tensor and the
        node ids of a row-wise kernel; indptr and the non-source node tensors (extras,
        output) of an in-edge aggregation."""
        node_pos = [j for j, a in enumerate(s["args"])
                    if ("buf" in a and self._is_node(a["buf"])) or "nodes" in a]
        out = list(args)
        if how == "csr_agg":
            out[0] = args[0]._create_view((self.shard.n_own + 1,))
            node_pos = node_pos[1:]
        for j in node_pos:
            out[j] = self._owned(args[j])
        return tuple(out)

    def _split(self, s: dict, fn, args: tuple, wait) -> list:
        """An in-edge aggregation as interior rows, wait for the halo, boundary rows.

        csr_agg's arguments: indptr (n+1), indices, [eid, w], x (m rows, read at sources),
        row extras (n rows), out (n rows): a row range is a view of indptr, extras and out.
        """
        sh = self.shard
        node_pos = [j for j, a in enumerate(s["args"]) if "buf" in a and self._is_node(a["buf"])]
        rows = node_pos[1:]  # node_pos[0] is x, read at any row

        def part(a, z):
            out = list(args)
            out[0] = self._rows(args[0], a, z + 1)
            for j in rows:
                out[j] = self._rows(args[j], a, z)
            return tuple(out)
        ops = []
        if sh.n_int > 0:
            ops.append((fn, part(0, sh.n_int)))
        ops.append((wait, ()))
        if sh.n_own > sh.n_int:
            ops.append((fn, part(sh.n_int, sh.n_own)))
        return ops
