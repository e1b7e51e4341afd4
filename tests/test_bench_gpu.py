"""``bench.gpu``'s halves that run without a GPU: ``prepare`` (the artifacts a GPU host
times, in each precision) and the report of a run with bfloat16 builds.  The timing
half needs a GPU and is exercised there (``bench/gpu_host.sh``)."""

import pytest

from bench import gpu
from gcomp.codegen import cuda_build
from gcomp.errors import CompileError
from gcomp.runtime import artifact


def _run_result(**fields) -> dict:
    """What ``bench.gpu run`` records, with ``fields`` (cases, spmm, ...) over an empty run."""
    return {"device": "a GPU", "command": "bench.gpu run", "when": "now", "versions": {},
            "layers": 3, "hidden": 32, "heads": 4, "reps": 10, "warmup": 3, "spmm": [],
            "cases": [], **fields}


def test_prepare_writes_each_precision(tmp_path):
    try:
        cuda_build.find_nvcc()
    except CompileError as e:
        pytest.skip(f"prepare compiles CUDA code: {e}")
    gpu.main(["prepare", str(tmp_path), "--models", "gcn", "--precisions", "fp32,bf16"])
    for what in ("gcn-infer", "gcn-train"):
        fp32 = artifact.load(gpu.artifact_path(tmp_path, "arxiv-synth", what))
        bf16 = artifact.load(gpu.artifact_path(tmp_path, "arxiv-synth", what, "bf16"))
        plan = "train_plan" if what.endswith("train") else "plan"
        assert not getattr(fp32, plan).precision.get("bfloat16")
        assert getattr(bf16, plan).precision["bfloat16"]  # some activations in 16 bits
        assert bf16.target["kind"] == "cuda"
    for prec in ("fp32", "bf16"):  # Cora's GCN for the accuracy runs
        acc = artifact.load(gpu.artifact_path(tmp_path, "cora", "gcn-accuracy", prec))
        assert acc.train_plan is not None
    assert gpu.artifact_path(tmp_path, "any", "spmm32").exists()
    # at F = 32 also a warp per row (the default puts four rows in a warp), which the run
    # times beside it; the knob is set for that compile only
    import os

    from gcomp.schedules.cuda import AGG_MIN_LANES_ENV
    assert AGG_MIN_LANES_ENV not in os.environ
    warp = artifact.load(gpu.artifact_path(tmp_path, "any", f"spmm32-{gpu.SPMM_VARIANT}"))
    plain = artifact.load(gpu.artifact_path(tmp_path, "any", "spmm32"))
    assert warp.lib_bytes != plain.lib_bytes
    assert not gpu.artifact_path(tmp_path, "any", f"spmm128-{gpu.SPMM_VARIANT}").exists()


def test_report_of_the_spmm_with_and_without_its_variant():
    row = {"graph": "arxiv-synth", "width": 32, "gcomp": {"median_ms": 0.135},
           "cusparse": {"median_ms": 0.144}, "rel_err": 1e-7}
    res = _run_result(spmm=[row, {**row, "width": 128,
                                  gpu.SPMM_VARIANT: {"median_ms": 0.09, "rel_err": 2e-7}}])
    md = gpu.markdown(res)
    assert "| arxiv-synth | 32 | 0.135 | 0.144 | 1.07x | - | 1.0e-07 | - | - |" in md
    assert "| 0.090 (rel err 2.0e-07) | - |" in md
    row["gcomp"]["back_to_back"] = {"median_ms": 0.08}
    row["cusparse"]["back_to_back"] = {"median_ms": 0.12}
    assert "| 1.07x | 0.080 / 0.120, 1.50x | 1.0e-07 |" in gpu.markdown(_run_result(spmm=[row]))


def test_back_to_back_timing_is_per_call():
    calls, syncs = [], []
    times = gpu.timed_batch(lambda: calls.append(1), lambda: syncs.append(1), reps=3,
                            warmup=1, batch=5)
    assert len(times) == 3 and len(calls) == 4 * 5 and len(syncs) == 4


def test_prepare_with_memory_preferred(tmp_path):
    """``--prefer memory``: GCN's training step aggregates at the hidden width every step
    (no wide A X kept from the feed), and the directory and the report say so."""
    try:
        cuda_build.find_nvcc()
    except CompileError as e:
        pytest.skip(f"prepare compiles CUDA code: {e}")
    gpu.main(["prepare", str(tmp_path), "--models", "gcn", "--prefer", "memory"])
    art = artifact.load(gpu.artifact_path(tmp_path, "arxiv-synth", "gcn-train"))
    assert not art.train_plan.feed_steps
    assert (tmp_path / gpu.PREPARED).read_text() == '{"prefer": "memory"}'
    res = _run_result(prefer="memory")
    assert "compiled with `--prefer memory`" in gpu.markdown(res)


