"""Hub-row splitting for the GPU's aggregations (a plan rewrite for ``-t cuda``).

Expects: plans from ``lower`` and their kernel specs.
Guarantees: every ``csr_agg`` or ``csr_scatter`` step over a graph value (not over sparse
node features) and every step of GAT's fused attention (``attention_agg``,
``attention_grad_dst``, ``attention_grad_src``) calls the split form of its kernel
(``split=True``, in ``aggregate_kernel`` and ``scatter_kernel``) with the graph's
``hub_tasks`` and ``hub_rows`` arrays (``csc_`` ones for a kernel over out-edges)
inserted before its output, so the output stays the
last argument and the positions of its other arguments (``in_place``) do not move.

Why: the GPU schedule gives each output row to one thread per feature, which walks the
row's edges in order.  On power-law graphs one row can hold 2% of all edges (arxiv-size:
22,897 of 1.17M); its warp then runs 180 times longer than the average and the whole
aggregation waits for it (2.2 ms on an H100 against cuSPARSE's 0.16 ms).  The split
cuts such rows into tasks of ``graph.task_edges`` edges reduced in parallel.  The CPU
schedules balance rows across threads by edges already (``cpu_kernels._row_range``).
Attention is hit hardest: one thread per (row, head) walked a hub's 22,752 out-edges in
``attention_grad_src`` (40 ms per call on an H100, a 193 ms GAT epoch).
"""

from __future__ import annotations

from gcomp.codegen.kernels import KernelSpec

SPLIT_KINDS = ("csr_agg", "csr_scatter", "attention_agg", "attention_grad_dst",
               "attention_grad_src")


def split_hub_rows(plans, specs: dict) -> None:
    for p in plans:
        if p is None:
            continue
        for s in p.bind_steps + p.feed_steps + p.steps:
            spec = specs[s["kernel"]]
            head = s["args"][0]
            if spec.kind not in SPLIT_KINDS or "graph" not in head or spec.p.get("split"):
                continue
            pre = "csc_" if head["array"].startswith("csc_") else ""
            split = KernelSpec.make(spec.kind, **spec.p, split=True)
            specs[split.name] = split
            s["kernel"] = split.name
            s["args"] = s["args"][:-1] + [{"graph": head["graph"], "array": pre + "hub_tasks"},
                                          {"graph": head["graph"], "array": pre + "hub_rows"},
                                          s["args"][-1]]
