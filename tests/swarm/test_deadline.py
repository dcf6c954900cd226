"""Adaptive per-round deadlines: the estimate, the windows cut from the widths announcements carry, and when a
peer knows its round formed without it (pure functions: no DHT, no clock)."""

from __future__ import annotations

import math

import pytest

from noloco.swarm.deadline import MAD_SCALE, AdaptiveDeadline, PeerPace, window_need
from noloco.swarm.matchmaking import MAX_WINDOW, cut_windows, formed_before, width_error, windows
from noloco.train.config import ConfigError, load_config


def test_the_deadline_is_the_ceiling_until_enough_rounds_were_seen():
    deadline = AdaptiveDeadline(floor=0.5, ceiling=5.0, spread=4.0, history=8, min_samples=3)
    assert deadline.value() == 5.0
    deadline.observe(0.2)
    deadline.observe(0.3)
    assert deadline.value() == 5.0  # two of three
    deadline.observe(0.4)
    # median 0.3, MAD 0.1: 0.3 + 4 * 1.4826 * 0.1
    assert deadline.value() == pytest.approx(0.3 + 4 * MAD_SCALE * 0.1)


def test_the_deadline_is_clamped_to_floor_and_ceiling():
    steady = AdaptiveDeadline(floor=0.5, ceiling=5.0, min_samples=2)
    for _ in range(4):
        steady.observe(0.1)  # no spread at all
    assert steady.value() == 0.5
    wild = AdaptiveDeadline(floor=0.5, ceiling=5.0, min_samples=2)
    for seconds in (0.1, 3.0, 0.2, 4.0):
        wild.observe(seconds)
    assert wild.value() == 5.0


def test_a_straggler_among_the_samples_moves_the_deadline_little():
    """One late arrival in eight (a peer 4x slower) barely changes the median and the MAD."""
    calm = AdaptiveDeadline(floor=0.1, ceiling=10.0, history=8)
    late = AdaptiveDeadline(floor=0.1, ceiling=10.0, history=8)
    samples = [0.30, 0.35, 0.25, 0.40, 0.30, 0.35, 0.30]
    for s in samples:
        calm.observe(s)
        late.observe(s)
    calm.observe(0.3)
    late.observe(8.0)  # the straggler's round
    assert late.value() < 1.5 * calm.value() < 1.0


def test_a_window_needs_the_time_of_its_peers_in_step_not_of_a_straggler_late_in_every_round():
    """Seven peers announce within 0.3 s, the eighth 2 s after the window opened: the window needed 0.3 s.

    Observing the last announcement (2 s) made every peer learn to wait 2 s for a peer late in every round
    (the median of the observations, not an outlier among them)."""
    in_step = [0.0, 0.05, 0.1, 0.12, 0.2, 0.25, 0.3]
    assert window_need([*in_step, 2.0]) == 0.3
    assert window_need([0.0, 0.05, 2.0]) == 0.05
    deadline = AdaptiveDeadline(floor=0.1, ceiling=3.0)
    for _ in range(8):
        deadline.observe(window_need([*in_step, 2.0]))
    assert deadline.value() < 1.0  # the straggler 2 s late no longer fits in the windows others open


def test_a_window_of_evenly_spread_arrivals_needs_all_of_them():
    """Announcements spread over 3 s (slow links, DHT jitter) keep the window at 3 s: only a tail apart is cut."""
    assert window_need([0.4 * i for i in range(8)]) == 0.4 * 7
    assert window_need([0.0, 1.5, 3.0]) == 3.0
    assert window_need([0.0, 2.0]) == 2.0  # two peers: nothing to compare with
    assert window_need([]) == 0.0


def test_a_peer_a_little_behind_a_tight_cluster_is_within_the_tolerance():
    """Seven peers at once and one 0.3 s later: a MAD of 0, but 0.3 s is within the shortest window (1 s)."""
    assert window_need([0.0] * 7 + [0.3]) == 0.0
    assert window_need([0.0] * 7 + [0.3], tolerance=1.0) == 0.3
    assert window_need([0.0] * 7 + [2.0], tolerance=1.0) == 0.0


def test_old_rounds_leave_the_history():
    deadline = AdaptiveDeadline(floor=0.1, ceiling=10.0, history=4, min_samples=4)
    for _ in range(4):
        deadline.observe(5.0)
    assert deadline.value() == pytest.approx(5.0)
    for _ in range(4):
        deadline.observe(0.5)
    assert deadline.value() == pytest.approx(0.5)
    assert len(deadline.samples) == 4


def test_bad_observations_are_ignored_and_long_ones_count_as_the_ceiling():
    deadline = AdaptiveDeadline(floor=0.1, ceiling=2.0, min_samples=1)
    for bad in (math.nan, math.inf, -1.0):
        deadline.observe(bad)
    assert not deadline.samples
    deadline.observe(50.0)
    assert list(deadline.samples) == [2.0]


