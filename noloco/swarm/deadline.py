"""Adaptive per-round deadlines for swarm matchmaking: wait as long as recent rounds needed, not a fixed timeout.

NoLoCo's open swarm (arXiv 2506.10911) must not wait for its slowest peer. A fixed wait (``peer.window``,
``peer.confirm_timeout``) is either long, and every round with a late peer pays all of it, or short, and a
swarm on slow links never forms. :class:`AdaptiveDeadline` instead sets each round's wait from the waits the
recent rounds actually needed: the median of the last ``history`` observations plus ``spread`` times their
spread (1.4826 × the median absolute deviation, which estimates the standard deviation of normal samples and
ignores a few outliers, such as a straggler's late arrivals), clamped to ``[floor, ceiling]``. Until
``min_samples`` observations have been made it answers ``ceiling``: a new peer starts with the configured
timeouts and tightens them as it learns the swarm's pace.

Pure and deterministic (no clock, no randomness): the same observations give the same deadline on every peer,
which is what lets a deadline carried in a DHT record cut the same windows for every reader
(:mod:`noloco.swarm.matchmaking`).

What a round observes matters as much as how the observations are combined. A window's need is
:func:`window_need`: how late its announcements came after it opened, leaving out a late tail that stands
apart from the rest. Observing the window's last announcement instead taught every peer to wait for a peer
that is late in *every* round: measured with 8 peers on 16 cores, one of them 4× slower (2 s late each round,
inside the 3 s ceiling), the other seven waited for it in all 10 rounds and trained at 0.42× their speed
without it (``benchmarks/straggler.py``), because its lateness was the window's last arrival every round and
so the median of the observations, not an outlier among them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

#: Scale of the median absolute deviation to the standard deviation of normally distributed samples.
MAD_SCALE = 1.4826


def window_need(offsets: list[float], spread: float = 4.0, tolerance: float = 0.0) -> float:
    """Seconds a window needed for the peers in step: the latest of ``offsets`` that is not a late outlier.

    ``offsets`` are the announcements' seconds after the window opened (the opener's is 0). With three or
    more, an offset above ``max(tolerance, median + spread × 1.4826 × MAD)`` of them is a peer behind the
    others (a straggler) and is left out; with fewer there is no rest to compare with and the latest counts.
    ``tolerance`` (seconds, the shortest window) keeps a peer a little behind a tight cluster from counting as
    late (seven peers at once and one 0.3 s later have a MAD of 0). Arrivals spread
    evenly over the window are all kept (their MAD is a quarter of their range), so a swarm on slow links
    keeps the windows it needs; only a tail well apart from the bulk is cut. Returns 0.0 for no offsets.
    """
    values = sorted(float(o) for o in offsets if math.isfinite(float(o)))
    if len(values) < 3:
        return values[-1] if values else 0.0
    cutoff = max(float(tolerance), robust_bound(values, spread))
    return max(v for v in values if v <= cutoff)


def robust_bound(values: list[float], spread: float) -> float:
    """``median + spread × 1.4826 × MAD`` of ``values`` (non-empty): their centre plus ``spread`` robust spreads."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median + spread * MAD_SCALE * mad


