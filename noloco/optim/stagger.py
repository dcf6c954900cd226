"""The staggered slow-weight term of NoLoCo's split exchange (``outer.slow_stagger``, docs/design.md §3.2).

NoLoCo (arXiv 2506.10911) pulls each worker's slow weights φ toward its group's mean every outer round. The split
exchange (``outer.slow_every=k``) sends the slow-weight term φ − φ₀ in one round of every k only, so one round in
k carries the whole term (for a 125M model about 65 MB at int4) and the others none. Staggered, the term is cut
into k contiguous slices and round r sends slice (r ÷ fragments) mod k, and the pull is applied on that slice
alone: every parameter is still pulled once per k rounds, with the paper's γ, and every round sends about 1/k of
the term.

:func:`stagger_slices` is pure arithmetic on a vector's length; :func:`stagger_index` reads the slice of a round
from the round's index alone, so every member of a group (a fixed world's or a swarm's) picks the same slice with
no message. :class:`SliceFeedback` lets one slice's reduction use, and update, the positions of the slice in the
term's full-length error-feedback state, so the checkpoint keeps the one state it had.
"""

from __future__ import annotations

import torch

from noloco.collectives import ReductionErrorFeedback

#: a slice's boundaries fall on multiples of this many values when the vector is long enough: a multiple of every
#: codec's group (32, 64, 128) and of the usual top-k chunk (4,096), so a slice is quantized as it would be whole
ALIGN = 4096
#: the alignments tried in turn for shorter vectors (a codec group; then any position)
_FALLBACK_ALIGN = (128, 1)


def stagger_slices(numel: int, k: int) -> list[slice]:
    """Cut a vector of ``numel`` values into ``k`` contiguous, non-empty slices, in order.

    Cut j (j = 1 … k − 1) is ⌊j·numel / (k·a)⌋·a for the largest alignment a of (4096, 128, 1) that leaves every
    slice at least a long, so every slice is within a values of numel / k.

    Raises:
        ValueError: ``k < 1`` or ``numel < k`` (some slice would be empty).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"stagger needs an integer k >= 1, got {k!r}")
    if numel < k:
        raise ValueError(f"cannot cut {numel} values into {k} non-empty slices (outer.slow_every too large)")
    align = next(a for a in (ALIGN, *_FALLBACK_ALIGN) if numel // a >= k)
    cuts = [0, *[(j * numel) // (k * align) * align for j in range(1, k)], numel]
    return [slice(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def stagger_index(round_index: int, fragments: int, k: int) -> int:
    """The slice round ``round_index`` sends: rounds go in cycles of one exchange per fragment, and cycle c sends
    slice c mod ``k`` of its fragment (a function of the round's index only)."""
    return (round_index // fragments) % k


class SliceFeedback(ReductionErrorFeedback):
    """The error feedback of one slice ``piece`` of a vector of ``total`` values whose residuals ``full`` (a
    :class:`~noloco.collectives.ReductionErrorFeedback`) tracks whole.

    Replaces what :func:`noloco.collectives.allreduce` calls (``residuals_for``, ``commit``): it hands out copies
    of the slice's residuals (times ``full.decay``: a slice decays once per send of its own) and, when the
    reduction succeeds, writes the new ones back into ``full`` at the slice's positions (zeros elsewhere on first
    use). A failed reduction commits nothing, so ``full`` stays as it was.
    """

    def __init__(self, full: ReductionErrorFeedback, piece: slice, total: int) -> None:
        super().__init__(full.decay)
        self.full, self.piece, self.total = full, piece, int(total)

    @property
    def numel(self) -> int:
        """Length of the slice this state reduces."""
        return self.piece.stop - self.piece.start

    def residuals_for(self, numel: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the slice's two residuals on ``device`` (zeros before the first call), times the decay.

        Raises:
            ValueError: ``numel`` is not the slice's length, or ``full`` tracks a vector of another length.
        """
        if numel != self.numel:
            raise ValueError(f"slice feedback of {self.numel} values called on {numel}")
        full = self.full
        if full.contribution is None or full.result is None:
            zeros = torch.zeros(numel, dtype=torch.float32, device=device)
            return zeros, zeros.clone()
        if full.contribution.numel() != self.total:
            raise ValueError(f"error-feedback state tracks {full.contribution.numel()} values, the term {self.total}")
        pair = tuple(r[self.piece].to(device, copy=True) for r in (full.contribution, full.result))
        if self.decay != 1.0:
            for residual in pair:
                residual.mul_(self.decay)
        return pair

    def commit(self, contribution: torch.Tensor, result: torch.Tensor) -> None:
        """Write a successful reduction's residuals of the slice into ``full`` (mutated in place)."""
        full = self.full
        if full.contribution is None or full.result is None:
            zeros = torch.zeros(self.total, dtype=torch.float32, device=contribution.device)
            full.commit(zeros, zeros.clone())
        full.contribution[self.piece] = contribution.to(full.contribution.device)
        full.result[self.piece] = result.to(full.result.device)
