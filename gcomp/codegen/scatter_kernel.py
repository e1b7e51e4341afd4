"""The GPU's aggregation over out-edges by scatter: ``out = A^T x`` read from the forward
CSR, each edge adding its destination row's value into its source's output row with an
atomic add (``--prefer memory`` on CUDA, ``gcomp/codegen/lower.py``).

    out[indices[j], h, c] += w[j, h] * x[i, h, c]   for every edge j of row i

The gather form (``csr_agg`` over the CSC arrays) needs the transposed graph on the
device: its indices, its row pointers and hub tasks, and edge values in CSC order.
This form needs none of them, for the price of atomics: the order in which a source's
terms are added is the GPU's, so results may differ in the last bits from run to run
(``--deterministic`` keeps the gather).  An output element is complete only when every
edge has been added, so the only epilogue is one that adds to the sum (``additive``:
GIN's ``+ (1 + eps) dy``): the output starts from it instead of from zero.

Nests, launched in order: ``init`` sets the output to the epilogue's addends (or zero);
``task`` (the hub tasks of ``gcomp/codegen/hub_split.py``, ranges of at most
``graph.task_edges`` edges cut from long rows) and ``row`` (every other row) scatter their
edges, a thread per feature, each thread loading its row's value once.  A task needs no
partial row: the atomics add its edges straight into the output.

Arguments: indptr (int64, n+1), indices (int32, nnz), [w (float32, nnz x WH)], x
(float32, n x H*C), extras..., tasks (int64, t x 3), hub (int64, n+1), out (float32, m x
H*C).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.aggregate_kernel import lanes_block
from gcomp.codegen.kernels import arg, bound, definer
from gcomp.errors import CompileError


def additive(chain: tuple) -> bool:
    """Whether epilogue ``chain`` only adds terms to the sum (so it can come first)."""
    return all(op == "add" for op, *_ in chain)


@definer("csr_scatter")
def csr_scatter(H: int, C: int, weight: str, epilogue: tuple = (), extras: tuple = (),
                split: bool = False):
    """Only the split form exists: it is written for the GPU (TVM's CPU backend has no
    atomic add), whose plans split every aggregation (``hub_split``)."""
    if not split:
        raise CompileError("csr_scatter runs on CUDA only, in its split form (hub_split)")
    if not additive(epilogue):
        raise CompileError(f"csr_scatter cannot apply the epilogue {epilogue}: it only adds")
    F = H * C
    WH = H if weight == "head" else 1
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("csr_scatter")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz, t = (tirx.Var(name, "int64") for name in ("n", "m", "nnz", "t"))
            indptr = arg("indptr", (n + 1,), "int64")
            indices = arg("indices", (nnz,), "int32")
            w = arg("w", (nnz, WH), f32) if weight != "none" else None
            x = arg("x", (n, F), f32)
            extra = [arg(f"e{k}", epi.shape(kind, m, F), f32) for k, kind in enumerate(extras)]
            tasks = arg("tasks", (t, 3), "int64")
            hub = arg("hub", (n + 1,), "int64")
            out = arg("out", (m, F), f32)

            with T.grid(m, F) as (i, f):
                with T.sblock("init"):
                    vi = T.axis.spatial(m, i)
                    vf = T.axis.spatial(F, f)
                    T.reads(*[e[epi.index(kind, vi, vf)] for e, kind in zip(extra, extras)])
                    T.writes(out[vi, vf])
                    T.buffer_store(out, epi.apply(epilogue, tirx.const(0.0, f32), lambda k: (
                        extra[k][epi.index(extras[k], vi, vf)])), [vi, vf])

            def scatter(row, lo, hi, vh, f):
                value = bound(x[row, f])  # float32 also where x is stored as bfloat16
                with T.serial(lo, hi) as j:
                    IRBuilder.name("j", j)
                    term = value if w is None else w[j, vh if weight == "head" else 0] * value
                    T.evaluate(T.cuda.atomic_add(T.address_of(out[indices[j], f]), term))

            def reads(f, *rows):
                return [indices[0:nnz], *rows, *([w[0:nnz, 0:WH]] if w is not None else [])]

            with lanes_block("task", t, H, C, row="k") as (vk, vh, _, f):
                T.reads(*reads(f, tasks[vk, 0:3], x[0:n, f]))
                T.writes(out[0:m, f])
                scatter(tasks[vk, 2], tasks[vk, 0], tasks[vk, 1], vh, f)
            with lanes_block("row", n, H, C) as (vi, vh, _, f):
                T.reads(*reads(f, indptr[vi:vi + 2], hub[vi:vi + 2], x[vi, f]))
                T.writes(out[0:m, f])
                # a hub row's edges are its tasks'
                end = tirx.Select(hub[vi + 1] > hub[vi], indptr[vi], indptr[vi + 1])
                scatter(vi, indptr[vi], end, vh, f)
    return ib.get()