def test_prepare_with_a_tuning_knob(tmp_path):
    """``--knob``: set while compiling (the weight gradients stage 32 rows a step), then
    unset; recorded in the directory and named in the report; unknown knobs refused."""
    import json
    import os

    from gcomp.codegen.dense_kernels import (MM_RESULTS_ENV, MM_ROWS_ENV, TN_ROWS_ENV,
                                             TN_WAVES_ENV)
    try:
        cuda_build.find_nvcc()
    except CompileError as e:
        pytest.skip(f"prepare compiles CUDA code: {e}")
    from gcomp.codegen.aggregate_kernel import EDGE_GROUP_ENV
    from gcomp.schedules.cuda import AGG_COLUMNS_ENV, AGG_MIN_LANES_ENV
    # the names the compiler reads
    assert set(gpu.KNOBS) == {AGG_MIN_LANES_ENV, AGG_COLUMNS_ENV, EDGE_GROUP_ENV, TN_ROWS_ENV,
                              TN_WAVES_ENV, MM_RESULTS_ENV, MM_ROWS_ENV}
    with pytest.raises(SystemExit):
        gpu.main(["prepare", str(tmp_path), "--knob", "GCOMP_CUDA_NOPE=1"])
    gpu.main(["prepare", str(tmp_path / "k"), "--models", "gcn", "--knob", f"{TN_ROWS_ENV}=32"])
    gpu.main(["prepare", str(tmp_path / "base"), "--models", "gcn"])
    assert TN_ROWS_ENV not in os.environ
    prepared = json.loads((tmp_path / "k" / gpu.PREPARED).read_text())
    assert prepared == {"prefer": "speed", "knobs": {TN_ROWS_ENV: "32"}}
    art = [artifact.load(gpu.artifact_path(tmp_path / d, "arxiv-synth", "gcn-train"))
           for d in ("k", "base")]
    assert art[0].lib_bytes != art[1].lib_bytes  # other weight-gradient kernels
    res = _run_result(**prepared)
    assert f"Compiled with {TN_ROWS_ENV}=32." in gpu.markdown(res)


def test_precisions_must_include_fp32(tmp_path):
    with pytest.raises(SystemExit):
        gpu.main(["prepare", str(tmp_path), "--precisions", "bf16"])


def test_report_of_a_run_with_bf16_builds():
    case = {"graph": "arxiv-synth", "model": "gcn", "mode": "training",
            "gcomp": {"median_ms": 1.5, "device_bytes": 300 * 2**20, "final_loss": 3.61},
            "gcomp-bf16": {"median_ms": 1.0, "device_bytes": 200 * 2**20, "final_loss": 3.62,
                           "rel_err_vs_fp32": 4e-3},
            "pyg-csr": {"median_ms": 6.0, "peak_extra_bytes": 180 * 2**20},
            "speedup_vs_best_pyg": 4.0, "speedup_vs_best_pyg_bf16": 6.0}
    res = _run_result(cases=[case], accuracy=[
        {"precision": p, "test_acc": a, "val_acc": a, "final_loss": 0.1, "median_ms": 0.2}
        for p, a in (("fp32", 0.806), ("bf16", 0.805))])
    md = gpu.markdown(res)
    assert "| gcomp bf16 ms / MiB | bf16 vs best PyG |" in md
    assert "| 1.00 / 200 | 6.00x | 4.0e-03 | 3.6100 / 3.6200 |" in md
    assert "| bf16 | 0.805 |" in md


def test_report_of_a_training_case_without_a_forward_difference():
    # a training run compares the losses; the forward difference cell is "-", not nan
    case = {"graph": "arxiv-synth", "model": "gin", "mode": "training",
            "gcomp": {"median_ms": 1.9, "device_bytes": 318 * 2**20, "final_loss": 3.8204},
            "gcomp-bf16": {"median_ms": 1.7, "device_bytes": 240 * 2**20,
                           "final_loss": 3.8057},
            "pyg-csr": {"median_ms": 5.4, "peak_extra_bytes": 330 * 2**20},
            "speedup_vs_best_pyg": 2.84, "speedup_vs_best_pyg_bf16": 3.18}
    res = _run_result(cases=[case])
    md = gpu.markdown(res)
    assert "| 1.70 / 240 | 3.18x | - | 3.8204 / 3.8057 |" in md
    assert "nan" not in md


def test_report_of_cuda_graph_replays_without_peers():
    case = {"graph": "pubmed-synth", "model": "gin", "mode": "training",
            "gcomp": {"median_ms": 0.648, "device_bytes": 66 * 2**20, "final_loss": 1.098504},
            "gcomp-graph": {"median_ms": 0.594, "device_bytes": 66 * 2**20,
                            "final_loss": 1.098504}}
    res = _run_result(cases=[case])
    md = gpu.markdown(res)
    assert "| graph | model | mode | gcomp ms | gcomp MiB | vs best PyG |\n|---|---|---|---|---|---|" in md
    assert "| pubmed-synth | gin | training | 0.65 | 66 | - |" in md
    assert "| gcomp | 0.648 | 0.594 | 1.09x | loss 1.098504 / 1.098504 |" in md


def test_report_names_a_node_order_other_than_the_default():
    """``run --reorder none`` (the epochs in the graph's own order, to set beside the GPU's
    degree order): the report says so; the default says nothing."""
    assert "--reorder none" in gpu.markdown(_run_result(reorder="none"))
    assert "--reorder" not in gpu.markdown(_run_result(reorder="auto"))
    assert "--reorder" not in gpu.markdown(_run_result())  # results recorded before it
    with pytest.raises(SystemExit):
        gpu.main(["run", "somewhere", "--reorder", "sideways"])


def test_spmm_kernel_means_per_call():
    """bench.spmm_kernels: torch.profiler's totals (us) over its calls, as ms a call;
    host-side events (no device time) left out."""
    from types import SimpleNamespace as E

    from bench.spmm_kernels import kernel_means
    events = [E(key="gc_csr_agg_kernel", self_device_time_total=580.0, count=20),
              E(key="gc_csr_agg_kernel_1", self_device_time_total=1060.0, count=20),
              E(key="cudaLaunchKernel", self_device_time_total=0.0, count=40)]
    assert kernel_means(events) == {"gc_csr_agg_kernel": 0.029, "gc_csr_agg_kernel_1": 0.053}
