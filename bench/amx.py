"""The dense products of a bfloat16 artifact on AMX tiles against the float32-arithmetic
kernels they replace (``gcomp/codegen/amx_kernels.py``).

Each product is compiled twice from the same kernel spec (bfloat16 operands as in a
``--precision bf16`` artifact): for the host target without AMX (the row-group kernels,
which widen each bfloat16 value and multiply in float32) and with ``+amx-tile,+amx-bf16``
(the tiles).  Rows are arxiv-size (169,343); before each timed call a 256 MB array is
written, so operands come from memory as in a training step.  Median of ``--reps``,
alternating; both results are checked against a float64 product of the same rounded
operands.  Needs a CPU with AMX-BF16.

``python -m bench.amx [--threads 2] [--reps 9] [--out bench/results]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench import report
from bench.env import machine, set_threads, versions

ROWS = 169_343
# (kind, K, M, operands stored as bfloat16); matmul: x [n, K] @ w [K, M];
# matmul_tn: x [n, K].T @ y [n, M] (a weight gradient)
CASES = [("matmul", 32, 32, ("out", "x")), ("matmul", 128, 32, ("out", "x")),
         ("matmul", 128, 128, ("out", "x")), ("matmul", 128, 384, ("out", "x")),
         ("matmul_tn", 128, 32, ("x", "y")), ("matmul_tn", 128, 32, ("y",)),
         ("matmul_tn", 32, 32, ("x", "y")), ("matmul_tn", 32, 40, ("x", "y"))]


def _bits(a: np.ndarray) -> np.ndarray:
    u = a.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _widen(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.amx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import tvm
    import tvm_ffi
    from gcomp.codegen.build import make_target
    from gcomp.codegen.kernels import KernelSpec, define
    from gcomp.runtime.cpu_features import AMX_MATTR, enable_amx
    why = enable_amx()
    if why is not None:
        raise SystemExit(f"bench.amx needs AMX tiles: {why}")
    plain = make_target("llvm")
    targets = {"float32 arithmetic": plain, "tiles": {**plain, "mattr": list(AMX_MATTR)}}
    stamp = datetime.now(timezone.utc)
    res = {"date_utc": stamp.isoformat(timespec="seconds"),
           "command": "python -m bench.amx " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "versions": versions(), "threads": args.threads,
           "reps": args.reps, "rows": ROWS, "products": []}
    rng = np.random.default_rng(0)
    flush = np.ones(64 * 2**20, np.float32)

    def operand(a: np.ndarray, name: str, stored):
        if name in stored:
            return tvm_ffi.from_dlpack(_bits(a))._create_view(a.shape, "bfloat16")
        return tvm.runtime.tensor(a)

    for kind, K, M, stored in CASES:
        spec = KernelSpec.make(kind, K=K, M=M, bf16=tuple(sorted(stored)))
        x = rng.standard_normal((ROWS, K), dtype=np.float32)
        other = rng.standard_normal((K, M) if kind == "matmul" else (ROWS, M), dtype=np.float32)
        if kind == "matmul":
            ref = _widen(_bits(x)) @ _widen(_bits(other))
            shape = (ROWS, M)
        else:
            ref = _widen(_bits(x)).T @ _widen(_bits(other))
            shape = (K, M)
        calls, row = {}, {"kind": kind, "K": K, "M": M, "bf16": list(stored)}
        for label, tgt in targets.items():
            func = define(spec, tgt)
            fn = tvm.compile(tvm.IRModule({spec.name: func}),
                             target=tvm.target.Target(tgt))[spec.name]
            out_bits = np.zeros(shape, np.uint16)
            out = (tvm_ffi.from_dlpack(out_bits)._create_view(shape, "bfloat16")
                   if "out" in stored else tvm.runtime.tensor(np.zeros(shape, np.float32)))
            a = (operand(x, "x", stored), operand(other, "w" if kind == "matmul" else "y",
                                                      stored), out)
            fn(*a)
            got = _widen(out_bits) if "out" in stored else out.numpy()
            err = float(np.abs(got - ref).max() / np.abs(ref).max())
            if err > 1e-2:
                raise SystemExit(f"{kind} {K}x{M} ({label}) differs from float64 by {err:.1e}")
            row[label] = {"tiles": "tdpbf16ps" in func.script(), "max_rel_diff": err}
            calls[label] = (fn, a)
        times = {label: [] for label in calls}
        for _ in range(args.reps):
            for label, (fn, a) in calls.items():
                flush += 1.0  # operands from memory, not the caches
                t0 = time.perf_counter()
                fn(*a)
                times[label].append(time.perf_counter() - t0)
        for label, ts in times.items():
            row[label]["median_ms"] = statistics.median(ts) * 1e3
        res["products"].append(row)
        print(f"{kind} {K}x{M} bf16={','.join(stored)}: "
              + ", ".join(f"{label} {row[label]['median_ms']:.2f} ms" for label in times),
              flush=True)
    report.save(args.out, "amx", stamp, res, markdown(res))
    return res


def markdown(res: dict) -> str:
    lines = [f"# Dense products on AMX tiles ({res['date_utc']})", "",
             f"{res['machine'].get('cpu_model')}, {res['threads']} threads; `{res['command']}`", "",
             f"{res['rows']:,} rows, operands read from memory; median ms of {res['reps']} "
             "alternating calls; kernels compiled from the same spec without and with AMX.", "",
             "| product | bfloat16 operands | float32 arithmetic ms | tiles ms | speed-up |",
             "|---|---|---|---|---|"]
    for r in res["products"]:
        a, t = r["float32 arithmetic"], r["tiles"]
        name = (f"x @ w, {r['K']} -> {r['M']}" if r["kind"] == "matmul"
                else f"x.T @ y, {r['K']} x {r['M']}")
        note = "" if t["tiles"] else " (no tiles: kept)"
        lines.append(f"| {name} | {', '.join(r['bf16'])} | {a['median_ms']:.2f} | "
                     f"{t['median_ms']:.2f}{note} | {a['median_ms'] / t['median_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
