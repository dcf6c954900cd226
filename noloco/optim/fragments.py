"""Streamed fragments of the outer exchange: which slice of the flat parameter vector each fragment is, and the
fragment as an object that owns its error feedback (:class:`Fragment`).

Implements the fragment split of Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512): the parameters are cut into ``k`` contiguous fragments, and fragment
``j`` is exchanged every ``H`` inner steps, at the steps ≡ ``j·H/k`` (mod ``H``), so each exchange carries
about ``1/k`` of the bytes (the schedule and the outer rule per fragment: docs/design.md §3.1).

:func:`split_fragments` is pure arithmetic on parameter shapes. Each cut goes to the parameter-tensor
boundary nearest to ``j·N/k`` (``N`` parameters in all), so a fragment is a run of whole tensors in
parameter order. When no such split keeps every fragment within 20% of every other (a tensor, say a large
embedding, holds more than about ``N/k`` parameters on its own), the cuts go to the nearest *row*
boundary instead (a row: ``numel / shape[0]`` consecutive values of one tensor), inside that tensor. That
never fails to balance unless single rows are large against ``N/k``; the split is then used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from noloco.collectives import ReductionErrorFeedback

#: the largest fragment may hold at most this many times the parameters of the smallest
BALANCE = 1.2


def split_fragments(shapes: Sequence[Sequence[int]], k: int) -> list[slice]:
    """Cut the flat vector of tensors of ``shapes`` (in parameter order) into ``k`` contiguous slices.

    Args:
        shapes: the shapes of the parameter tensors, in the order of the flat vector.
        k: the number of fragments (>= 1).

    Returns:
        ``k`` slices of the flat vector, in order, covering every position exactly once.

    Raises:
        ValueError: ``k < 1``, or the parameters have fewer rows than ``k`` (some fragment would be empty).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"fragments must be an integer >= 1, got {k!r}")
    sizes = [_numel(shape) for shape in shapes]
    total = sum(sizes)
    if k == 1:
        return [slice(0, total)]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    tensor_cuts = _nearest_cuts(offsets[1:-1], total, k)
    if tensor_cuts is not None and _balanced(tensor_cuts, total):
        return _slices(tensor_cuts, total)
    row_boundaries = set(offsets[1:-1])
    for shape, offset, size in zip(shapes, offsets, sizes):
        rows = _rows(shape)
        row_boundaries.update(offset + i * (size // rows) for i in range(1, rows))
    row_cuts = _nearest_cuts(sorted(row_boundaries), total, k)
    if row_cuts is None:
        raise ValueError(f"fragments={k}: the parameters have too few rows to cut them into {k} non-empty fragments")
    return _slices(row_cuts, total)


class Fragment:
    """One fragment of the outer exchange (torchft's Streaming DiLoCo fragment is the model): its slice ``part`` of
    the flat vector and its own error feedback, of the pseudo-gradient (or the fused θ − φ_0) and of the
    slow-weight term (None where that term is exact or has no feedback). Owns their save, load and check.

    Residuals are indexed by position, so a checkpoint stores every fragment's side by side as one full-length
    error-feedback state per term (:meth:`joined_state`), the format of a run of one fragment; a fragment not
    exchanged yet holds zeros there, which is what its first reduction starts from anyway.
    """

    TERMS = ("feedback", "slow_feedback")

    def __init__(self, part: slice, feedback: ReductionErrorFeedback | None,
                 slow_feedback: ReductionErrorFeedback | None):  # fmt: skip
        self.part, self.feedback, self.slow_feedback = part, feedback, slow_feedback

    @property
    def feedbacks(self) -> tuple[ReductionErrorFeedback | None, ReductionErrorFeedback | None]:
        """(the pseudo-gradient's, the slow-weight term's) error feedback."""
        return self.feedback, self.slow_feedback

    def state_dict(self) -> dict:
        """Each term's error-feedback state (None: no feedback), of this fragment's positions."""
        return {term: None if f is None else f.state_dict() for term, f in zip(self.TERMS, self.feedbacks)}

    def load_state_dict(self, state: dict) -> None:
        for term, feedback in zip(self.TERMS, self.feedbacks):
            if feedback is not None and state.get(term) is not None:
                feedback.load_state_dict(state[term])

    def check_state(self, state, where: str = "fragment") -> None:
        """:class:`~noloco.state.StateError` unless ``state`` is :meth:`state_dict`'s for this fragment's size."""
        size = self.part.stop - self.part.start
        for term in self.TERMS:
            if isinstance(state, dict) and state.get(term) is not None:
                ReductionErrorFeedback.check_state(state[term], size, f"{where}/{term}")

    @staticmethod
    def joined_state(fragments: Sequence[Fragment], term: str) -> dict | None:
        """One error-feedback state of ``term`` for the whole flat vector: the fragments' residuals side by side
        (one fragment: its own state, unchanged; no feedback: None)."""
        states = [f.state_dict()[term] for f in fragments]
        if len(states) == 1 or states[0] is None:
            return states[0]
        present = [state["contribution"] for state in states if state["contribution"] is not None]
        if not present:
            return states[0]

        def joined(key: str) -> torch.Tensor:
            return torch.cat([state[key] if state[key] is not None else
                              torch.zeros(f.part.stop - f.part.start, dtype=torch.float32, device=present[0].device)
                              for state, f in zip(states, fragments)])  # fmt: skip

        return {"version": 1, "contribution": joined("contribution"), "result": joined("result")}

    @staticmethod
    def load_joined(fragments: Sequence[Fragment], term: str, state: dict | None) -> None:
        """Load :meth:`joined_state`'s full-length state of ``term`` into each fragment's error feedback."""
        if state is None:
            return
        if len(fragments) == 1 or fragments[0].feedbacks[Fragment.TERMS.index(term)] is None:
            fragments[0].load_state_dict({term: state})  # (no feedback of that term: nothing to load)
            return
        contribution, result = state.get("contribution"), state.get("result")
        total = fragments[-1].part.stop
        for residual in (contribution, result):
            if residual is not None and residual.numel() != total:
                raise ValueError(f"error-feedback state tracks {residual.numel()} values, the parameters are {total}")
        for fragment in fragments:
            pieces = [None if t is None else t.reshape(-1)[fragment.part] for t in (contribution, result)]
            fragment.load_state_dict({term: {"version": state.get("version"), "contribution": pieces[0],
                                             "result": pieces[1]}})  # fmt: skip


def fragment_sizes(fragments: Sequence[slice]) -> list[int]:
    """Number of parameters in each fragment."""
    return [part.stop - part.start for part in fragments]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def _rows(shape: Sequence[int]) -> int:
    return int(shape[0]) if len(shape) and int(shape[0]) > 0 else 1


def _nearest_cuts(boundaries: list[int], total: int, k: int) -> list[int] | None:
    """For j = 1..k−1 the boundary nearest to j·total/k (ties: the lower), strictly increasing; None if
    there are too few boundaries for k non-empty fragments."""
    candidates = sorted(b for b in set(boundaries) if 0 < b < total)
    if len(candidates) < k - 1:
        return None
    cuts: list[int] = []
    lowest = 0  # index of the first candidate the next cut may take
    for j in range(1, k):
        ideal = j * total / k
        highest = len(candidates) - (k - 1 - j)  # leave one candidate for every later cut
        best = min(range(lowest, highest), key=lambda i: (abs(candidates[i] - ideal), candidates[i]))
        cuts.append(candidates[best])
        lowest = best + 1
    return cuts


def _balanced(cuts: list[int], total: int) -> bool:
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return min(sizes) > 0 and max(sizes) <= BALANCE * min(sizes)


def _slices(cuts: list[int], total: int) -> list[slice]:
    return [slice(a, b) for a, b in zip([0, *cuts], [*cuts, total])]
