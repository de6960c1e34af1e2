"""Optimizers written for the tests, shared by the in-process tests and the torchrun workers (which import it as a
sibling: ``tests/`` is their ``sys.path[0]``, as it is pytest's)."""
from __future__ import annotations

import torch


class ClipAboveSGD(torch.optim.Optimizer):
    """SGD with momentum (0.9) that divides every gradient by the norm of all of them once that norm exceeds
    ``max_norm`` (timm's ``Lamb`` with ``max_grad_norm``): per parameter while it does not, as in the probe's step.
    ``max_norm`` is infinite until a test lowers it (on the instance) under the gradients' norm: from then on its
    update of a parameter depends on all the others."""

    max_norm = float("inf")

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
        scale = self.max_norm / norm if norm > self.max_norm else 1.0
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    m = self.state[p].setdefault("m", torch.zeros_like(p))
                    m.mul_(0.9).add_(p.grad * scale)
                    p.add_(m, alpha=-g["lr"])
