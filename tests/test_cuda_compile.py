"""Ahead-of-time CUDA compilation on a machine without a GPU (needs nvcc, not a GPU).

Every bundled model compiles for ``-t cuda`` (inference and training), every kernel with
its own schedule (``GCOMP_CUDA_STRICT=1``: no generic fallback); the artifact's library
holds a fatbin with SASS for the arch and PTX, and loads with the TVM runtime alone (no
compiler library, no CUDA compiler callback), a stub ``libcuda.so.1`` standing in for the
driver.  Running the kernels needs a GPU: ``tests/gpu/``.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from corpus import CORPUS, STEMS

import gcomp.models as models
from gcomp.cli import main
from gcomp.codegen import cuda_build
from gcomp.compiler import compile_model
from gcomp.errors import CompileError
from gcomp.runtime import artifact

try:
    NVCC = cuda_build.find_nvcc()
except CompileError as e:
    pytest.skip(f"CUDA compile tests need nvcc (the CUDA toolkit; no GPU needed): {e}",
                allow_module_level=True)

MODELS = ["gcn", "sage", "gin", "gat"]
EM_CUDA = 190


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("GCOMP_CUDA_STRICT", "1")  # a kernel without its schedule fails


def _small(name, dropout=0.0):
    return models.build(name, 24, hidden=16, out_channels=5, layers=2, heads=2, dropout=dropout)


def _library(art, tmp_path) -> Path:
    so = tmp_path / "kernels.so"
    so.write_bytes(art.lib_bytes)
    return so


def check_device_code(art, tmp_path, sm: int = 90) -> dict:
    """The library's CUDA module: one fatbin, SASS for ``sm`` and PTX, every kernel in it."""
    dev = cuda_build.inspect_library(_library(art, tmp_path))
    assert dev["format"] == "fatbin"
    elves = [e for e in dev["entries"] if e["kind"] == "elf"]
    ptx = [e for e in dev["entries"] if e["kind"] == "ptx"]
    assert [e["arch"] for e in elves] == [sm] and [e["arch"] for e in ptx] == [sm], dev["entries"]
    assert elves[0]["elf_magic"] and elves[0]["e_machine"] == EM_CUDA
    assert elves[0]["elf_sm"] == sm
    for k in art.kernels():  # every planned kernel launches at least one device kernel
        assert any(d == f"{k}_kernel" or d.startswith(f"{k}_kernel_") for d in dev["kernels"]), k
    return dev


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
@pytest.mark.parametrize("name", MODELS)
def test_every_model_compiles_for_cuda(name, train, tmp_path):
    art = compile_model(_small(name, dropout=0.5 if train else 0.0), "cuda", train=train)
    assert art.target == {"kind": "cuda", "arch": "sm_90"}
    assert art.manifest["device_code_format"] == "fatbin"
    check_device_code(art, tmp_path)
    path = art.save(tmp_path / f"{name}.gcomp")  # saved, then loaded with every check
    loaded = artifact.load(path)
    assert loaded.lib_bytes == art.lib_bytes
    info = loaded.info()
    assert info["target"] == {"kind": "cuda", "arch": "sm_90"}
    assert info["device_code_format"] == "fatbin"
    assert info["kind"] == ("training" if train else "inference")
    if train:  # the GPU plan's launches: one optimizer kernel, no weight transposed apart
        kinds = [s["kernel"][3:].rsplit("_", 1)[0] for s in art.train_plan.steps]
        assert kinds.count("adam_all") == 1 and "adam" not in kinds and "transpose" not in kinds


# ops whose kernels (max aggregation and its gradient, fused attention without dropout
# (the models train GAT with it here), edge softmax with heads, concat,
# reductions, softmax, self-loop normalization) the bundled models' defaults do not use
OPS_BEYOND_MODELS = ["aggregate_max", "aggregate_weighted_mean", "attention_fused",
                     "attention_fused_no_leaky_relu", "concat_reshape",
                     "edge_softmax_heads", "mean_max_axis", "scatter_max", "scatter_mean",
                     "scatter_messages", "self_loops_norm", "softmax"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS + ["ggnn"])
def test_every_model_trains_with_atomic_scatters_through_nvcc(name, precision, tmp_path):
    """``--prefer memory``: every model's training step, in both precisions, through nvcc
    with its scatters (GAT keeps its attention's own backward; the others scatter)."""
    from gcomp.passes import PassContext
    m = (models.build("ggnn", 16, hidden=24, out_channels=5, layers=2) if name == "ggnn"
         else _small(name))
    art = compile_model(m, "cuda", train=True, precision=precision,
                        ctx=PassContext(options={"prefer": "memory"}))
    check_device_code(art, tmp_path)
    assert art.info()["deterministic"] == (name == "gat")


