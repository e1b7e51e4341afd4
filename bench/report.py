"""Results: speed-up ratios, the JSON record, the markdown table and the bar chart."""

from __future__ import annotations

import json
from pathlib import Path

from bench.runner import CONFIGS


def ok(c: dict | None) -> bool:
    return bool(c) and c.get("status") == "ok" and "median_s" in c


def add_ratios(entry: dict) -> None:
    """Speed-up of gcomp over each peer configuration and over each peer's best one
    (the configuration with the lowest median, among those that ran)."""
    cfgs = entry["configs"]
    best = {}
    for c, r in cfgs.items():
        peer = CONFIGS[c]
        if peer != "gcomp" and ok(r) and (peer not in best or
                                          r["median_s"] < cfgs[best[peer]]["median_s"]):
            best[peer] = c
    entry["best"] = best
    g = cfgs.get("gcomp")
    if not ok(g):
        entry["speedup"] = {}
        return
    sp = {c: r["median_s"] / g["median_s"] for c, r in cfgs.items() if c != "gcomp" and ok(r)}
    sp.update({f"best-{p}": cfgs[c]["median_s"] / g["median_s"] for p, c in best.items()})
    entry["speedup"] = sp


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")


def save(out: Path, name: str, stamp, results: dict, md: str) -> None:
    """``out/<name>-<UTC stamp>.json`` and ``out/<name>-latest.md``; prints the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out / f"{name}-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json")
    (out / f"{name}-latest.md").write_text(md)
    print(md)


def _ms(r: dict | None) -> str:
    if not r:
        return "-"
    if ok(r):
        return f"{r['median_s'] * 1e3:,.1f}"
    return "skipped" if r.get("status") == "skipped" else r.get("status", "-")


def markdown(results: dict) -> str:
    configs = results["configs"]
    peers = [p for p in dict.fromkeys(CONFIGS[c] for c in configs) if p != "gcomp"]
    prot = results["protocol"]
    prec = results.get("precision", "fp32")
    out = [f"# gcomp vs PyG / DGL: {results['mode']}"
           + (f" (gcomp's activations in {prec}; the peers in fp32)" if prec != "fp32" else "")
           + (" (gcomp compiled with `--prefer memory`)"
              if results.get("prefer", "speed") == "memory" else ""),
           "",
           f"{results['date_utc']} -- `{results['command']}`  ",
           f"{results['machine']['cpu_model']}, {results['machine']['cores_available']} cores, "
           f"{results['machine']['memory_gib']} GiB; threads = {results['threads']} for every "
           f"system; median of {prot['reps']} alternating repetitions after {prot['warmup']} "
           "warm-ups, one process.  ",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), ""]
    for gname in dict.fromkeys(e["graph"] for e in results["workloads"]):
        ents = [e for e in results["workloads"] if e["graph"] == gname]
        d = ents[0]["workload"]
        heads = [e["workload"]["heads"] for e in ents if e["workload"]["heads"]]
        out += [f"## {gname} ({d['nodes']:,} nodes, {d['edges']:,} edges, {d['features']} "
                f"features, {d['classes']} classes; {d['layers']} layers, hidden {d['hidden']}"
                f"{', GAT heads %d' % heads[0] if heads else ''})", "",
                "Median ms per " + ("forward" if results["mode"] == "inference" else "epoch")
                + "; speed-up = peer median / gcomp median (> 1: gcomp faster).", "",
                "| model | " + " | ".join(configs) + " | " +
                " | ".join(f"gcomp vs best {p}" for p in peers) + " |",
                "|---" * (1 + len(configs) + len(peers)) + "|"]
        for e in ents:
            cells = [_ms(e["configs"].get(c)) for c in configs]
            sp = [f"{e['speedup'][f'best-{p}']:.2f}x ({e['best'][p]})"
                  if f"best-{p}" in e["speedup"] else "-" for p in peers]
            out.append(f"| {e['model']} | " + " | ".join(cells + sp) + " |")
        loads = [x for e in ents for x in e.get("other_cpu_cores_per_rep", []) if x is not None]
        nd = sum(len(e.get("discarded_rounds", [])) for e in ents)
        if loads:
            out += ["", f"CPU used by other processes during kept rounds: median "
                    f"{sorted(loads)[len(loads) // 2]:.2f}, max {max(loads):.2f} cores; "
                    f"{nd} round(s) discarded and redone because the machine was busy."]
        if any(e["speedup"] for e in ents):
            out += ["", "Speed-up of gcomp over each configuration:", "",
                    "| model | " + " | ".join(c for c in configs if c != "gcomp") + " |",
                    "|---" * len(configs) + "|"]
            for e in ents:
                out.append(f"| {e['model']} | " + " | ".join(
                    f"{e['speedup'][c]:.2f}x" if c in e["speedup"] else "-"
                    for c in configs if c != "gcomp") + " |")
        out += ["", "Peak RSS MB in a fresh process (extra over a process that only imported "
                "the libraries):", "", "| model | " + " | ".join(configs) + " |",
                "|---" * (1 + len(configs)) + "|"]
        for e in ents:
            cells = []
            for c in configs:
                m = (e["configs"].get(c) or {}).get("memory")
                cells.append(f"{m['peak_rss_mb']:,.0f} (+{m['extra_mb']:,.0f})"
                             if m and m.get("status") == "ok" else (m or {}).get("status", "-"))
            out.append(f"| {e['model']} | " + " | ".join(cells) + " |")
        out += ["", "One-time costs (s) and output check (max relative difference to gcomp"
                + ("'s float32 forward" if prec != "fp32" else "") + "):", "",
                "| model | gcomp compile / bind | torch.compile first call | max rel. diff |",
                "|---|---|---|---|"]
        for e in ents:
            gs = (e["configs"].get("gcomp") or {}).get("setup_s", {})
            pc = (e["configs"].get("pyg-compile") or {}).get("setup_s", {})
            gcell = f"{gs['compile_s']:.2f} / {gs['bind_s']:.3f}" if "compile_s" in gs else "-"
            pcell = f"{pc['compile_s']:.1f}" if "compile_s" in pc else "-"
            diffs = ", ".join(f"{c} {r['max_rel_diff']:.1e}" for c, r in e["configs"].items()
                              if r.get("max_rel_diff") is not None
                              and (c != "gcomp" or prec != "fp32"))
            out.append(f"| {e['model']} | {gcell} | {pcell} | {diffs} |")
        out.append("")
    notes = []
    for e in results["workloads"]:
        for c, r in e["configs"].items():
            if r.get("status") != "ok":
                notes.append(f"- {e['graph']}/{e['model']} {c}: {r.get('status')}: "
                             f"{r.get('reason', '')}")
            m = r.get("memory")
            if m and m.get("status") not in (None, "ok"):
                notes.append(f"- {e['graph']}/{e['model']} {c} memory: {m.get('reason', '')}")
    if notes:
        out += ["## Skipped or failed", ""] + notes + [""]
    return "\n".join(out)


def chart(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    graphs = list(dict.fromkeys(e["graph"] for e in results["workloads"]))
    # speed-ups when gcomp ran; otherwise (training before gcomp's trainer) the medians
    as_speedup = any(e.get("speedup") for e in results["workloads"])
    peers = [c for c in results["configs"] if c != "gcomp" or not as_speedup]
    fig, axes = plt.subplots(1, len(graphs), figsize=(5.5 * len(graphs), 4.2), squeeze=False)
    for ax, gname in zip(axes[0], graphs):
        ents = [e for e in results["workloads"] if e["graph"] == gname]
        xs = np.arange(len(ents))
        w = 0.8 / max(1, len(peers))
        for k, c in enumerate(peers):
            vals = [e["speedup"].get(c, np.nan) if as_speedup else
                    e["configs"].get(c, {}).get("median_s", np.nan) * 1e3 for e in ents]
            bars = ax.bar(xs + (k - (len(peers) - 1) / 2) * w, vals, w, label=c)
            for b, v in zip(bars, vals):
                if np.isfinite(v):
                    ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                                va="bottom", fontsize=7)
        if as_speedup:
            ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(xs, [e["model"] for e in ents])
        ax.set_title(f"{gname} ({results['mode']}, {results['threads']} threads)")
        ax.set_ylabel("gcomp speed-up (peer median / gcomp median)" if as_speedup else
                      "median ms per " + ("forward" if results["mode"] == "inference" else "epoch"))
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
