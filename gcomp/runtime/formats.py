"""The adjacency format of each graph value, chosen by a cost model when a graph is bound.

Aggregation steps that the compiler gave dense, banded and ELL kernels
(``step["formats"]``, ``gcomp/codegen/format_kernels.py``) run in the format the
model predicts fastest for the bound graph, if it beats CSR by ``MARGIN`` (and ELL by
``ELL_MIN_GAIN_MS`` per run), and in CSR where the costs were measured on a busy
machine:

* ``csr``: one gathered source row per edge; cost ``edges x c_csr_edge + n x c_csr_row``
  (costs in cache, or ``_large`` when the feature rows an edge's gather reaches, twice the
  mean distance between its ends, exceed ``GATHER_CACHE_BYTES``).
* ``dense``: A as an n x n matrix; cost ``n^2 x c_dense``.  Only while the
  matrix takes at most ``DENSE_MAX_BYTES``.
* ``ell``: ELL buckets by degree (``format_kernels._ell_agg``); cost
  ``slots x c_ell_slot + n x c_ell_row``, the slots being each row's degree rounded up to a
  power of two.  A and A.T have a layout each, packed once per bound graph
  (``pack_ell``), so only for weights fixed for the graph.
* ``banded``: block tridiagonal in blocks of B rows; cost ``n x 3B x c_band``.
  B is the graph's bandwidth (the largest |src - dst|) rounded up to a multiple
  of 8, so every edge joins rows at most one block apart; while the band takes
  at most ``BAND_MAX_BYTES``.  When a band as narrow as the degrees allow
  (bandwidth >= half the largest degree) would be the fastest format, the
  executor tries reverse Cuthill-McKee to narrow it (``gcomp/runtime/reorder.py``).

The per-unit costs ``c_*`` (ns, per feature width; for dense and banded, one
for a layout in cache and one for a layout over a quarter of ``CACHE_BYTES``,
which shares the cache with the features) are measured on the target when the
model is compiled (``gcomp/codegen/calibrate.py``) and stored in the plan.  A
format's layout is packed from the CSR arrays and the edge weights once per bound
graph when the weights are fixed for it (no weights, or weights computed when
binding, like GCN's normalization); weights computed on every run are packed on
every run, and the model adds that cost.  One format serves every
step over a graph value (dense and banded forward and backward share the packed layout).
"""

from __future__ import annotations

import numpy as np

from gcomp.errors import InputError
from gcomp.runtime.reorder import CACHE_BYTES, edge_gaps, symmetric_pattern

FORMATS = ("csr", "dense", "banded", "ell")
MODES = ("auto",) + FORMATS
DENSE_MAX_BYTES = 256 << 20
BAND_MAX_BYTES = 1 << 30
GROUP = 8  # block sizes are multiples of the kernels' row group (format_kernels.GROUP)
ELL_MAX_BYTES = 1 << 30
MARGIN = 0.8  # another format must be predicted this much faster than CSR: the per-unit
# costs come from a shared machine and from graphs other than the one bound (ELL's padded
# slots, measured 13% cheaper than CSR on batched molecules, ran 20% slower)
ELL_MIN_GAIN_MS = 0.1  # ELL adds two layouts to the working set and arguments to each
# call, which its per-kernel costs do not see: on Cora (0.04 ms predicted gain per run)
# a training epoch ran 0.1 ms slower than in CSR
GATHER_CACHE_BYTES = 1 << 20  # a core's own cache (L2) on the machines gcomp was tuned on
ELL_PARTS = 256  # parallel units of about equal slots (format_kernels._ell_agg)
BUSY_KEY = "measured_busy"  # in the costs of a width measured on a busy machine


