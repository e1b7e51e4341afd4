"""Peak memory per configuration, each in a fresh process.

The child imports only what its configuration needs, loads the graph, builds the system and
runs ``iters`` steps of the same work that is timed; it prints its peak RSS
(VmHWM; see ``_peak_mb`` for why not ``getrusage``'s ru_maxrss, also recorded).  A baseline child per peer imports the same
libraries and stops: ``extra_mb = peak_mb - baseline_mb`` is what the workload itself added
(graph and features included -- every system holds them).

gcomp's child runs a saved artifact (``gcomp.runtime.artifact.load``): compilation is ahead of
time and its memory is not counted.  torch.compile compiles in the child's first call, and
that is counted: it is part of running that configuration.

Child: ``python -m bench.memory '<json spec>'``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def status_mb(*fields: str) -> dict[str, float]:
    """Fields of /proc/self/status counted in kB (``VmRSS``, ``VmHWM``), in MB; a field
    the system does not report is left out."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in fields:
                    out[key] = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return out


def _peak_mb() -> dict:
    """Peak RSS of this process, MB.  ``ru_maxrss`` (getrusage) survives fork + exec on Linux:
    a child started by a big parent reports at least the parent's size.  VmHWM (the high-water
    mark of this process's own address space) does not, so it is the figure used."""
    out = {"ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    out["peak_mb"] = status_mb("VmHWM").get("VmHWM", out["ru_maxrss_mb"])
    return out


def import_libs(config: str) -> None:
    """The libraries a configuration's child needs (the baseline imports exactly these)."""
    import numpy  # noqa: F401
    import gcomp.models  # noqa: F401  (the weights come from the gcomp model)
    import gcomp.runtime.data  # noqa: F401
    if config == "gcomp":
        import tvm  # noqa: F401
        import gcomp.runtime.artifact  # noqa: F401
        import gcomp.runtime.executor  # noqa: F401
    elif config.startswith("pyg"):
        import bench.peers_pyg  # noqa: F401  (torch, torch_geometric)
    elif config == "dgl":
        import bench.peers_dgl  # noqa: F401  (torch, dgl)


def peer_family(config: str) -> str:
    return "pyg" if config.startswith("pyg") else config


def child(spec: dict) -> dict:
    from bench.env import apply_torch_threads, set_threads
    set_threads(spec["threads"])
    import_libs(spec["config"])
    apply_torch_threads(spec["threads"])
    if spec.get("baseline"):
        return _peak_mb()
    from bench import workload as W
    wl = W.make(spec["model"], spec["graph"], spec["layers"], spec["hidden"], spec["heads"])
    if spec["config"] == "gcomp":
        from bench import gcomp_runner
        from gcomp.runtime.artifact import load
        runner = gcomp_runner.make(wl, spec["mode"], artifact=load(spec["artifact"]),
                                   **spec.get("options", {}))
    else:
        from bench.runner import make_runner
        runner = make_runner(spec["config"], wl, spec["mode"])
    for _ in range(spec["iters"]):
        runner.step()
    return _peak_mb()


def run_child(spec: dict, timeout_s: float) -> dict:
    """Run one child; returns its result, or {"error": ...}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        p = subprocess.run([sys.executable, "-m", "bench.memory", json.dumps(spec)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout_s:.0f} s budget (killed)"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"child exited {p.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


class MemoryMeter:
    """Measures configurations; baselines are measured once per peer and reused."""

    def __init__(self, threads: int, mode: str, iters: int, timeout_s: float):
        self.threads, self.mode, self.iters, self.timeout_s = threads, mode, iters, timeout_s
        self.baselines: dict[str, dict] = {}

    def baseline(self, config: str) -> dict:
        fam = peer_family(config)
        if fam not in self.baselines:
            self.baselines[fam] = run_child({"config": config, "baseline": True,
                                             "threads": self.threads}, self.timeout_s)
        return self.baselines[fam]

    def measure(self, config: str, wl, artifact_path: str | None = None,
                options: dict | None = None) -> dict:
        """``options``: gcomp's runtime choices (``gcomp_runner.make``'s keywords)."""
        base = self.baseline(config)
        spec = {"config": config, "model": wl.model_name, "graph": wl.graph_name,
                "layers": wl.layers, "hidden": wl.hidden, "heads": wl.heads, "mode": self.mode,
                "iters": self.iters, "threads": self.threads, "artifact": artifact_path,
                "options": options or {}}
        r = run_child(spec, self.timeout_s)
        if "error" in r:
            return {"status": "failed", "reason": r["error"]}
        out = {"status": "ok", "peak_rss_mb": round(r["peak_mb"], 1), "iters": self.iters,
               "ru_maxrss_mb": round(r["ru_maxrss_mb"], 1)}
        if "peak_mb" in base:
            out["baseline_rss_mb"] = round(base["peak_mb"], 1)
            out["extra_mb"] = round(r["peak_mb"] - base["peak_mb"], 1)
        return out


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