class AdaptiveDeadline:
    """Seconds to wait for an event, from how long it took in recent rounds.

    Args:
        floor: the shortest deadline (seconds, > 0).
        ceiling: the longest deadline (seconds, >= ``floor``); also the answer before ``min_samples`` observations.
        spread: multiple of the robust spread added to the median (>= 0).
        history: observations kept (the most recent ones, >= 1).
        min_samples: observations needed before the deadline adapts (1 <= min_samples <= history).
    """

    def __init__(self, floor: float, ceiling: float, spread: float = 4.0, history: int = 16, min_samples: int = 4):
        floor, ceiling, spread = float(floor), float(ceiling), float(spread)
        if not (math.isfinite(floor) and math.isfinite(ceiling) and 0 < floor <= ceiling):
            raise ValueError(f"need 0 < floor <= ceiling (finite seconds), got floor={floor}, ceiling={ceiling}")
        if not (math.isfinite(spread) and spread >= 0):
            raise ValueError(f"spread must be a finite number >= 0, got {spread}")
        if not 1 <= int(min_samples) <= int(history):
            raise ValueError(f"need 1 <= min_samples <= history, got min_samples={min_samples}, history={history}")
        self.floor, self.ceiling, self.spread = floor, ceiling, spread
        self.min_samples = int(min_samples)
        self.samples: deque[float] = deque(maxlen=int(history))

    def observe(self, seconds: float) -> None:
        """Record how long the event took this round (seconds; non-finite or negative values are ignored).

        Values above ``ceiling`` are kept as ``ceiling`` (the wait was cut there: all that is known is "at least").
        Mutates :attr:`samples` (oldest dropped beyond ``history``).
        """
        seconds = float(seconds)
        if math.isfinite(seconds) and seconds >= 0:
            self.samples.append(min(seconds, self.ceiling))

    def value(self) -> float:
        """This round's deadline in seconds: ``clamp(median + spread × 1.4826 × MAD, floor, ceiling)``."""
        if len(self.samples) < self.min_samples:
            return self.ceiling
        return min(self.ceiling, max(self.floor, robust_bound(list(self.samples), self.spread)))

    def state(self) -> dict:
        """What the deadline is built from, for the peer's summary: ``{"seconds", "samples", "median"}``."""
        return {"seconds": self.value(), "samples": len(self.samples),
                "median": statistics.median(self.samples) if self.samples else None}  # fmt: skip


class PeerPace:
    """Which expected peers a window waits for: a peer that misses windows must show it keeps pace again.

    A peer that was expected in a window and was absent from it, or in its late tail (:func:`window_need`), is
    *behind*; each miss raises its level (up to ``max_level``). A peer behind is not waited for: the others
    hold no window open for it until it is forgiven. Each ``4 × 2 ** (l - 1)`` windows in a row in step with
    the others forgive one level (four after a first miss, then eight, sixteen...), counted in the windows it
    reaches on its own; it stays welcome in every window it announces in, and a miss restarts the streak.

    Why a streak and not the last window alone: a straggler that catches up by skipping rounds lands in step
    now and then and, if one window in step were enough, would be waited for in the next one and miss it
    again. Measured with 8 peers on 16 cores, one 4× slower, 20 rounds: it joined every other round of the
    others and cost each of them a full window every second round (others at 0.71× their speed). Why no
    re-test window (waiting for it again once a shorter streak, ``2 ** (l - 1)`` windows, had passed, as before
    2026-12-06): each re-test of a peer that is still slow costs every other peer a whole window, and a short
    run has few rounds to spread that over (4 peers, 6 rounds on 2 cores: one window in three).
    Pure (no clock): the same observations give the same answers.
    """

    def __init__(self, max_level: int = 4):
        if isinstance(max_level, bool) or not isinstance(max_level, int) or max_level < 1:
            raise ValueError(f"max_level must be an integer >= 1, got {max_level!r}")
        self.max_level = max_level
        self._behind: dict[str, tuple[int, int]] = {}  # peer -> (misses not yet forgiven, windows in step since)

    @staticmethod
    def need(level: int) -> int:
        """A quarter of the windows in a row in step that forgive a peer at ``level`` one level (0 at level 0)."""
        return 0 if level <= 0 else 2 ** (level - 1)

    def missed(self, peer: str) -> None:
        """``peer`` was expected in a window and absent from it or late: one level up, its streak restarts."""
        self._behind[peer] = (min(self.max_level, self.level(peer) + 1), 0)

    def in_step(self, peer: str) -> None:
        """``peer`` announced in step with the others; a long enough streak forgives one level."""
        if peer not in self._behind:
            return
        level, streak = self._behind[peer]
        streak += 1
        if streak >= 4 * self.need(level):
            level -= 1
        if level == 0:
            del self._behind[peer]
        else:
            self._behind[peer] = (level, streak)

    def waited_for(self, peer: str) -> bool:
        """Whether a window should wait for ``peer``: never seen behind, or forgiven."""
        return peer not in self._behind

    def level(self, peer: str) -> int:
        """``peer``'s misses not yet forgiven (0: never behind, or forgiven)."""
        return self._behind.get(peer, (0, 0))[0]
