"""``gcomp explain``: what the compiler decided, and the numbers behind each decision.

Reads the decisions the passes recorded (``meta`` of the optimized graph) and the
plan, and, given a graph, the statistics the runtime decides by:

* fusion: each kernel that absorbed elementwise work, and the memory traffic that
  saves (bytes of the intermediates that are never written and read back);
* linear/aggregation order: each aggregation moved to the narrower side of a
  weight, with the aggregation work (edges x width) before and after;
* graph-static values computed once per bound graph instead of every run;
* sparse node features: the calibrated threshold (and its measurements), the
  graph's sparsity, and the variant that runs;
* adjacency formats: each format's per-unit costs measured on the target and, for
  the graph, the predicted time of its aggregations in each format (or why a
  format cannot hold it) and the one chosen;
* the graph: nodes, edges, degree distribution, and the memory plan.
"""

from __future__ import annotations

from math import prod

import numpy as np

from gcomp.errors import InputError
from gcomp.ir.graph import Graph
from gcomp.ir.ops import Op
from gcomp.ir.types import TensorType
from gcomp.runtime.formats import measured_busy
from gcomp.runtime.plan import kernel_kind


def _row_bytes(t: TensorType) -> int:
    return int(prod(d for d in t.shape[1:])) * 4


def _node_row(buf: dict) -> int:
    """Values per node row of a plan buffer whose first dimension is N."""
    return int(np.prod([d for d in buf["dims"][1:]], dtype=np.int64))


def explain(graph: Graph, plans: dict, graph_data=None, gpu: bool = False) -> dict:
    """A JSON-able report; ``plans`` maps "inference"/"training" to plans; ``gpu``: they
    are CUDA plans (the node order follows the GPU's rule)."""
    report: dict = {"model": graph.name, "fusion": [], "attention": [], "reorder": [],
                    "hoisted": [], "per_feed": [],
                    "sparse_features": [], "kernels": {},
                    "csc": False}  # whether a plan reads a graph's transposed arrays
    for n in graph:
        if "fused" in n.meta:
            members = [graph.node(m) for m in n.meta["fused"]]
            saved = [m for m in [n] + members[:-1] if m.op != Op.RESHAPE]
            report["fusion"].append({
                "kernel": f"{n.op.value} %{n.name}",
                "absorbs": [f"{m.op.value} %{m.name}" for m in members],
                "bytes_saved_per_row": sum(2 * _row_bytes(m.ty) for m in saved
                                           if isinstance(m.ty, TensorType)),
            })
        if n.op == Op.ATTENTION_AGGREGATE:
            heads = int(n.inputs[2].ty.shape[1])
            report["attention"].append({
                "kernel": f"attention_aggregate %{n.name}", "replaces": n.meta.get("replaces", []),
                "edge_bytes_saved_per_edge": 4 * heads * len(n.meta.get("replaces", []))})
        if "reorder" in n.meta:
            r = n.meta["reorder"]
            report["reorder"].append({"aggregate": f"%{n.name}", **r,
                                      "work_ratio": r["width_after"] / r["width_before"]})
        if n.meta.get("phase") == "bind" and n.op not in (Op.INPUT, Op.CONST):
            report["hoisted"].append(f"{n.op.value} %{n.name}")
        if n.meta.get("phase") == "feed" and n.op not in (Op.INPUT, Op.CONST):
            report["per_feed"].append(f"{n.op.value} %{n.name}")
    for label, plan in plans.items():
        if plan is None:
            continue
        report["kernels"][label] = {"kernels": len(plan.kernels()), "run_steps": len(plan.steps),
                                    "bind_steps": len(plan.bind_steps),
                                    "feed_steps": len(plan.feed_steps)}
        if plan.formats:
            report["format_costs"] = plan.formats["costs"]
        if plan.precision:
            stored = plan.precision["bfloat16"]
            report.setdefault("precision", {})[label] = {
                "bfloat16": stored, "kept_float32": plan.precision["kept_float32"],
                "bytes_per_node_saved": sum(2 * _node_row(plan.buffers[b]) for b in stored)}
        if plan.loss_rows:  # codegen/loss_rows.py
            report["loss_rows"] = {
                "steps": [f"{s['op']} %{s['node']}" for s in plan.steps if s.get("rows")],
                "out_edges": [f"{s['op']} %{s['node']}" for s in plan.steps
                              if any(a.get("rows") and a["array"].startswith("csc_")
                                     for a in s["args"] if "graph" in a)],
                "zeroed": [f"%{s['node']}" for s in plan.steps if s.get("tail")]}
        backward = [f"{s['op']} %{s['node']}" for s in plan.steps
                    if s["op"] in ("attention_grad_dst", "attention_grad_src")]
        if backward:
            report["attention_backward"] = backward
        over_out = {"scatter": 0, "gather": 0}  # aggregations over out-edges
        for s in plan.bind_steps + plan.feed_steps + plan.steps:
            graph_arrays = [a["array"] for a in s["args"] if "graph" in a]
            kind = kernel_kind(s["kernel"])
            if kind == "csr_scatter":
                over_out["scatter"] += 1
            elif kind == "csr_agg" and graph_arrays[:1] == ["csc_indptr"]:
                over_out["gather"] += 1
            report["csc"] = report["csc"] or any(a.startswith("csc_") for a in graph_arrays)
        if any(over_out.values()):
            report.setdefault("out_edges", {})[label] = over_out
        for key, v in plan.variants.items():
            entry = {"plan": label, "variant": key, "threshold": v.get("threshold"),
                     "calibration": v.get("calibration", [])}
            if "sources" in v:  # values computed from the features: measured once fed
                entry["computed_from"] = v["sources"]
            report["sparse_features"].append(entry)
    if graph_data is not None:
        report["graph"] = graph_stats(graph_data)
        from gcomp.runtime.executor import decide_layout
        plan = plans.get("training") or plans["inference"]
        mask = None
        if plan.loss_rows and graph_data.y is not None:
            from gcomp.runtime.trainer import masks_of
            try:
                mask = masks_of(graph_data)[0]
            except InputError:  # no labelled training node: the graph cannot train
                pass
            else:
                report["loss_rows"]["mask_nodes"] = int(mask.sum())
        layout = decide_layout(plan, graph_data, gpu=gpu, loss_rows=mask)
        if mask is not None:
            report["loss_rows"]["rows"] = layout.sizes["L"]
        report["reorder_nodes"] = layout.reorder
        report["formats"] = layout.formats
        for entry in report["sparse_features"]:
            if "computed_from" in entry:
                continue
            s = report["graph"]["feature_sparsity"]
            entry["graph_sparsity"] = s
            entry["chosen"] = "sparse" if (s is not None and entry["threshold"] is not None
                                           and s >= entry["threshold"]) else "dense"
        for r in report["reorder"]:
            e = report["graph"]["edges"]
            r["edge_work_before"] = e * r["width_before"]
            r["edge_work_after"] = e * r["width_after"]
    return report


