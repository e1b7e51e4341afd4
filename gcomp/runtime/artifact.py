"""The ``.gcomp`` artifact: everything needed to run a compiled model.

A zip archive (stored, not compressed) holding:

``manifest.json``   format name and version, gcomp and TVM versions, target,
                    model description, signature, and the SHA-256 of every
                    other member
``plan.json``       the inference (forward) plan (``gcomp/runtime/plan.py``)
``train_plan.json`` training artifacts only: forward, backward and optimizer
``params.npz``      parameter values
``kernels.so``      the compiled kernel library (``tvm.runtime.load_module``)
``ir/*.ir``         the Graph IR before and after the passes (for ``gcomp info``)

Loading checks the format, the versions and every checksum before anything
is executed, and needs only the TVM runtime.  Saving writes a temporary file
and renames it, so an interrupted save never leaves a damaged artifact.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import threading
import zipfile
from pathlib import Path

import numpy as np

from gcomp import __version__
from gcomp.errors import ArtifactError
from gcomp.files import write_atomic
from gcomp.runtime.cpu_features import enable_amx, missing
from gcomp.runtime.plan import HUB_TASKS_VERSION, PLAN_VERSION, Plan, kernel_kind

FORMAT = "gcomp-artifact"
FORMAT_VERSION = 1
LIB_NAME = "kernels.so"
_EXECUTOR_LOCK = threading.Lock()


def manifest_format(path: str | Path) -> str | None:
    """The format a zip's manifest names ("" where it names none or cannot be read), or
    None where ``path`` is no zip holding a manifest: what tells an artifact (FORMAT),
    which may be replaced by a new one, from files that are not."""
    try:
        with zipfile.ZipFile(path) as z:
            text = z.read("manifest.json")
    except (zipfile.BadZipFile, KeyError, OSError):
        return None
    try:
        manifest = json.loads(text)
    except ValueError:  # not JSON, or not text
        return ""
    return str(manifest.get("format") or "") if isinstance(manifest, dict) else ""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tvm_version() -> str:
    import importlib.metadata as md
    try:
        return md.version("apache-tvm")
    except md.PackageNotFoundError:  # a runtime-only bundle without wheel metadata
        import tvm
        return tvm.__version__


def cuda_device_index() -> int:
    """The CUDA device ``$GCOMP_CUDA_DEVICE`` names (default 0)."""
    text = os.environ.get("GCOMP_CUDA_DEVICE", "0")
    if not text.strip().isdigit():
        raise ArtifactError(f"GCOMP_CUDA_DEVICE={text!r}: give the number of a CUDA device "
                            f"(0 for the first)")
    return int(text)


class Artifact:
    """A compiled model: plan, parameters, kernel library, and its description."""

    def __init__(self, manifest: dict, plan: Plan, params: dict[str, np.ndarray], lib_bytes: bytes,
                 ir: dict[str, str], train_plan: Plan | None = None):
        self.manifest = manifest
        self.plan = plan
        self.train_plan = train_plan
        self.params = params
        self.lib_bytes = lib_bytes
        self.ir = ir
        self._executor = None
        self._lib = None
        self._libdir = None

    # ------------------------------------------------------------------ description
    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def signature(self) -> dict:
        return self.manifest["signature"]

    def info(self) -> dict:
        m = self.manifest
        return {
            "model": m["model"],
            "target": m["target"],
            "device_code_format": m.get("device_code_format"),
            "gcomp_version": m["gcomp_version"],
            "tvm_version": m["tvm_version"],
            "format_version": m["format_version"],
            "signature": m["signature"],
            "kind": "training" if self.train_plan is not None else "inference",
            "specialized": self.plan.specialized or None,
            "optimizer": m.get("optimizer"),
            # parameters the loss does not depend on: training leaves them as they are
            "untrained": ([k for k in self.params if k not in self.train_plan.grads]
                          if self.train_plan is not None else []),
            "precision": m.get("precision", "fp32"),
            "cpu_features": m.get("cpu_features", []),
            # the scatter kernels add with atomics, in the GPU's order
            "deterministic": not any(kernel_kind(k) == "csr_scatter" for k in self.kernels()),
            "kernels": self.kernels(),
            "num_kernels": len(self.kernels()),
            "ops": m.get("ops", {}),
            "parameters": {k: list(v.shape) for k, v in self.params.items()},
            "num_parameters": int(sum(v.size for v in self.params.values())),
            "steps": {"bind": len(self.plan.bind_steps), "run": len(self.plan.steps),
                      **({"train": len(self.train_plan.steps)} if self.train_plan else {})},
            "sizes": {"kernels_so_bytes": len(self.lib_bytes),
                      "params_bytes": int(sum(v.nbytes for v in self.params.values()))},
        }

    def kernels(self) -> list[str]:
        names = dict.fromkeys(self.plan.kernels())
        if self.train_plan is not None:
            names.update(dict.fromkeys(self.train_plan.kernels()))
        return list(names)

    # ------------------------------------------------------------------ running
    def device(self):
        """The device the kernels run on: the CPU, or CUDA device 0 for a cuda artifact
        (``$GCOMP_CUDA_DEVICE`` picks another); a clear error when there is none."""
        import tvm
        if self.target.get("kind") != "cuda":
            return tvm.cpu()
        index = cuda_device_index()
        load_cuda_runtime()
        dev = tvm.cuda(index)
        try:
            present = bool(dev.exist)
        except Exception:  # noqa: BLE001 - no driver: the CUDA runtime cannot even ask
            present = False
        if not present:
            which = "none was found" if index == 0 else f"there is no CUDA device {index} " \
                "(GCOMP_CUDA_DEVICE)"
            raise ArtifactError(f"this artifact was compiled for CUDA ({self.target.get('arch')}) "
                                f"and needs a CUDA GPU; {which}")
        return dev

    def library(self):
        """The kernel library, loaded once (from a private temporary directory)."""
        if self._lib is None:
            import tvm
            if self.target.get("kind") == "cuda":
                cuda_device_index()  # a bad setting is named before the runtime's errors
                load_cuda_runtime()
            lacks = missing(self.manifest.get("isa", []))
            if lacks:
                raise ArtifactError(
                    f"this artifact was compiled for CPU {self.target.get('mcpu')!r}, whose "
                    f"instructions this CPU lacks ({', '.join(lacks)}): its kernels would "
                    f"stop with an illegal instruction; compile it here (gcomp compile "
                    f"targets this CPU unless --mcpu names another)")
            if "amx" in self.manifest.get("cpu_features", []):
                why = enable_amx()
                if why is not None:
                    raise ArtifactError(f"this artifact's products run on AMX tiles, and {why}; "
                                        "compile it here (or with --precision fp32)")
            if "avx512_bf16" in self.manifest.get("cpu_features", []) \
                    and missing(["avx512bf16"]):
                raise ArtifactError("this artifact's products run on AVX-512 BF16 dot products, "
                                    "and this CPU has none (/proc/cpuinfo flag avx512_bf16); "
                                    "compile it here (or with --precision fp32)")
            self._libdir = tempfile.TemporaryDirectory(prefix="gcomp-")
            lib_path = Path(self._libdir.name) / LIB_NAME
            lib_path.write_bytes(self.lib_bytes)
            try:
                self._lib = tvm.runtime.load_module(str(lib_path))
            except Exception as e:  # noqa: BLE001
                raise ArtifactError(f"cannot load the kernel library of this artifact: {e}") from None
        return self._lib

    def executor(self):
        """An executor of the forward plan (inference)."""
        with _EXECUTOR_LOCK:  # threads calling run() at once share one executor
            if self._executor is None:
                from gcomp.runtime.executor import Executor
                self._executor = Executor(self.plan, self.library(), self.params,
                                          device=self.device())
        return self._executor

    def run(self, graph, features: dict | None = None) -> list[np.ndarray]:
        return self.executor().run(graph, features)

    # ------------------------------------------------------------------ files
    def to_bytes(self) -> bytes:
        members = {
            "plan.json": json.dumps(self.plan.to_json(), indent=1, sort_keys=True).encode(),
            **({"train_plan.json": json.dumps(self.train_plan.to_json(), indent=1,
                                              sort_keys=True).encode()}
               if self.train_plan is not None else {}),
            "params.npz": _npz_bytes(self.params),
            LIB_NAME: self.lib_bytes,
        }
        for name, text in self.ir.items():
            members[f"ir/{name}.ir"] = text.encode()
        manifest = dict(self.manifest, files={k: _sha(v) for k, v in sorted(members.items())})
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            z.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
            for name, data in members.items():
                z.writestr(name, data)
        return buf.getvalue()

    def save(self, path: str | Path) -> Path:
        data = self.to_bytes()
        return write_atomic(path, lambda f: f.write(data))


def load_cuda_runtime() -> None:
    """Make sure TVM's CUDA runtime plugin is loaded: a runtime-only TVM
    (``TVM_USE_RUNTIME_LIB=1``, ``docs/cuda.md``) does not load it by itself."""
    import ctypes

    import tvm
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    path = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(path), ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"cannot load TVM's CUDA runtime ({path}): {e}; a cuda artifact needs "
                            "the NVIDIA driver (libcuda.so.1) and libcudart.so.13") from None


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def new_manifest(model: dict, signature: dict, target: dict, ops: dict,
                 device_code_format: str | None = None, optimizer: dict | None = None,
                 precision: str = "fp32", cpu_features: list | None = None,
                 isa=()) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "plan_version": PLAN_VERSION,
        "gcomp_version": __version__,
        "tvm_version": tvm_version(),
        "target": target,
        "device_code_format": device_code_format,
        "model": model,
        "signature": signature,
        "ops": ops,
        "optimizer": optimizer,
        "precision": precision,
        # "amx" tiles (beyond the target's instructions) or "avx512_bf16" dot products
        "cpu_features": list(cpu_features or []),
        "isa": list(isa),  # the target CPU's vector instruction sets (LLVM's names)
    }


def _check_plans(path: Path, plans: list, params: dict) -> None:
    """Each plan has outputs (its steps may all run once per feed: an aggregation of the
    features alone), and a value of its shape for each parameter."""
    for p in plans:
        if not p.outputs:
            raise ArtifactError(f"{str(path)!r} is corrupt: a plan without outputs")
        for name in p.params:
            buf = p.buffers.get(name)
            if name not in params or buf is None:
                raise ArtifactError(f"{str(path)!r} is corrupt: parameter {name!r} is missing")
            want = tuple(int(d) for d in buf["dims"])
            if params[name].shape != want:
                raise ArtifactError(f"{str(path)!r} is corrupt: parameter {name!r} has shape "
                                    f"{list(params[name].shape)}, its plan says {list(want)}")


def load(path: str | Path) -> Artifact:
    """Open and check an artifact; raises ArtifactError naming what is wrong."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise ArtifactError(f"artifact {str(path)!r} does not exist") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"{str(path)!r} is not a gcomp artifact (not a readable archive: {e})") from None
    with zf:
        names = set(zf.namelist())
        if "manifest.json" not in names:
            # a truncated artifact reads as the archive it stores last (params.npz)
            cut = " or is truncated" if names and all(n.endswith(".npy") for n in names) else ""
            raise ArtifactError(f"{str(path)!r} is not a gcomp artifact{cut} (no "
                                f"manifest.json)")
        try:
            manifest = json.loads(zf.read("manifest.json"))
        except (ValueError, zipfile.BadZipFile, OSError) as e:
            raise ArtifactError(f"{str(path)!r}: corrupt manifest: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ArtifactError(f"{str(path)!r} is not a gcomp artifact (manifest format "
                                f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{str(path)!r} has artifact format version "
                                f"{manifest.get('format_version')!r}; this gcomp ({__version__}) "
                                f"reads version {FORMAT_VERSION}: recompile the model")
        plan_version = manifest.get("plan_version", 1)
        if not isinstance(plan_version, int) or plan_version > PLAN_VERSION:
            raise ArtifactError(f"{str(path)!r} holds a plan of version "
                                f"{plan_version!r}; this gcomp ({__version__}) "
                                f"runs plans up to version {PLAN_VERSION}: update gcomp or "
                                "recompile the model")
        built_tvm, here = manifest.get("tvm_version"), tvm_version()
        if built_tvm != here:
            raise ArtifactError(f"{str(path)!r} was built with TVM {built_tvm}; this runtime has "
                                f"TVM {here}: recompile the model with this version")
        files = manifest.get("files") or {}
        if not isinstance(files, dict):
            raise ArtifactError(f"{str(path)!r} is corrupt: its manifest's files are not a "
                                f"table of members and digests")
        data = {}
        for name, digest in files.items():
            if name not in names:
                raise ArtifactError(f"{str(path)!r} is corrupt: member {name} is missing")
            try:
                blob = zf.read(name)
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise ArtifactError(f"{str(path)!r} is corrupt: cannot read {name}: {e}") from None
            if _sha(blob) != digest:
                raise ArtifactError(f"{str(path)!r} is corrupt: {name} does not match its SHA-256")
            data[name] = blob
        for required in ("plan.json", "params.npz", LIB_NAME):
            if required not in data:
                raise ArtifactError(f"{str(path)!r} is corrupt: the manifest lists no {required}")
    target = manifest.get("target")
    if not isinstance(target, dict) or target.get("kind") not in ("llvm", "cuda"):
        raise ArtifactError(f"{str(path)!r} is corrupt: its manifest names no llvm or cuda "
                            f"target (target {target!r})")
    plans = {}
    for name in ("plan.json", "train_plan.json"):
        if name in data:
            try:
                plans[name] = Plan.from_json(json.loads(data[name]))
            except (ValueError, TypeError) as e:
                raise ArtifactError(f"{str(path)!r} is corrupt: {name} is not a plan: "
                                    f"{e}") from None
    plan, train_plan = plans["plan.json"], plans.get("train_plan.json")
    if plan_version < HUB_TASKS_VERSION and any(
            a.get("array", "").endswith("hub_tasks") for p in (plan, train_plan) if p
            for s in p.bind_steps + p.feed_steps + p.steps for a in s["args"]):
        raise ArtifactError(f"{str(path)!r} holds a plan of version {plan_version}, whose GPU "
                            "kernels read hub tasks without their row; this gcomp "
                            f"({__version__}) binds graphs for version {PLAN_VERSION}: recompile "
                            "the model")
    try:
        with np.load(io.BytesIO(data["params.npz"]), allow_pickle=False) as z:
            params = {k: np.array(z[k], dtype=np.float32) for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{str(path)!r} is corrupt: params.npz: {e}") from None
    _check_plans(path, [p for p in (plan, train_plan) if p], params)
    try:
        ir = {n[3:-3]: data[n].decode() for n in data if n.startswith("ir/")}
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{str(path)!r} is corrupt: an IR member is not text: "
                            f"{e}") from None
    return Artifact(manifest, plan, params, data[LIB_NAME], ir, train_plan)
