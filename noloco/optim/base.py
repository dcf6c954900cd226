"""The outer-update interface: pure tensor math, no transports.

An outer rule receives this worker's slow weights ``φ`` (one flat fp32 vector) and the group means
that a collective produced, and updates ``φ`` in place. It owns its state (momentum) and nothing
else. The exchange that produces the means lives in :mod:`noloco.optim.algorithms`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from noloco.state import check_keys, check_tensor


class OuterRule(ABC):
    """One outer update ``φ ← f(φ, mean_Δ, mean_φ)`` with its own state.

    Attributes:
        needs_slow_mean: whether :meth:`step` needs ``mean_slow`` (the group mean of ``φ``); rules
            that do not can skip that exchange.
    """

    needs_slow_mean: bool = False
    #: the outer momentum buffer (flat fp32), for rules that keep one; a joining worker adopts it
    velocity: torch.Tensor | None = None

    @abstractmethod
    def step(self, slow: torch.Tensor, mean_delta: torch.Tensor, mean_slow: torch.Tensor | None,
             part: slice | None = None) -> None:  # fmt: skip
        """Update ``slow`` in place (only ``slow[part]`` when ``part`` is given).

        Args:
            slow: this worker's slow weights φ_i, 1-D fp32 (mutated).
            mean_delta: group mean of pseudo-gradients ``θ_j − φ_j``, the shape of ``slow[part]``.
            mean_slow: group mean of slow weights ``φ_j`` (``None`` unless ``needs_slow_mean``), same shape.
            part: a fragment of the flat vector (``outer.fragments``, docs/design.md §3.1): the update and
                the state it uses (the momentum's same slice) touch only these positions; None: all.
        """

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @staticmethod
    def check_state(state, numel: int, where: str = "rule") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is a rule's state for ``numel`` slow weights: at
        most a momentum ``velocity`` (None before the first step), flat fp32."""
        check_keys(state, where, set(), {"velocity"})
        if state.get("velocity") is not None:
            check_tensor(state["velocity"], f"{where}/velocity", (numel,))


def _lazy_buffer(buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if buffer is None or buffer.shape != like.shape:
        return torch.zeros_like(like, dtype=torch.float32)
    return buffer


def _part(tensor: torch.Tensor, part: slice | None) -> torch.Tensor:
    """``tensor[part]`` as a view (in-place updates reach ``tensor``); the tensor itself for None."""
    return tensor if part is None else tensor[part]