@pytest.mark.parametrize("stored", [False, True], ids=["fp32", "bf16"])
def test_relu_sign_kernels_compile_for_cuda(stored, tmp_path):
    """The kernels of ``pack_relu_masks`` (which the compiler keeps for a CUDA plan only
    where its whole allocations shrink) through nvcc: both in the fatbin."""
    from gcomp.codegen.build import build_library, make_target
    from gcomp.codegen.kernels import KernelSpec
    specs = [KernelSpec.make("sign_bits", F=40, **({"bf16": ("x",)} if stored else {})),
             KernelSpec.make("mask_bits", F=40, **({"bf16": ("dy", "ewise")} if stored else {}))]
    lib = build_library({s.name: s for s in specs}, make_target("cuda"))
    dev = cuda_build.inspect_library(lib)
    for s in specs:
        assert any(d.startswith(f"{s.name}_kernel") for d in dev["kernels"]), s.name


@pytest.mark.parametrize("op", OPS_BEYOND_MODELS)
def test_op_kernels_compile_for_cuda(op, tmp_path):
    from test_autodiff import OPS, Fn

    from gcomp.frontend.builder import GraphInput, NodeInput, trace
    m = trace(Fn(OPS[op], 4), {"x": NodeInput(4), "edge_index": GraphInput()}, seed=5)
    check_device_code(compile_model(m, "cuda", train=True), tmp_path)


def test_other_arch(tmp_path):
    art = compile_model(_small("gcn"), "cuda", arch="sm_80")
    assert art.target["arch"] == "sm_80"
    check_device_code(art, tmp_path, sm=80)


