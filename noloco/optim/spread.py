"""How far apart a worker expects its partners' slow weights to be: the grids of a coset-coded slow term.

NoLoCo's pull needs the partners' φ − φ_0, which differs from a worker's own by much less than either's size
(docs/design.md §3.2). A coset code (``comm.slow_codec=coset3``, :class:`~noloco.collectives.codec.CosetCodec`)
sends only the low bits of each value's index on a grid fine enough for that difference, so the sender must
guess the difference before it knows its partners. :class:`SpreadHistory` keeps the guess: for each block of 128
positions of the flat vector, the largest distance to a partner seen the last time that block was exchanged
(``members × |group mean − own|``: exact for a pair, where the mean is halfway, an estimate in larger groups), less
the coding noise in it (two grid steps: each side's rounding and the residual its error feedback added). Left in,
that noise would widen the next grid, whose noise widens the one after: the grid would grow without end.
A block never exchanged (stored as -1) is guessed from the blocks that were: their distance over their largest
value, the 90th percentile over the last exchange (``ratio``), times the block's own largest value. With the slow
term staggered over k rounds each block is exchanged only every k-th round, and over a short run that first
exchange is a large share of all of them: a block with no guess at all (NaN to the codec: a grid twice its own
range) sends next to nothing. The codec widens the guess by its margin; a partner further away than the grid
covers decodes a wrapped, bounded value.

The history is part of the outer algorithm's checkpoint (``slow_spread``); partners come and go, so a restored
history is a guess like any other and nothing depends on it being a particular partner's.
"""

from __future__ import annotations

import torch

from noloco.quant.coset import BLOCK, block_max
from noloco.state import StateError, all_finite, check_tensor

#: a block whose distance is not known yet (checkpoints hold finite values only)
UNKNOWN = -1.0


class SpreadHistory:
    """One expected distance per block of :data:`BLOCK` positions of a flat vector of ``numel`` values."""

    def __init__(self, numel: int, device: torch.device | str = "cpu") -> None:
        self.numel = int(numel)
        self.blocks = torch.full((-(-self.numel // BLOCK),), UNKNOWN, dtype=torch.float32, device=device)
        #: distance over the block's largest value, 90th percentile over the last exchange's blocks (-1: none yet)
        self.ratio = UNKNOWN

    def _span(self, part: slice) -> tuple[int, int, int]:
        """(first block, blocks covered, positions before ``part.start`` in the first block)."""
        first, lead = divmod(part.start, BLOCK)
        return first, -(-(lead + part.stop - part.start) // BLOCK), lead

    def spread_for(self, part: slice, values: torch.Tensor | None = None) -> torch.Tensor:
        """The expected distance of each 128-value block of the slice ``part`` (blocks counted from its start):
        the largest known of the history blocks it overlaps; where none is known, :attr:`ratio` times the block's
        largest ``|values|`` (the slice's values, when given and a ratio is known), else NaN."""
        first, count, lead = self._span(part)
        length = part.stop - part.start
        per_value = self.blocks[first : first + count].repeat_interleave(BLOCK)[lead : lead + length]
        pad = -length % BLOCK
        if pad:
            per_value = torch.cat([per_value, per_value[-1:].expand(pad)])
        spread = per_value.view(-1, BLOCK).amax(dim=1)
        guess = torch.full_like(spread, float("nan"))
        if values is not None and self.ratio >= 0:
            guess = self.ratio * block_max(values).float().to(spread.device)
        return torch.where(spread < 0, guess, spread)

    def update(self, part: slice, own: torch.Tensor, mean: torch.Tensor, members: int, step: torch.Tensor) -> None:
        """Record the exchange of ``part``: this worker's values ``own``, the group's ``mean`` of ``members``, and
        each value's grid step ``step`` in that exchange."""
        if members < 2:
            return
        first, count, lead = self._span(part)
        distance = (mean.detach().float() - own.detach().float()).abs_().mul_(float(members)).reshape(-1)
        distance = (distance - 2 * step.to(distance.device, torch.float32)).clamp_(min=0.0)
        padded = distance.new_zeros(count * BLOCK)
        padded[lead : lead + distance.numel()] = distance
        self.blocks[first : first + count] = padded.view(-1, BLOCK).amax(dim=1).to(self.blocks.device)
        top = block_max(own).float()  # per block of the slice, as the codec's grids are
        ratios = block_max(distance).float()[top > 0] / top[top > 0]
        if ratios.numel():
            self.ratio = float(torch.quantile(ratios.double().cpu(), 0.9))

    def to(self, device: torch.device | str) -> SpreadHistory:
        self.blocks = self.blocks.to(device)
        return self

    def state_dict(self) -> dict:
        return {"version": 1, "blocks": self.blocks.detach().cpu().clone(), "ratio": self.ratio}

    @staticmethod
    def check_state(state, numel: int, where: str = "slow_spread") -> None:
        """:class:`StateError` unless ``state`` is a history of a flat vector of ``numel`` values: one fp32 distance
        per block, each non-negative or -1 (unknown); finiteness is the checkpoint reader's check."""
        if not isinstance(state, dict) or state.get("version") != 1 or set(state) != {"version", "blocks", "ratio"}:
            raise StateError(f"{where}: not a spread history (version 1 with 'blocks' and 'ratio')")
        ratio = state["ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, float | int) or not (ratio >= 0 or ratio == UNKNOWN) or (
                ratio != ratio or ratio == float("inf")):  # fmt: skip
            raise StateError(f"{where}/ratio: {ratio!r} is not a ratio >= 0 (or {UNKNOWN:g}, unknown)")
        blocks = state["blocks"]
        check_tensor(blocks, f"{where}/blocks", (-(-numel // BLOCK),))
        if bool(((blocks < 0) & (blocks != UNKNOWN)).any()) or not all_finite(blocks):
            raise StateError(f"{where}/blocks: a distance is negative (other than {UNKNOWN:g}, unknown) or not finite")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state, self.numel)
        self.blocks = state["blocks"].to(self.blocks.device, torch.float32).clone()
        self.ratio = float(state["ratio"])
