"""Optimizer updates appended to a training plan: the last kernels of a step.

Expects: a plan lowered from a training graph (``graph.meta["grads"]`` names each
parameter's gradient).  Guarantees: in-place update kernels after the backward
kernels, one per parameter (or, with ``one_kernel``, the GPU's choice, one for all
parameters: a 3-layer GIN has 15, and each launch cost about 6 us of an arxiv-size
epoch's 1.6 ms on an H200), reading hyperparameters from the constant buffer
``opt.hparams`` and the 1-based step from the scalar input ``opt_step``;
optimizer moments are plan ``state`` (zero at start, saved in checkpoints).
Semantics are torch.optim's: Adam with L2 ``weight_decay`` added to the
gradient, SGD with momentum, dampening and Nesterov.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import isfinite, prod

from gcomp.codegen.kernels import KernelSpec
from gcomp.errors import CompileError
from gcomp.runtime.plan import Plan

STEP = "opt_step"
HPARAMS = "opt.hparams"


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if self.name not in ("adam", "sgd"):
            raise CompileError(f"unknown optimizer {self.name!r} (adam, sgd)")
        values = {k: float(getattr(self, k)) for k in
                  ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening")}
        bad = [f"{k}={v}" for k, v in values.items() if not isfinite(v)]
        if bad:
            raise CompileError(f"optimizer hyperparameters must be finite: {', '.join(bad)}")
        if self.lr <= 0 or self.weight_decay < 0 or self.eps <= 0:
            raise CompileError("optimizer needs lr > 0, eps > 0 and weight_decay >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise CompileError("adam needs 0 <= beta1, beta2 < 1")
        if self.momentum < 0 or not 0 <= self.dampening <= 1:
            raise CompileError("sgd needs momentum >= 0 and 0 <= dampening <= 1")
        if self.name == "adam" and (self.momentum or self.dampening or self.nesterov):
            raise CompileError("momentum, dampening and nesterov are sgd's; adam has beta1 "
                               "and beta2 (--optimizer sgd to use them)")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise CompileError("nesterov needs a momentum > 0 and no dampening (as "
                               "torch.optim.SGD)")

    def hparams(self) -> list[float]:
        if self.name == "adam":
            return [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay]
        # without momentum torch ignores dampening (the update is the gradient itself)
        dampening = self.dampening if self.momentum else 0.0
        return [self.lr, self.momentum, dampening, self.weight_decay, float(self.nesterov)]

    def to_json(self) -> dict:
        return asdict(self)


def add_optimizer(plan: Plan, specs: dict, cfg: OptimizerConfig, one_kernel: bool = False
                  ) -> None:
    plan.consts[HPARAMS] = cfg.hparams()
    plan.buffers[HPARAMS] = {"dims": [5], "dtype": "float32"}
    plan.buffers[STEP] = {"dims": [], "dtype": "int32"}
    plan.inputs.append({"name": STEP, "role": "scalar", "dims": [], "dtype": "int32"})
    plan.state.append(STEP)
    moments = ("m", "v") if cfg.name == "adam" else ("buf",)
    sizes, group = [], []
    for p, g in plan.grads.items():
        size = int(prod(plan.buffers[p]["dims"]))
        names = []
        for m in moments:
            name = f"opt.{m}.{p}"
            plan.buffers[name] = {"dims": list(plan.buffers[p]["dims"]), "dtype": "float32"}
            plan.state.append(name)
            names.append(name)
        flat = [size]
        args = [{"buf": p, "view": flat}, {"buf": g, "view": flat}]
        args += [{"buf": n, "view": flat} for n in names]
        if one_kernel:
            sizes.append(size)
            group += args
            continue
        spec = KernelSpec.make(cfg.name, S=size)
        specs[spec.name] = spec
        plan.steps.append({"kernel": spec.name, "args": args + [{"buf": HPARAMS}, {"buf": STEP}],
                           "node": f"{cfg.name}.{p}", "op": "optimizer", "attrs": {"param": p}})
    if sizes:
        spec = KernelSpec.make(f"{cfg.name}_all", sizes=sizes)
        specs[spec.name] = spec
        plan.steps.append({"kernel": spec.name, "args": group + [{"buf": HPARAMS}, {"buf": STEP}],
                           "node": cfg.name, "op": "optimizer",
                           "attrs": {"params": list(plan.grads)}})
