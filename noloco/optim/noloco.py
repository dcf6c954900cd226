"""NoLoCo outer step: momentum plus a pull toward the subgroup mean, no global all-reduce.

Implements the outer update of NoLoCo (Kolehmainen et al., "NoLoCo: No-all-reduce Low
Communication Training Method for Large Models", arXiv 2506.10911), as written in docs/design.md §3.1.
With ``G`` the worker's subgroup (itself included)::

    mean_Δ = mean_{j∈G}(θ_j − φ_j)
    mean_φ = mean_{j∈G} φ_j
    m_i ← μ·m_i + β·mean_Δ + γ·(mean_φ − φ_i)
    φ_i ← φ_i + m_i

β (``lr``) and γ (``pull``) are kept separate because compression treats Δ and φ differently.
Adam moments are not averaged.
"""

from __future__ import annotations

import torch

from noloco.optim.base import OuterRule, _lazy_buffer, _part


class NoLoCoRule(OuterRule):
    needs_slow_mean = True

    def __init__(self, lr: float = 0.7, pull: float = 0.7, momentum: float = 0.5):
        for name, value in (("lr", lr), ("pull", pull), ("momentum", momentum)):
            if not value >= 0:
                raise ValueError(f"NoLoCo {name} must be >= 0, got {value}")
        self.lr, self.pull, self.momentum = float(lr), float(pull), float(momentum)
        self.velocity: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, slow: torch.Tensor, mean_delta: torch.Tensor, mean_slow: torch.Tensor | None,
             part: slice | None = None) -> None:  # fmt: skip
        if mean_slow is None:
            raise ValueError("NoLoCo needs the group mean of the slow weights")
        self.velocity = _lazy_buffer(self.velocity, slow)
        velocity, slow = _part(self.velocity, part), _part(slow, part)
        velocity.mul_(self.momentum).add_(mean_delta, alpha=self.lr)
        if not _aliases(mean_slow, slow):  # an alias of φ: the group mean of φ is this worker's own, no pull
            velocity.add_(mean_slow - slow, alpha=self.pull)
        slow.add_(velocity)

    def state_dict(self) -> dict:
        return {"velocity": None if self.velocity is None else self.velocity.clone()}

    def load_state_dict(self, state: dict) -> None:
        velocity = state["velocity"]
        self.velocity = None if velocity is None else velocity.detach().float().clone()


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (e.g. ``slow`` and a view of it)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
