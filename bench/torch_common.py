"""The step functions shared by the torch-based peers (PyG, DGL).

inference: eval mode, ``torch.no_grad()``, one forward.
training:  one epoch = forward, cross-entropy over the training mask, backward, Adam (lr 0.01).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.runner import Runner

LR = 0.01


def torch_runner(config: str, module: torch.nn.Module, forward, workload, mode: str,
                 setup: dict, notes: list, compile_first: bool = False) -> Runner:
    """``forward()`` runs ``module`` on the workload's inputs and returns the logits.
    ``compile_first``: make the first call now (torch.compile compiles in it) and report its
    time as ``setup["compile_s"]``; in training mode that call is forward + backward without
    the optimizer step, so the weights stay those of the gcomp model."""
    if mode == "inference":
        def step():
            module.eval()
            with torch.no_grad():
                return forward()
        first = step
    else:
        y = torch.from_numpy(workload.y)
        mask = torch.from_numpy(workload.train_mask)
        opt = torch.optim.Adam(module.parameters(), lr=LR)

        def first(update=False):
            module.train()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(forward()[mask], y[mask])
            loss.backward()
            if update:
                opt.step()
            else:
                opt.zero_grad(set_to_none=True)
            return loss

        def step():
            return first(update=True)

    if compile_first:
        t0 = time.perf_counter()
        first()
        setup["compile_s"] = time.perf_counter() - t0

    def output() -> np.ndarray:
        module.eval()
        with torch.no_grad():
            return forward().detach().numpy().copy()

    return Runner(config, step, output, setup, notes)


def t32(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))
