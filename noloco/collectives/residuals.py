"""Error feedback for reductions: what this member quantized, paid back in its next call.

Error feedback (docs/design.md §3.3; Seide et al. 2014, Karimireddy et al. arXiv 1901.09847) keeps the
error of each quantization and adds it to the next value quantized at the same place. In a
reduction a member quantizes two different things, so :class:`ReductionErrorFeedback` keeps two
fp32 residuals, both indexed by *position in the flat vector* (not by segment), so they stay
meaningful when segment ownership moves between calls (NoLoCo regroups every round):

- ``contribution`` (phase 1 of two-phase; every hop of a ring): the error of what this member put
  on the wire *on behalf of its own input*. Next call it is added to this member's input before
  anything is encoded. Where this member owns the segment (sent unquantized) the residual is added
  exactly and drops to zero. So the sum of what a member contributed over calls tracks the sum of
  its inputs, whatever the grouping. In a ring the residual of a hop also holds the re-encoding
  error of the partial sum carried through this member; paying it back through this member's next
  contribution restores the group total, which is what the reduction computes.
- ``result`` (phase 2 / all-gather, as owner): the error of encoding the reduced segment that every
  member then decodes. It is in units of the result (mean or sum) and is added to the reduced
  segment the next time this member owns that position. With a fixed group (DiLoCo, DDP) that is
  the next call, and every member receives the correction. With regrouping, the correction goes to
  the next group in which this member owns those positions: with equal group sizes the swarm-wide
  total of applied updates is still conserved; until then it waits (it stays bounded, one
  quantization error per position).

Decay (``ReductionErrorFeedback(decay=0.95)``; default 1, no decay): both residuals are multiplied by
``decay`` when a call takes them (:meth:`residuals_for`), so each call sends ``x + decay·e`` and keeps
``e <- x + decay·e - decoded`` (SparseLoCo, arXiv 2508.15706; docs/quant.md, "Error feedback").

The caller owns one object per call site and buffer (e.g. one for the pseudo-gradient, one for the
slow weights) and keeps it across calls; it is checkpointable (:meth:`state_dict`). A call that
fails leaves it unchanged (residuals are committed only when the reduction succeeds).
"""

from __future__ import annotations

import torch

from noloco.quant.feedback import check_decay
from noloco.state import StateError, all_finite, check_keys, check_tensor, is_int


class ReductionErrorFeedback:
    """Per-call-site error-feedback state for :func:`noloco.collectives.allreduce`.

    Example::

        ef = ReductionErrorFeedback()
        for r in rounds:
            mean = allreduce(delta, transport, group, codec="int4", error_feedback=ef, tag=f"outer/r{r}/delta")
    """

    def __init__(self, decay: float = 1.0) -> None:
        """``decay`` in (0, 1]: factor applied to both residuals at the start of each call (``ValueError`` else)."""
        self.decay = check_decay(decay)
        self.contribution: torch.Tensor | None = None
        self.result: torch.Tensor | None = None

    @property
    def numel(self) -> int | None:
        """Length of the vector this state tracks (None before the first call)."""
        return None if self.contribution is None else self.contribution.numel()

    def residuals_for(self, numel: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of both residuals (zeros on first use), times ``decay``, on ``device`` for a call on ``numel``
        elements.

        Raises:
            ValueError: the state tracks a vector of another length.
        """
        if self.contribution is None or self.result is None:
            zeros = torch.zeros(numel, dtype=torch.float32, device=device)
            return zeros, zeros.clone()
        if self.contribution.numel() != numel:
            raise ValueError(
                f"error-feedback state tracks {self.contribution.numel()} values, this call reduces {numel}; "
                "use one ReductionErrorFeedback per buffer (or reset() it)"
            )
        contribution, result = self.contribution.to(device, copy=True), self.result.to(device, copy=True)
        if self.decay != 1.0:
            contribution.mul_(self.decay)
            result.mul_(self.decay)
        return contribution, result

    def commit(self, contribution: torch.Tensor, result: torch.Tensor) -> None:
        """Store the residuals of a call that succeeded."""
        self.contribution, self.result = contribution, result

    def reset(self) -> None:
        """Forget both residuals."""
        self.contribution = self.result = None

    def state_dict(self) -> dict:
        return {
            "version": 1,
            "contribution": None if self.contribution is None else self.contribution.clone(),
            "result": None if self.result is None else self.result.clone(),
        }

    @staticmethod
    def check_state(state, numel: int, where: str = "feedback") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is an error-feedback state of a vector of ``numel``
        values (fp32 residuals, both or neither)."""
        check_keys(state, where, {"version", "contribution", "result"})
        if not is_int(state["version"]) or state["version"] != 1 or \
                (state["contribution"] is None) != (state["result"] is None):  # fmt: skip
            raise StateError(f"{where}: not an error-feedback state")
        for part in ("contribution", "result"):
            if state[part] is not None:
                check_tensor(state[part], f"{where}/{part}", (numel,))

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown ReductionErrorFeedback state version {state.get('version')!r}")
        contribution, result = state["contribution"], state["result"]
        if (contribution is None) != (result is None):
            raise ValueError("error-feedback state holds one residual without the other")
        if contribution is not None:
            contribution = torch.as_tensor(contribution, dtype=torch.float32).reshape(-1).clone()
            result = torch.as_tensor(result, dtype=torch.float32).reshape(-1).clone()
            if contribution.numel() != result.numel():
                raise ValueError("error-feedback residuals have different lengths")
            if not (all_finite(contribution) and all_finite(result)):
                raise ValueError("error-feedback residuals hold NaN or Inf")
        self.contribution, self.result = contribution, result