def graph_stats(g) -> dict:
    from gcomp.runtime.features import sparsity
    deg = np.bincount(g.edge_index[1], minlength=g.num_nodes)
    out_deg = np.bincount(g.edge_index[0], minlength=g.num_nodes)
    return {
        "name": g.name, "nodes": g.num_nodes, "edges": g.num_edges,
        "in_degree": {"mean": float(deg.mean()) if g.num_nodes else 0.0,
                      "max": int(deg.max()) if g.num_nodes else 0,
                      "p99": float(np.percentile(deg, 99)) if g.num_nodes else 0.0,
                      # no edge in either direction (a node that only sends is not)
                      "isolated": int(((deg == 0) & (out_deg == 0)).sum())},
        "self_loops": int((g.edge_index[0] == g.edge_index[1]).sum()),
        "density": g.num_edges / max(1, g.num_nodes) ** 2,
        "feature_sparsity": None if g.x is None else sparsity(g.x),
    }


def render(report: dict) -> str:
    lines = [f"model {report['model']}"]
    lines.append("fusion (one kernel each; intermediates never written to memory):")
    for f in report["fusion"] or [{"kernel": "none"}]:
        if "absorbs" in f:
            lines.append(f"  {f['kernel']} + {', '.join(f['absorbs'])}: saves "
                         f"{f['bytes_saved_per_row']} bytes of traffic per row")
        else:
            lines.append("  none")
    for a in report["attention"]:
        lines.append(f"  {a['kernel']}: scores, softmax and sum per destination, replacing "
                     f"{', '.join(a['replaces'])}: {a['edge_bytes_saved_per_edge']} bytes per "
                     f"edge never written")
    if report.get("attention_backward"):
        lines.append("  training: attention's backward fused too, no edge tensor: "
                     + ", ".join(report["attention_backward"]))
    lines.append("aggregation on the narrower side of a weight (edge work ~ edges x width):")
    for r in report["reorder"] or [None]:
        if r is None:
            lines.append("  none")
            continue
        extra = (f" = {r['edge_work_before']:,} -> {r['edge_work_after']:,} edge-features"
                 if "edge_work_before" in r else "")
        if r.get("hoisted"):
            extra = (f"; computed once per feed of the features, not in every training step"
                     f"{': ' + format(r['edge_work_after'], ',') + ' edge-features' if extra else ''}")
        lines.append(f"  {r['aggregate']}: width {r['width_before']} -> {r['width_after']}"
                     f" (x{r['work_ratio']:.2f}){extra}")
    for label, o in report.get("out_edges", {}).items():
        lines.append(f"aggregations over out-edges ({label}): "
                     + "; ".join(what for what, k in (
                         (f"{o['gather']} gathers over the transposed graph (CSC; deterministic)",
                          o["gather"]),
                         (f"{o['scatter']} scatters over the forward CSR with atomic adds (no "
                          "transposed graph; not bit for bit reproducible)", o["scatter"])) if k))
    lines.append("computed once per bound graph (hoisted): " +
                 (", ".join(report["hoisted"]) or "none"))
    if report["per_feed"]:
        lines.append("computed once per feed of the node inputs: " + ", ".join(report["per_feed"]))
    for s in report["sparse_features"]:
        table = "; ".join(f"{c['sparsity']:.2f}: dense {c['dense_ms']:.2f} ms / sparse "
                          f"{c['sparse_ms']:.2f} ms" for c in s["calibration"] if "sparsity" in c)
        notes = "".join(f" ({c['note']})" for c in s["calibration"] if "note" in c)
        line = (f"sparse node features ({s['plan']}, {s['variant']}): threshold "
                f"{s['threshold']}; calibration {table or 'none'}{notes}")
        if "computed_from" in s:
            line += (f"; values computed from {', '.join(s['computed_from'])}: their sparsity "
                     "is measured when they are fed")
        elif s.get("graph_sparsity") is not None:
            line += f"; this graph: sparsity {s['graph_sparsity']:.4f} -> {s['chosen']} kernels"
        elif "chosen" in s:
            line += "; this graph has no features (they are given when it runs)"
        lines.append(line)
    for label, p in report.get("precision", {}).items():
        kept = "; ".join(f"{b} ({why})" for b, why in p["kept_float32"].items()) or "none"
        lines.append(f"storage ({label}): {len(p['bfloat16'])} node-sized values in bfloat16, "
                     f"{p['bytes_per_node_saved']:,} bytes per node saved; kept float32: {kept}")
    for label, k in report["kernels"].items():
        lines.append(f"{label}: {k['kernels']} kernels, {k['run_steps']} steps per run, "
                     f"{k['bind_steps']} once per graph, {k['feed_steps']} once per feed")
    if "loss_rows" in report:
        lr = report["loss_rows"]
        rows = (f"this graph: {lr['rows']:,} of {report['graph']['nodes']:,} rows (its training "
                f"mask's {lr['mask_nodes']:,} nodes, numbered first)" if "rows" in lr else
                "the training mask's nodes, numbered first when a graph is bound")
        if lr.get("rows") == report.get("graph", {}).get("nodes") and "rows" in lr:
            rows += "; every row, since an aggregation runs in another format than CSR"
        lines.append(f"training steps on the rows the loss reads ({rows}): "
                     f"{len(lr['steps'])} steps ({', '.join(lr['steps']) or 'none'}); "
                     f"{len(lr['out_edges'])} backward aggregations walk only the edges into "
                     f"those rows; gradients zeroed past them: {', '.join(lr['zeroed']) or 'none'}")
    if "reorder_nodes" in report:
        r = report["reorder_nodes"]
        dist = ", ".join(f"{k} {v:,.0f}" for k, v in r["mean_distance"].items())
        basis = (f"working set {r['working_set_bytes'] / 2**20:.1f} MiB vs cache "
                 f"{r['cache_bytes'] / 2**20:.0f} MiB" if "cache_bytes" in r else
                 f"GPU, degrees' CV {r['degree_cv']:.1f}" if "degree_cv" in r else "GPU")
        lines.append(f"node order: {r['chosen']} ({basis}; mean gather distance in "
                     f"rows: {dist}{'; ' + r['reason'] if 'reason' in r else ''})")
    if "format_costs" in report:
        costs = "; ".join(f"{w} features: csr {c['csr_edge_ns']:.2f} ns/edge + "
                          f"{c['csr_row_ns']:.2f} ns/row, ell {c['ell_slot_ns']:.2f} ns/slot + "
                          f"{c['ell_row_ns']:.2f} ns/row, dense {c['dense_entry_ns']:.2f} "
                          f"ns/entry, banded {c['banded_entry_ns']:.2f} ns/entry"
                          for w, c in sorted(report["format_costs"].items(),
                                             key=lambda kv: int(kv[0])))
        busy = measured_busy(report["format_costs"])
        lines.append(f"adjacency format costs measured on the target"
                     f"{' (while the machine was busy)' if busy else ''}: {costs}")
    for gname, f in report.get("formats", {}).items():
        est = ", ".join(f"{k} {v:.3f} ms" for k, v in f["cost_ms"].items())
        why = "".join(f"; no {k}: {v}" for k, v in f["why_not"].items())
        if "ell_slots" in f:
            why += "; ELL slots " + ", ".join(f"{k} {v:,}" for k, v in f["ell_slots"].items())
        if "banded_narrowest_ms" in f:
            why += (f"; banded in the narrowest band ({f['narrowest_block']}-row blocks) "
                    f"{f['banded_narrowest_ms']:.3f} ms")
        if "csr_because" in f:
            why += f"; csr since {f['csr_because']}"
        lines.append(f"format of {gname} ({f['steps']} aggregations; band blocks of "
                     f"{f['block']} rows): {f['chosen']} (predicted per run: {est}{why})")
    if "graph" in report:
        g = report["graph"]
        d = g["in_degree"]
        lines.append(f"graph {g['name']}: {g['nodes']:,} nodes, {g['edges']:,} edges, in-degree "
                     f"mean {d['mean']:.2f} max {d['max']} p99 {d['p99']:.0f}, {d['isolated']} "
                     f"isolated, {g['self_loops']} self loops, density {g['density']:.2e}; "
                     "CSR by destination"
                     + (" (+ CSC for backward passes)" if report.get("csc") else ""))
    return "\n".join(lines)

