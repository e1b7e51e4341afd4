"""Calibrate when sparse input features pay off, by measuring on the target.

Morphling reports that multiplying sparse X by dense W beats the dense product
above about 80% zeros; the crossover depends on the machine, the layer's widths
and whether the weight gradient X.T @ dY is computed too, so gcomp measures it:
the dense kernels (``matmul``, and for training ``matmul_tn``) against the
sparse-X kernels (aggregations over X's nonzeros, by rows and by columns) for
this layer's K and M, compiled for the target, timed on random X of increasing
sparsity.  The threshold is the lowest measured sparsity from which the sparse
kernels are at least 10% faster at every higher sparsity too (1.0: never); the
margin keeps timing noise from picking the sparse path for dense features.

Measurements are kept on disk (``$GCOMP_CACHE_DIR/calibration``), keyed by the
compiled kernel library (content-addressed: changed kernels are measured anew),
the measurement's parameters and the machine (CPU model, core and thread
counts): compiling again on the same machine reuses them instead of spending
seconds re-measuring, and makes the same decisions.  Delete the folder to
measure again.  A measurement during which other processes kept more than
``BUSY_CORES`` busy is taken once more, and if the machine is still busy, used
for this compile but not kept: a calibration taken under load once priced CSR
aggregation 3.5x too high, and a kept one would have steered every later compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from gcomp.codegen.cpu_load import CpuMonitor
from gcomp.codegen.kernels import KernelSpec
from gcomp.files import write_atomic
from gcomp.runtime.formats import BUSY_KEY

SPARSITIES = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
PROTOCOL = 3  # of the measurements kept on disk: bump when what they measure or return changes
MARGIN = 0.9
SPARSE_DEFAULT = 0.8  # Morphling's threshold: where the features' zeros cannot be timed
BUSY_CORES = 0.3  # other processes' load (cores) above which a measurement is not kept


def _times(calls: dict, reps: int = 5, span_s: float = 0.0, q: float = 50) -> dict:
    """Percentile ``q`` (the median) of each call's times, the calls ``{key: (fn, args)}``
    timed in turn, ``reps`` times each or as many more as fill ``span_s``: a kernel of
    microseconds timed within one scheduler time slice would read all slow when another
    process holds a core for that slice, and load that comes and goes slows calls timed
    in turn alike, so the differences of their times hold."""
    for fn, args in calls.values():
        fn(*args)
    ts: dict = {k: [] for k in calls}
    end = time.perf_counter() + span_s
    while min(len(v) for v in ts.values()) < reps or time.perf_counter() < end:
        for k, (fn, args) in calls.items():
            t = time.perf_counter()
            fn(*args)
            ts[k].append(time.perf_counter() - t)
    return {k: float(np.percentile(v, q)) for k, v in ts.items()}


def _median_time(fn, args, reps: int = 5, span_s: float = 0.0, q: float = 50) -> float:
    return _times({0: (fn, args)}, reps, span_s, q)[0]


def _machine() -> list:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         "")
    except OSError:
        pass
    return [platform.machine(), model or platform.processor(), os.cpu_count(),
            os.environ.get("TVM_NUM_THREADS")]


def _cached(kind: str, lib_path: Path, params: list, measure) -> tuple:
    """(``measure()`` for the kernels of ``lib_path`` with ``params`` on this machine,
    whether it is kept): from the disk cache when it was measured before (a damaged entry
    is measured again); a measurement taken on a busy machine is not kept."""
    from gcomp.codegen.build import cache_dir
    key = hashlib.sha256(json.dumps([kind, PROTOCOL, lib_path.name, params,
                                     _machine()]).encode())
    path = cache_dir() / "calibration" / f"{kind}-{key.hexdigest()[:24]}.json"
    try:
        return json.loads(path.read_text()), True
    except (OSError, ValueError):
        pass
    for _ in range(2):
        mon = CpuMonitor()
        value = measure()
        load = mon.cores()
        if load is None or load <= BUSY_CORES:
            break
    else:  # busy both times: good enough for this compile, not for the next ones
        return json.loads(json.dumps(value)), False  # the same shape as a value read back
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: concurrent compiles never read half a file
    write_atomic(path, lambda f: f.write(json.dumps(value).encode()))
    return value, True


def calibrate_sparse_threshold(K: int, M: int, target: dict, training: bool = False,
                               rows: int = 2048, seed: int = 0) -> tuple[float, list[dict]]:
    import tvm

    from gcomp.codegen.build import build_library

    if target["kind"] != "llvm":  # timings need the target machine: only the host can measure
        return SPARSE_DEFAULT, [{"note": "not measured: the target is not this machine; "
                                         f"Morphling's {SPARSE_DEFAULT:.2f}"}]
    specs = {"dense": KernelSpec.make("matmul", K=K, M=M),
             "sparse": KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge")}
    if training:
        specs["dense_grad"] = KernelSpec.make("matmul_tn", K=K, M=M)
        specs["sparse_grad"] = KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge",
                                               indirect=True)
    lib_path = build_library({s.name: s for s in specs.values()}, target)
    (threshold, table), kept = _cached("sparse", lib_path, [K, M, training, rows, seed],
                                       lambda: _measure_sparse(
                                           tvm.runtime.load_module(str(lib_path)), specs, K,
                                           M, training, rows, seed))
    if not kept:  # timings taken under load mislead (one put Cora's 98.7% zeros on the
        # dense kernels): Morphling's figure, as for a target this machine cannot time
        return SPARSE_DEFAULT, table + [{"note": f"measured while the machine was busy "
                                                 f"(measured threshold {threshold}); "
                                                 f"Morphling's {SPARSE_DEFAULT:.2f}"}]
    return threshold, table


def _measure_sparse(lib, specs: dict, K: int, M: int, training: bool, rows: int,
                    seed: int) -> tuple[float, list[dict]]:
    import scipy.sparse as sp
    import tvm

    from gcomp.runtime.features import SparseFeatures
    rng = np.random.default_rng(seed)
    dev = tvm.cpu()

    def t(a):
        return tvm.runtime.tensor(a, dev)
    w = t(rng.standard_normal((K, M)).astype(np.float32))
    dy = t(rng.standard_normal((rows, M)).astype(np.float32))
    out = tvm.runtime.empty((rows, M), "float32", dev)
    gout = tvm.runtime.empty((K, M), "float32", dev)
    table = []
    for s in SPARSITIES:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x[rng.random((rows, K)) < s] = 0.0
        f = SparseFeatures(sp.csr_matrix(x))
        dense = _median_time(lib[specs["dense"].name], (t(x), w, out))
        sparse = _median_time(lib[specs["sparse"].name], (t(f.indptr), t(f.indices), t(f.values),
                                                         w, out))
        if training:
            dense += _median_time(lib[specs["dense_grad"].name], (t(x), dy, gout))
            sparse += _median_time(lib[specs["sparse_grad"].name], (
                t(f.csc_indptr), t(f.csc_indices), t(f.csc_eid), t(f.values), dy, gout))
        table.append({"sparsity": s, "dense_ms": dense * 1e3, "sparse_ms": sparse * 1e3})
    threshold = 1.0
    for row in reversed(table):  # the run of sparsities, from the top, where sparse wins
        if row["sparse_ms"] < MARGIN * row["dense_ms"]:
            threshold = row["sparsity"]
        else:
            break
    return threshold, table


_FORMAT_COSTS: dict = {}  # (target, width) -> costs kept; measuring takes a few seconds
LARGE_LAYOUT_BYTES = 64 << 20  # twice the last-level cache gcomp was tuned on
GATHER_ROWS = 1 << 18  # at most, rows of the graph whose random gathers miss the cache


def calibrate_formats(widths, target: dict, block: int = 32, rows: int = 2048,
                      seed: int = 0) -> dict[str, dict]:
    """Per-unit costs (ns) of the adjacency formats at each feature width, measured on the
    target (``gcomp/runtime/formats.py`` predicts with them): CSR aggregation per edge and
    per row, ELL buckets per slot and per row, dense and banded aggregation per layout
    entry, for a layout in cache and for one of ``LARGE_LAYOUT_BYTES`` (``_large``:
    streamed from memory); packing a layout per entry (both sizes) and per edge.

    The small layouts are measured on a graph of ``rows`` nodes whose 16 in-edges per node
    lie within ``block`` rows, so the gathers hit the cache as they do on the graphs where
    these formats compete (small dense graphs, banded graphs); packing on 4 and 32 edges
    per node, whose difference gives the per-edge part.  CSR and ELL are fitted (per edge
    or slot, per row) to two such graphs of 2 and 32 in-edges per node on average, of
    mixed degrees (ELL rows then fall in several buckets, out of order), and (``_large``)
    to two with random neighbours, 2 and 8 in-edges per node, of features of
    ``LARGE_LAYOUT_BYTES`` (at most ``GATHER_ROWS`` rows): gathers and ELL's out-of-order
    stores that miss the cache.  A low percentile of many calls: other processes only
    ever make a call slower."""
    import tvm

    from gcomp.codegen.build import build_library

    if target["kind"] != "llvm":
        raise ValueError("adjacency formats are measured on the host CPU only")
    key = str(sorted(target.items()))
    todo = [F for F in sorted(set(widths)) if (key, F) not in _FORMAT_COSTS]
    costs = {F: _FORMAT_COSTS[(key, F)] for F in set(widths) if F not in todo}
    if todo:
        specs = {("csr", F): KernelSpec.make("csr_agg", reduce="sum", H=1, C=F, weight="edge")
                 for F in todo}
        for fmt in ("dense", "banded"):  # ELL is packed by numpy (formats.pack_ell)
            specs[("pack", fmt)] = KernelSpec.make("format_pack", fmt=fmt, weight="edge")
        for fmt in ("dense", "banded", "ell"):
            for F in todo:
                specs[(fmt, F)] = KernelSpec.make("format_agg", fmt=fmt, reduce="sum", F=F,
                                                  transpose=False)
        lib_path = build_library({s.name: s for s in specs.values()}, target)
        fn = {}

        def measure(F):
            if not fn:
                lib = tvm.runtime.load_module(str(lib_path))
                fn.update({k: lib[s.name] for k, s in specs.items()})
            return _measure_formats(fn, F, block, rows, seed)
        for F in todo:
            costs[F], kept = _cached("formats", lib_path, [F, block, rows, seed],
                                     lambda F=F: measure(F))
            if kept:  # one taken under load serves this compile only, like on disk: held
                # for the process, it priced CSR for Cora above dense in every later compile
                _FORMAT_COSTS[(key, F)] = costs[F]
            else:  # and only for CSR (formats.choose): under load a fit of CSR's per-row
                # cost came out at 1.9 us instead of 5 ns, and Cora ran dense (4.45 ms a
                # run by the quiet costs, CSR 0.056)
                costs[F] = {**costs[F], BUSY_KEY: 1.0}
    return {str(F): costs[F] for F in set(widths)}


def _row_formats(fn, F: int, graphs: list, x, out, suffix: str) -> dict:
    """CSR and ELL costs per edge (ELL: slot, padding included) and per row, fitted to
    their times on two ``graphs`` (indptr, indices, w as tensors) of as many rows and
    different degrees."""
    import tvm

    from gcomp.runtime.formats import pack_ell
    calls, units = {}, {}
    for k, g in enumerate(graphs):
        indptr = g[0].numpy()
        calls[("csr", k)] = (fn[("csr", F)], (*g, x, out))
        units[("csr", k)] = int(indptr[-1])
        layout = pack_ell(indptr, g[1].numpy(), g[2].numpy())
        lay = [tvm.runtime.tensor(a, x.device) for a in layout]
        calls[("ell", k)] = (fn[("ell", F)], (*lay, g[0], x, out))
        units[("ell", k)] = layout[2].size  # cols: one per slot
    # differences of two times, so noise counts double: the four timed in turn, many
    # calls over 0.2 to 0.4 s, and a low percentile (other processes only ever make a
    # call slower)
    reps, span, q = (5, 0.4, 10) if suffix else (15, 0.2, 10)
    t = _times(calls, reps, span, q)
    costs = {}
    rows = graphs[0][0].shape[0] - 1
    for fmt in ("csr", "ell"):
        times = [t[(fmt, k)] for k in (0, 1)]
        unit = [units[(fmt, k)] for k in (0, 1)]
        per_unit = max(times[1] - times[0], 0.0) / (unit[1] - unit[0])
        costs[f"{fmt}_{'edge' if fmt == 'csr' else 'slot'}_ns{suffix}"] = per_unit * 1e9
        costs[f"{fmt}_row_ns{suffix}"] = max(times[0] - unit[0] * per_unit, 0.0) / rows * 1e9
    return costs


def _measure_formats(fn, F: int, block: int, rows: int, seed: int) -> dict:
    import tvm

    from gcomp.runtime.formats import layout_shape
    rng = np.random.default_rng(seed)
    dev = tvm.cpu()

    def graph(n: int, per_row: int, spread: int = block, mixed: bool = False):
        """``per_row`` in-edges per row (``mixed``: 1 .. 2 per_row - 1, as many on average:
        ELL then has rows of several buckets, out of order) from within ``spread`` rows."""
        deg = rng.integers(1, 2 * per_row, n) if mixed else np.full(n, per_row)
        dst = np.repeat(np.arange(n), deg)
        src = np.clip(dst + rng.integers(-spread, spread + 1, dst.size), 0, n - 1)
        indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
        w = rng.standard_normal((dst.size, 1)).astype(np.float32)
        return [tvm.runtime.tensor(a, dev) for a in (indptr, src.astype(np.int32), w)]

    def features(n: int):
        return (tvm.runtime.tensor(rng.standard_normal((n, F)).astype(np.float32), dev),
                tvm.runtime.empty((n, F), "float32", dev))

    g = graph(rows, 16)
    x, out = features(rows)
    few, many = graph(rows, 4), graph(rows, 32)
    costs = _row_formats(fn, F, [graph(rows, d, mixed=True) for d in (2, 32)], x, out, "")
    n = int(np.clip(LARGE_LAYOUT_BYTES // (4 * F), 1 << 14, GATHER_ROWS))
    big = [graph(n, d, spread=n, mixed=True) for d in (2, 8)]
    costs.update(_row_formats(fn, F, big, *features(n), "_large"))
    for fmt in ("dense", "banded"):
        large = (int(np.sqrt(LARGE_LAYOUT_BYTES / 4)) if fmt == "dense"
                 else LARGE_LAYOUT_BYTES // (12 * block))
        for n, suffix in ((rows, ""), (large, "_large")):
            shape = layout_shape(fmt, n, block)
            lay = tvm.runtime.empty(shape, "float32", dev)
            entries = float(np.prod(shape))
            sized = g if n == rows else graph(n, 4)
            pack = _median_time(fn[("pack", fmt)], (*sized, lay))
            if n == rows:  # the per-edge part, from 4 and 32 edges per row
                per_edge = max(_median_time(fn[("pack", fmt)], (*many, lay)) -
                               _median_time(fn[("pack", fmt)], (*few, lay)), 0.0) / (28 * rows)
                costs[f"pack_{fmt}_edge_ns"] = per_edge * 1e9
                pack -= 16 * rows * per_edge
            else:
                pack -= 4 * n * costs[f"pack_{fmt}_edge_ns"] * 1e-9
            costs[f"pack_{fmt}_entry_ns{suffix}"] = max(pack, 0.0) / entries * 1e9
            xs, outs = (x, out) if n == rows else features(n)
            costs[f"{fmt}_entry_ns{suffix}"] = _median_time(
                fn[(fmt, F)], (lay, sized[0], xs, outs), reps=3 if suffix else 5) / entries * 1e9
    return costs