@pytest.mark.parametrize(
    "kwargs",
    [dict(floor=0, ceiling=1), dict(floor=2, ceiling=1), dict(floor=1, ceiling=math.inf),
     dict(floor=1, ceiling=2, spread=-1), dict(floor=1, ceiling=2, history=2, min_samples=3),
     dict(floor=1, ceiling=2, min_samples=0)],
)  # fmt: skip
def test_impossible_bounds_are_refused(kwargs):
    with pytest.raises(ValueError):
        AdaptiveDeadline(**kwargs)


def test_windows_take_the_width_of_the_announcement_that_opens_them():
    # a opens a 1 s window: b (0.5 s later) is in it, c (1.5 s) opens the next one with its own 3 s width
    cut = cut_windows([(10.0, 1.0), (10.5, 5.0), (11.5, 3.0), (14.0, 1.0)])
    assert cut == [(10.0, 11.0), (11.5, 14.5)]
    # the order the records arrive in does not matter, and the fixed-width form is the same cut
    assert cut_windows([(14.0, 1.0), (11.5, 3.0), (10.5, 5.0), (10.0, 1.0)]) == cut
    assert windows([10.0, 10.5, 11.5], 1.0) == cut_windows([(10.0, 1.0), (10.5, 1.0), (11.5, 1.0)])


def test_a_peer_alone_after_a_window_that_drew_others_knows_the_round_formed_without_it():
    times = [10.0, 10.2, 10.3, 13.0]  # three peers in step, one 3 s late
    cut = cut_windows([(t, 1.0) for t in times])
    assert cut == [(10.0, 11.0), (13.0, 14.0)]
    assert formed_before(times, cut, start=13.0)
    assert not formed_before(times, cut, start=10.0)  # nothing before the first window
    lone = [10.0, 13.0]  # the earlier window held one peer only (it re-announces): nothing formed
    assert not formed_before(lone, cut_windows([(t, 1.0) for t in lone]), start=13.0)


@pytest.mark.parametrize("width", [0, -1.0, math.nan, math.inf, MAX_WINDOW * 2, "1.0", True, None])
def test_an_announced_width_outside_its_range_is_refused(width):
    assert width_error(width) is not None


def test_an_announced_width_in_range_is_accepted():
    assert width_error(0.25) is None and width_error(MAX_WINDOW) is None and width_error(3) is None


@pytest.mark.parametrize(
    "override, words",
    [("peer.deadlines=sometimes", "peer.deadlines must be adaptive or fixed"),
     ("peer.min_window=0", "peer.min_window must be a number of seconds > 0"),
     ("peer.min_confirm=-2", "peer.min_confirm must be a number of seconds > 0"),
     ("peer.deadline_spread=-1", "peer.deadline_spread must be a number >= 0"),
     ("peer.deadline_rounds=0", "peer.deadline_rounds must be an integer in 1..1000"),
     ("peer.window=0", "peer.window must be a number of seconds > 0")],
)  # fmt: skip
def test_deadline_keys_out_of_range_are_one_line_errors(override, words):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_peer_that_missed_a_window_is_waited_for_again_only_once_a_streak_that_grows_with_its_misses_forgave_it():
    pace = PeerPace()
    assert pace.waited_for("a") and PeerPace.need(0) == 0
    pace.missed("a")  # first miss: four windows in step before it is waited for again, none held open for it
    for _ in range(3):
        pace.in_step("a")
        assert not pace.waited_for("a")
    pace.in_step("a")
    assert pace.waited_for("a") and pace.level("a") == 0
    pace.missed("a")
    pace.missed("a")  # second miss in a row: level 2, eight in step forgive one level, four more the other
    for _ in range(8):
        assert not pace.waited_for("a")
        pace.in_step("a")
    assert pace.level("a") == 1 and not pace.waited_for("a")
    pace.missed("a")  # a miss before it is forgiven: a level up, the streak restarts
    assert pace.level("a") == 2 and not pace.waited_for("a")
    assert pace.waited_for("b")  # others are not touched


def test_a_straggler_in_step_every_other_window_is_rarely_waited_for():
    """The measured pattern (8 peers on 16 cores, one 4× slower, 20 rounds): in step, then missing, in turn."""
    pace, waited = PeerPace(), 0
    for window in range(40):
        waited += pace.waited_for("slow")
        if window % 2 == 0:
            pace.missed("slow")
        else:
            pace.in_step("slow")
    assert pace.level("slow") == pace.max_level
    assert waited == 1  # the first window only: once behind it is not waited for again until forgiven


def test_a_long_streak_in_step_forgives_the_misses():
    pace = PeerPace(max_level=3)
    for _ in range(5):
        pace.missed("a")
    assert pace.level("a") == 3
    for _ in range(4 * 4 + 4 * 2 + 4 * 1):
        pace.in_step("a")
    assert pace.level("a") == 0 and pace.waited_for("a")
    pace.missed("a")  # a fresh miss starts from the first level again
    assert pace.level("a") == 1


@pytest.mark.parametrize("level", [0, -1, 1.5, True, None])
def test_an_impossible_pace_level_is_refused(level):
    with pytest.raises(ValueError, match="max_level"):
        PeerPace(max_level=level)
