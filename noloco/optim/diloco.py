"""DiLoCo outer step: Nesterov SGD on the globally averaged pseudo-gradient.

Implements the outer optimizer of DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105): every H inner steps all workers average their
pseudo-gradients ``g = φ − θ`` and apply SGD with Nesterov momentum (lr 0.7, μ 0.9), the same
update as ``torch.optim.SGD(nesterov=True)``::

    v ← μ·v + g ;  φ ← φ − lr·(g + μ·v)

Also the plain periodic-averaging baseline over the whole world: ``φ ← φ + mean_Δ``. All workers
share the same slow weights, so this sets them to the mean of the fast weights (DiLoCo with lr 1
and no momentum).
"""

from __future__ import annotations

import torch

from noloco.optim.base import OuterRule, _lazy_buffer, _part


class DiLoCoRule(OuterRule):
    needs_slow_mean = False

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"DiLoCo needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.velocity: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, slow: torch.Tensor, mean_delta: torch.Tensor, mean_slow: torch.Tensor | None,
             part: slice | None = None) -> None:  # fmt: skip
        grad = -mean_delta
        self.velocity = _lazy_buffer(self.velocity, slow)
        velocity = _part(self.velocity, part)
        velocity.mul_(self.momentum).add_(grad)
        update = grad.add(velocity, alpha=self.momentum) if self.nesterov else velocity
        _part(slow, part).add_(update, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"velocity": None if self.velocity is None else self.velocity.clone()}

    def load_state_dict(self, state: dict) -> None:
        velocity = state["velocity"]
        self.velocity = None if velocity is None else velocity.detach().float().clone()


class AveragingRule(OuterRule):
    """Periodic model averaging: ``φ ← φ + mean_Δ``, the world mean of the fast weights when every
    worker holds the same ``φ`` (which global averaging maintains)."""

    needs_slow_mean = False

    @torch.no_grad()
    def step(self, slow: torch.Tensor, mean_delta: torch.Tensor, mean_slow: torch.Tensor | None,
             part: slice | None = None) -> None:  # fmt: skip
        _part(slow, part).add_(mean_delta)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