def _round_up(v: int) -> int:
    return max(GROUP, -(-int(v) // GROUP) * GROUP)


def band_block(edge_index: np.ndarray, position: np.ndarray | None = None) -> int:
    """The block size of the banded format in this node order (or with node v at row
    ``position[v]``): the bandwidth (largest |src - dst|) rounded up to a multiple of
    GROUP.  Edges then join rows at most one block apart: |i - j| <= B implies
    |i // B - j // B| <= 1."""
    if edge_index.shape[1] == 0:
        return GROUP
    return _round_up(max(int(gap.max()) for gap in
                         edge_gaps(edge_index[0], edge_index[1], position)))


def narrowest_block(edge_index: np.ndarray, num_nodes: int, pattern=None) -> int:
    """A lower bound on the block size any node order can give: a node with d distinct
    neighbours (either direction) needs bandwidth >= d / 2.  ``pattern``: the graph's
    ``reorder.symmetric_pattern``, if made."""
    if pattern is None:
        pattern = symmetric_pattern(edge_index, num_nodes)
    distinct = np.diff(pattern.indptr) - pattern.diagonal()  # a self loop is no neighbour
    if distinct.size == 0:
        return GROUP
    return _round_up((int(distinct.max()) + 1) // 2)


def layout_shape(fmt: str, n: int, block: int) -> tuple:
    return (n, n) if fmt == "dense" else ((n + block - 1) // block, 3, block, block)


def ell_buckets(indptr: np.ndarray) -> np.ndarray:
    """The ELL bucket of each row: 0 without edges, else k >= 1 with 2^(k-2) < degree
    <= 2^(k-1), the row padded to 2^(k-1) slots."""
    deg = np.diff(indptr)
    _, bits = np.frexp((deg - 1).clip(0).astype(np.float64))  # bit length of degree - 1
    return np.where(deg > 0, bits + 1, 0).astype(np.int64)


def ell_widths(bucket: np.ndarray) -> np.ndarray:
    """The slots of each row in ELL bucket ``bucket`` (``ell_buckets``)."""
    return np.where(bucket > 0, np.left_shift(1, (bucket - 1).clip(0)), 0)


def ell_slots(indptr: np.ndarray) -> int:
    """Slots of the ELL layout of a CSR (or CSC) graph: each row's degree rounded up to a
    power of two."""
    return int(ell_widths(ell_buckets(indptr)).sum())


def pack_ell(indptr: np.ndarray, indices: np.ndarray, w: np.ndarray | None,
             parts: int = ELL_PARTS) -> tuple[np.ndarray, ...]:
    """(work, perm, cols, vals): the ELL-bucket layout ``format_kernels._ell_agg`` reads,
    from CSR (or, for A.T, CSC) arrays and one weight per edge in that order (None: ones).
    Rows are ordered by bucket (stable); a padding slot repeats the row's last
    neighbour with value 0.  ``work`` cuts each bucket into units of about
    slots / ``parts`` slots: (bucket, first position, end position, first slot)."""
    n = indptr.shape[0] - 1
    bucket = ell_buckets(indptr)
    width = ell_widths(bucket)
    perm = np.argsort(bucket, kind="stable")
    pw = width[perm]
    start = np.zeros(n + 1, np.int64)
    np.cumsum(pw, out=start[1:])
    slots = int(start[-1])
    pos = np.repeat(np.arange(n), pw)  # the position of each slot
    t = np.arange(slots) - start[pos]
    row = perm[pos]
    deg = indptr[row + 1] - indptr[row]
    edge = indptr[row] + np.minimum(t, deg - 1)
    cols = indices[edge].astype(np.int32)
    vals = (w.reshape(-1)[edge] if w is not None else np.ones(slots, np.float32))
    vals = np.where(t < deg, vals, 0).astype(np.float32)
    goal = max(slots // parts, 64)
    work = []
    ordered = bucket[perm]
    for k in np.unique(bucket):
        first, end = np.searchsorted(ordered, [k, k + 1])
        per = max(1, goal // max(int(width[perm[first]]), 1)) if k > 0 else max(1, n // parts)
        for p0 in range(int(first), int(end), per):
            work.append((int(k), p0, min(p0 + per, int(end)), int(start[p0])))
    work = np.array(work, np.int64).reshape(-1, 4)
    return work, perm.astype(np.int32), cols, vals


def graph_sizes(plan, structures: dict) -> dict[str, int]:
    """What the cost model reads of each graph value besides its edges: the mean distance
    in rows between an edge's ends (``GAP:<graph>``: how far its gathers reach), and the
    slots of the ELL layouts its ELL-offering steps would read, by direction
    (``ELL:<graph>:forward`` / ``:transposed``)."""
    sizes = {}
    for gname, steps in format_steps(plan).items():
        st = structures[gname]
        sizes[f"GAP:{gname}"] = sum(int(gap.sum()) for gap in
                                    edge_gaps(st.rows, st.indices)) // max(st.num_edges, 1)
        if "ell" not in steps[0]["formats"]["kernels"]:
            continue
        if any(s["formats"]["transpose"] for s in steps):
            sizes[f"ELL:{gname}:transposed"] = ell_slots(st.array("csc_indptr"))
        if not all(s["formats"]["transpose"] for s in steps):
            sizes[f"ELL:{gname}:forward"] = ell_slots(st.indptr)
    return sizes


def format_steps(plan) -> dict[str, list[dict]]:
    """Run steps offering other formats, by the graph value they aggregate over."""
    by_graph: dict[str, list[dict]] = {}
    for s in plan.steps:
        if "formats" in s:
            by_graph.setdefault(s["formats"]["graph"], []).append(s)
    return by_graph


def dynamic_weights(plan) -> set[str]:
    """Buffers a run or feed step writes (its last argument), or views of them: weights
    there change every run (or every feed), not once per bound graph."""
    def root(b):
        return plan.buffers.get(b, {}).get("alias", b)
    written = {root(s["args"][-1]["buf"]) for s in plan.steps + plan.feed_steps
               if "buf" in s["args"][-1]}
    return {b for b in plan.buffers if root(b) in written}


def measured_busy(costs: dict) -> bool:
    """Whether format costs (``plan.formats["costs"]``) were measured on a busy machine
    (``BUSY_KEY``, set by ``codegen/calibrate.py``): too unreliable to leave CSR for,
    which every graph runs well enough."""
    return any(BUSY_KEY in c for c in costs.values())


def _costs(plan, width: int) -> dict:
    table = plan.formats["costs"]
    if str(width) in table:
        return table[str(width)]
    near = min(table, key=lambda w: abs(int(w) - width))  # per-feature costs scale with width
    return {k: v * width / int(near) for k, v in table[near].items()}


def estimate(plan, steps: list[dict], n: int, edges: int, fmt: str, block: int,
             dynamic: set[str], ell: dict | None = None, gap: int | None = None) -> float:
    """Predicted ms per run of ``steps`` (over one graph value) in ``fmt``; ``ell``: the
    slots of the ELL layouts of A (``forward``) and A.T (``transposed``); ``gap``: the
    mean distance in rows between an edge's ends (None: as far as the graph allows)."""
    total = 0.0
    if fmt in ("csr", "ell"):  # per edge (ELL: slot, padding included) and per row
        for s in steps:
            width = s["formats"]["width"]
            c = _costs(plan, width)
            # gathers miss a core's own cache when the rows they reach do not fit in it
            reach = n if gap is None else min(n, 2 * gap + 1)
            size = "_large" if reach * width * 4 > GATHER_CACHE_BYTES else ""
            units = edges if fmt == "csr" else \
                ell["transposed" if s["formats"]["transpose"] else "forward"]
            unit = "edge" if fmt == "csr" else "slot"
            # plans compiled before the row and large costs were measured lack them
            total += (units * c.get(f"{fmt}_{unit}_ns{size}", c[f"{fmt}_{unit}_ns"]) +
                      n * c.get(f"{fmt}_row_ns{size}", c.get(f"{fmt}_row_ns", 0.0)))
        return total * 1e-6
    packed = set()
    entries = n * n if fmt == "dense" else layout_shape(fmt, n, block)[0] * 3 * block * block
    # streamed from memory: the layout shares the cache with the features it multiplies
    size = "_large" if entries * 4 > CACHE_BYTES // 4 else ""
    for s in steps:
        c = _costs(plan, s["formats"]["width"])
        total += entries * c[f"{fmt}_entry_ns{size}"]
        w = s["formats"]["weights"]
        if w is not None and w["buf"] in dynamic and w["buf"] not in packed:
            packed.add(w["buf"])
            total += entries * c[f"pack_{fmt}_entry_ns{size}"] + edges * c[f"pack_{fmt}_edge_ns"]
    return total * 1e-6


def feasible(fmt: str, n: int, block: int, ell: dict | None = None) -> str | None:
    """None when ``fmt`` can hold the graph in memory, else why not."""
    if fmt == "ell" and ell is not None and sum(ell.values()) * 8 > ELL_MAX_BYTES:
        return f"ELL layouts of {sum(ell.values()):,} slots exceed {ELL_MAX_BYTES >> 20} MiB"
    if fmt == "dense" and n * n * 4 > DENSE_MAX_BYTES:
        return f"a dense matrix of {n}^2 floats exceeds {DENSE_MAX_BYTES >> 20} MiB"
    if fmt == "banded" and n * 3 * block * 4 > BAND_MAX_BYTES:
        return f"a band of {block}-row blocks exceeds {BAND_MAX_BYTES >> 20} MiB"
    return None


def choose(plan, sizes: dict[str, int], block: int, narrowest: int | None = None,
           mode: str = "auto") -> tuple[dict, dict]:
    """({graph value: format}, report) for a graph of ``sizes`` (``N``, ``E:<graph>``,
    ``GAP:<graph>``, ``ELL:<graph>:forward`` / ``:transposed``: ``graph_sizes``)
    whose band in the current order needs blocks of ``block`` rows; ``narrowest``: the
    block no order can beat, to predict whether reordering into a band would pay."""
    if mode not in MODES:
        raise InputError(f"unknown format {mode!r}; formats: {', '.join(MODES)}")
    chosen, report = {}, {}
    n = sizes["N"]
    dynamic = dynamic_weights(plan)
    busy = measured_busy(plan.formats["costs"])
    for gname, steps in format_steps(plan).items():
        edges = sizes[f"E:{gname}"]
        offered = ["csr"] + [f for f in FORMATS[1:] if f in steps[0]["formats"]["kernels"]]
        entry = {"steps": len(steps), "block": block, "cost_ms": {}, "why_not": {}}
        ell = None
        if "ell" in offered:
            ell = {d: sizes[f"ELL:{gname}:{d}"] for d in ("forward", "transposed")
                   if f"ELL:{gname}:{d}" in sizes}
            entry["ell_slots"] = ell
        for fmt in offered:
            why = feasible(fmt, n, block, ell)
            if fmt == "ell" and any(s["formats"]["weights"] is not None and
                                    s["formats"]["weights"]["buf"] in dynamic for s in steps):
                why = "its edge weights change every run (ELL is packed once per bound graph)"
            if why is None:
                entry["cost_ms"][fmt] = estimate(plan, steps, n, edges, fmt, block, dynamic,
                                                 ell, sizes.get(f"GAP:{gname}"))
            else:
                entry["why_not"][fmt] = why
        if "banded" in offered and narrowest is not None and narrowest < block \
                and feasible("banded", n, narrowest) is None:
            entry["narrowest_block"] = narrowest
            entry["banded_narrowest_ms"] = estimate(plan, steps, n, edges, "banded", narrowest,
                                                    dynamic)
        if mode == "auto" and busy:
            fmt = "csr"
            entry["csr_because"] = ("the format costs were measured while other processes "
                                    "kept the machine busy; --format picks another")
        elif mode == "auto":
            fmt = min(entry["cost_ms"], key=entry["cost_ms"].get)
            gain = entry["cost_ms"]["csr"] - entry["cost_ms"][fmt]
            if fmt != "csr" and (gain < (1 - MARGIN) * entry["cost_ms"]["csr"]
                                 or fmt == "ell" and gain < ELL_MIN_GAIN_MS):
                fmt = "csr"
        else:
            if mode not in offered:
                raise InputError(f"format {mode!r} is not compiled into this plan "
                                 f"(it offers {', '.join(offered)})")
            if mode in entry["why_not"]:
                raise InputError(f"graph value {gname!r} cannot run as {mode}: "
                                 f"{entry['why_not'][mode]}")
            fmt = mode
        entry["chosen"] = chosen[gname] = fmt
        report[gname] = entry
    return chosen, report


def band_would_pay(report: dict, mode: str) -> bool:
    """Whether narrowing the band by reordering the nodes is worth trying: the banded format
    is wanted (``mode``), or in the narrowest band it would beat the current choice."""
    for entry in report.values():
        if "banded_narrowest_ms" not in entry or mode != "banded" and "csr_because" in entry:
            continue
        if mode == "banded" or entry["banded_narrowest_ms"] < min(entry["cost_ms"].values(),
                                                                  default=float("inf")):
            return True
    return False
