"""Accuracy of CUDA builds trained in the CUDA emulator (``gcomp.debug.cuda_emulator``),
for a machine without a GPU: what ``--precision bf16`` on CUDA costs in accuracy against
float32, with the GPU kernels' own arithmetic (their thread layouts, their float32
registers, their bfloat16 stores).  No timing: the emulator runs a GPU thread per host
thread.

Cora, the bundled GCN (2 layers, hidden 16), Adam lr 0.01 and weight decay 5e-4,
``--epochs`` epochs from the same initial weights: CUDA bf16 and CUDA fp32 (emulated)
and the CPU fp32 build; test accuracy and final training loss of each.

``python -m bench.cuda_emulated_accuracy [--epochs 200] [--out bench/results]``
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import report
from bench.env import machine, versions

BUILDS = (("cuda", "bf16"), ("cuda", "fp32"), ("llvm", "fp32"))


def run(epochs: int) -> list[dict]:
    from bench.gpu import accuracy_model
    from gcomp.compiler import compile_model
    from gcomp.debug.cuda_emulator import EmulatedArtifact
    from gcomp.runtime.data import load_graph
    from gcomp.runtime.trainer import Trainer
    g = load_graph("cora")
    m, opt = accuracy_model()  # the model and optimizer of the GPU's accuracy runs
    rows = []
    for target, precision in BUILDS:
        t0 = time.perf_counter()
        art = compile_model(m, target, train=True, precision=precision, optimizer=opt)
        tr = Trainer(EmulatedArtifact(art) if target == "cuda" else art, g)
        for _ in range(epochs):
            loss = tr.step()
        rows.append({"target": target, "precision": precision, "loss": loss,
                     **tr.evaluate(), "seconds": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    return rows


def markdown(res: dict) -> str:
    out = ["# CUDA builds trained in the CUDA emulator: Cora, GCN", "",
           f"`{res['command']}` at {res['when']}; {res['machine']['cpu_model']}; "
           f"{res['versions']}.  {res['epochs']} epochs, Adam lr 0.01, weight decay 5e-4.", "",
           "| build | test accuracy | val accuracy | final loss |", "|---|---|---|---|"]
    for r in res["rows"]:
        run_on = "CUDA (emulated)" if r["target"] == "cuda" else "CPU"
        out.append(f"| {run_on} {r['precision']} | {r['test_acc']:.3f} | {r['val_acc']:.3f} "
                   f"| {r['loss']:.6f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_emulated_accuracy",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    stamp = datetime.now(timezone.utc)
    res = {"command": " ".join(["python -m bench.cuda_emulated_accuracy"] + sys.argv[1:]),
           "when": stamp.isoformat(timespec="seconds"), "machine": machine(),
           "versions": versions(), "epochs": args.epochs, "rows": run(args.epochs)}
    report.save(args.out, "cuda-emulated-accuracy", stamp, res, markdown(res))
    return res


if __name__ == "__main__":
    main()