def test_cli_compile_and_info(tmp_path, capsys):
    out = tmp_path / "gcn.gcomp"
    assert main(["compile", "gcn", "--in", "24", "--hidden", "16", "--out", "5", "-t", "cuda",
                 "--arch", "sm_90", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target"] == {"kind": "cuda", "arch": "sm_90"}
    assert info["device_code_format"] == "fatbin"
    assert main(["info", str(out)]) == 0
    assert "device code fatbin" in capsys.readouterr().out
    with zipfile.ZipFile(out) as z:  # the library in the archive is the checked one
        assert json.loads(z.read("manifest.json"))["device_code_format"] == "fatbin"
    out_t = tmp_path / "gcn_train.gcomp"
    assert main(["compile", "gcn", "--in", "24", "--hidden", "16", "--out", "5", "-t", "cuda",
                 "--train", "-o", str(out_t)]) == 0
    assert artifact.load(out_t).info()["kind"] == "training"


@pytest.mark.parametrize("arch", ["sm90", "gfx90a", "sm_9", "compute_90", ""])
def test_bad_arch_is_a_compile_error(arch):
    with pytest.raises(CompileError, match="arch"):
        compile_model(_small("gcn"), "cuda", arch=arch)


def test_arch_without_cuda_is_refused(tmp_path, capsys):
    assert main(["compile", "gcn", "--arch", "sm_90", "-o", str(tmp_path / "x.gcomp")]) == 2
    assert "--arch is for -t cuda" in capsys.readouterr().err


def test_missing_nvcc_is_a_compile_error(monkeypatch, tmp_path):
    monkeypatch.delenv("GCOMP_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(CompileError, match="needs nvcc"):
        compile_model(_small("gcn"), "cuda")


def test_a_bad_nvcc_is_named(monkeypatch, tmp_path):
    """GCOMP_NVCC naming no program was passed over for the nvcc on PATH; one that exits
    0 without writing the fatbin gave a FileNotFoundError traceback."""
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GCOMP_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(CompileError, match="GCOMP_NVCC=.*no-nvcc' is not an executable file"):
        compile_model(_small("gcn"), "cuda")
    for program, msg in (("/bin/true", "exited 0 but wrote no device code"),
                         ("/bin/false", "failed to compile the CUDA kernels for sm_90: "
                                        "\\(exit code 1, no output\\)")):
        monkeypatch.setenv("GCOMP_NVCC", program)
        with pytest.raises(CompileError, match=msg):
            compile_model(_small("gcn"), "cuda")


def test_target_options_of_the_other_target_are_refused():
    with pytest.raises(CompileError, match="mcpu 'skylake' is a CPU, for target llvm"):
        compile_model(_small("gcn"), "cuda", mcpu="skylake")
    with pytest.raises(CompileError, match="arch 'sm_80' is a GPU architecture"):
        compile_model(_small("gcn"), "llvm", arch="sm_80")


def test_a_damaged_cache_entry_is_built_again(monkeypatch, tmp_path):
    """A truncated cached library was packed into the artifact as it was."""
    from gcomp.codegen.cuda_build import inspect_library
    from gcomp.runtime.artifact import LIB_NAME
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))
    compile_model(_small("gcn"), "cuda")
    (cached,) = tmp_path.glob("*.cuda.so")
    cached.write_bytes(cached.read_bytes()[:1000])
    art = compile_model(_small("gcn"), "cuda")
    lib = tmp_path / LIB_NAME
    lib.write_bytes(art.lib_bytes)
    assert any(e["arch"] == 90 for e in inspect_library(lib)["entries"])


def test_unschedulable_kernel_names_the_kernel(monkeypatch):
    from gcomp.codegen.kernels import KernelSpec
    from gcomp.schedules import cuda as cuda_sched

    def broken(sch, spec):
        raise RuntimeError("schedule bug")
    monkeypatch.setattr(cuda_sched, "schedule", broken)
    spec = KernelSpec.make("matmul", K=8, M=8)
    with pytest.raises(CompileError, match=rf"{spec.name} \(matmul"):
        cuda_build.build_cuda_library({spec.name: spec}, {"kind": "cuda", "arch": "sm_90"},
                                      Path(os.environ["GCOMP_CACHE_DIR"]))
    monkeypatch.delenv("GCOMP_CUDA_STRICT")  # without strict mode: the generic GPU schedule
    path = cuda_build.build_cuda_library({spec.name: spec}, {"kind": "cuda", "arch": "sm_90"},
                                         Path(os.environ["GCOMP_CACHE_DIR"]))
    assert cuda_build.inspect_library(path)["format"] == "fatbin"


def test_running_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    from gcomp.runtime.artifact import load_cuda_runtime
    try:
        load_cuda_runtime()
        pytest.skip("this machine can load the CUDA runtime (tests/gpu runs the kernels)")
    except Exception:  # noqa: BLE001
        pass
    path = compile_model(_small("gcn"), "cuda").save(tmp_path / "gcn.gcomp")
    graph = tmp_path / "g.npz"
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(graph, edge_index=rng.integers(0, 30, (2, 90)), x=rng.random((30, 24), np.float32))
    assert main(["run", str(path), "--graph", str(graph), "--out", str(tmp_path / "y.npy")]) == 2
    assert "CUDA" in capsys.readouterr().err


# ---------------------------------------------------------------------- runtime-only load
STUB_DRIVER = textwrap.dedent("""\
    /* Stands in for the CUDA driver (libcuda.so.1) on a machine without a GPU. */
    #define FAIL(name) int name(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }
    FAIL(cuDeviceGetName) FAIL(cuFuncSetAttribute) FAIL(cuLaunchKernelEx)
    FAIL(cuModuleGetFunction) FAIL(cuModuleLoadData) FAIL(cuModuleUnload)
    FAIL(cuTensorMapEncodeTiled) FAIL(cuLaunchKernel) FAIL(cuModuleGetGlobal) FAIL(cuMemsetD32)
    int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
    int cuGetErrorString(int e, const char **s) { *s = "no device (stub)"; return 0; }
""")

LOADER = textwrap.dedent("""\
    import ctypes, json, sys
    ctypes.CDLL(sys.argv[1], ctypes.RTLD_GLOBAL)  # the stub driver, soname libcuda.so.1
    import tvm

    def no_compiler(*args):
        raise RuntimeError("the artifact asked for a CUDA compiler")
    tvm.register_global_func("tvm_callback_cuda_compile", no_compiler, override=True)
    from gcomp.runtime import artifact
    art = artifact.load(sys.argv[2])
    lib = art.library()  # loads TVM's CUDA plugin, then the library and its device code
    cuda = [m for m in lib.imports if m.kind == "cuda"]
    missing = [k for k in art.kernels() if not lib.implements_function(k)]
    names = json.loads(sys.argv[3])  # the device kernels: fmap entries of the fatbin module
    missing += [d for d in names if not cuda[0].implements_function(d)]
    maps = open("/proc/self/maps").read()
    print(json.dumps({"tvm": tvm.__file__, "cuda_modules": len(cuda), "missing": missing,
                      "compiler_lib_mapped": "libtvm_compiler" in maps}))
""")


def _runtime_only_tvm(root: Path) -> Path:
    """A ``tvm`` package without its compiler library (what gpu_bundle.sh ships), as links."""
    import tvm
    src = Path(tvm.__file__).parent
    pkg = root / "tvm"
    (pkg / "lib").mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name not in ("lib", "3rdparty", "src", "include", "__pycache__"):
            (pkg / entry.name).symlink_to(entry)
    for entry in (src / "lib").iterdir():
        if entry.name != "libtvm_compiler.so":
            (pkg / "lib" / entry.name).symlink_to(entry)
    return root


def test_artifact_loads_with_the_runtime_only(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the stub CUDA driver")
    (tmp_path / "stub.c").write_text(STUB_DRIVER)
    stub = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                    str(tmp_path / "stub.c")], check=True)
    art = compile_model(_small("gat", dropout=0.5), "cuda", train=True)
    path = art.save(tmp_path / "gat.gcomp")
    site = _runtime_only_tvm(tmp_path / "site")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1",
               PYTHONPATH=os.pathsep.join([str(site), str(repo)]))
    device_kernels = cuda_build.inspect_library(_library(art, tmp_path))["kernels"]
    proc = subprocess.run([sys.executable, "-c", LOADER, str(stub), str(path),
                           json.dumps(device_kernels)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tvm"].startswith(str(site)), result
    assert result == {"tvm": result["tvm"], "cuda_modules": 1, "missing": [],
                      "compiler_lib_mapped": False}


@pytest.mark.parametrize("stem", STEMS)
def test_every_corpus_export_compiles_for_cuda(stem, tmp_path):
    """Each PyG export of the corpus (``models/onnx``: 2 and 3 layers, every exporter and
    opset) compiles for cuda with its training step, every kernel with its own schedule
    and device code for the arch.  (Exports with the same kernels share the cached
    library: nvcc runs once per distinct set.)"""
    from gcomp.frontend.onnx import import_onnx
    art = compile_model(import_onnx(CORPUS / f"{stem}.onnx"), "cuda", train=True)
    assert art.manifest["device_code_format"] == "fatbin"
    check_device_code(art, tmp_path)


@pytest.mark.parametrize("M", [160, 192, 256, 384])
@pytest.mark.parametrize("epilogue", [False, True])
def test_products_wider_than_128_columns_compile(M, epilogue, tmp_path):
    """Products into more than half a block of columns (GGNN's GRU gates: 3 x hidden; wide
    GAT layers): one row of threads per block once left the rows' register sums sized
    symbolically, which TVM refused ("constant size stack allocation")."""
    from gcomp.codegen.kernels import KernelSpec
    from gcomp.schedules.cuda import THREADS
    kw = {"epilogue": (("bias_add", (), 0, False),), "extras": ("vec",)} if epilogue else {}
    spec = KernelSpec.make("matmul", K=64, M=M, **kw)
    path = cuda_build.build_cuda_library({spec.name: spec}, {"kind": "cuda", "arch": "sm_90"},
                                         tmp_path)
    dev = cuda_build.inspect_library(path)
    assert any(k.startswith(f"{spec.name}_kernel") for k in dev["kernels"])
    assert M > THREADS // 2


def test_cuda_artifact_of_an_older_plan_version_is_refused(tmp_path):
    """Plans before version 3 bound hub tasks without their row (t x 2); a CUDA artifact
    of such a plan, whose kernels read two columns, is refused with the reason instead of
    running its kernels on the wider array.  A CPU artifact of version 2 has no hub tasks
    and still loads."""
    import json
    from test_artifact_cli import _rewrite

    from gcomp.errors import ArtifactError
    m = _small("gcn")
    for target, refused in (("cuda", True), ("llvm", False)):
        path = compile_model(m, target).save(tmp_path / f"{target}.gcomp")
        old = tmp_path / f"{target}-v2.gcomp"

        def edit(members):
            man = json.loads(members["manifest.json"])
            man["plan_version"] = 2
            members["manifest.json"] = json.dumps(man).encode()
        _rewrite(path, old, edit)
        if refused:
            with pytest.raises(ArtifactError, match="hub tasks without their row.*recompile"):
                artifact.load(old)
        else:
            assert artifact.load(old).plan.steps


@pytest.mark.parametrize("name,value", [("GCOMP_CUDA_EDGE_GROUP", "abc"),
                                        ("GCOMP_CUDA_EDGE_GROUP", "0"),
                                        ("GCOMP_CUDA_MM_ROWS", "-5")])
def test_bad_tuning_knobs_are_named(monkeypatch, name, value):
    """int() raised, or TVM divided by zero deep in a schedule."""
    monkeypatch.setenv(name, value)
    with pytest.raises(CompileError, match=f"{name}='{value}': a tuning knob takes an integer"):
        compile_model(_small("gcn"), "cuda")
