"""A peer out of step with the others' windows (a restarted one catching up): real DHT nodes and p2pd daemons in
this process, real matchmaking with the adaptive deadlines.

Two ways it lost rounds before, both seen in a 125M restart on the GPU machine (first round 17 s after the first
step) and in ``python -m benchmarks.straggler`` on the CPU: arriving just after the others' window closed, it waited
its own window out before knowing the round had formed; arriving just before them, its window closed alone and it
re-announced a slack later, after they had read theirs without it.
"""

from __future__ import annotations

import threading
import time

import pytest

from noloco.swarm.matchmaking import chain_end, formed_without, gap_error, latest_incarnations, waiting_alone

RUN = "catch-up-test"
PEERS = 3
WINDOW, SLACK, POLL = 2.0, 2.0, 0.1  # a slack as long as the window: the gap a lone peer fell into was that long
#: A wait the old behaviour would have spent (a window, or a slack, this long): what a test tells apart from an
#: immediate answer with a bound of a third of it, far from both on however loaded a machine
LONG = 15.0


@pytest.fixture(scope="module")
def swarm(in_process_peers):
    """``PEERS`` peers: each a DHT node under its own identity and an endpoint on its p2pd, all on loopback."""
    with in_process_peers(RUN, "catch-up-test-key-0123456789", PEERS) as peers:
        yield peers


def _makers(swarm, behind: int | None, slack: float = SLACK, long_window: int | None = None, wide: int | None = None):
    """Adaptive matchmakers of every peer, each expecting the others; peer ``behind`` missed a window before, so
    the others no longer hold theirs open for it (what a peer that was dead for a few rounds is to them). Peer
    ``long_window`` opens windows of :data:`LONG` seconds; peer ``wide`` too, with the chain gap of the others
    (:data:`WINDOW`, their shortest window), as a peer whose deadline has no history yet opens its ceiling."""
    from noloco.swarm.matchmaking import SwarmMatchmaking

    ids = [endpoint.peer_id for _, endpoint in swarm]
    options = dict(group_size=2, window=WINDOW, slack=slack, poll=POLL, confirm_timeout=6, timeout=20, adaptive=True,
                   min_window=WINDOW)  # fmt: skip
    makers = [SwarmMatchmaking(dht, endpoint, f"p{i}", expected=lambda r, me=ids[i]: set(ids) - {me},
                               **{**options, **({"window": LONG, "min_window": LONG} if i == long_window else {}),
                                  **({"window": LONG} if i == wide else {})})
              for i, (dht, endpoint) in enumerate(swarm)]  # fmt: skip
    for i, maker in enumerate(makers):
        if behind is not None and i != behind:
            maker.pace.missed(ids[behind])
    return makers, ids


def _form_all(makers, round_index: int, delays: dict[int, float]) -> dict[int, tuple]:
    """Each peer forms ``round_index`` after its delay (seconds); ``{peer: (members or None, outcome, seconds)}``."""
    results: dict[int, tuple] = {}
    began = time.monotonic()

    def run(i: int) -> None:
        time.sleep(max(0.0, began + delays[i] - time.monotonic()))
        group = makers[i].form(round_index, 20)
        record = makers[i].rounds[-1]
        results[i] = (None if group is None else sorted(group.peer_ids), record.outcome, record.matchmaking_seconds)
        if group is not None:
            makers[i].release(group)

    threads = [threading.Thread(target=run, args=(i,)) for i in delays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    return results


def test_a_peer_whose_window_closed_alone_just_before_the_others_came_is_drawn_with_them(swarm):
    """Peer 2 is ready first (a restarted peer catching up arrives early for the round it targets); the others
    announce after its window closed, within the slack it used to wait before re-announcing. They read their
    window early (they no longer wait for peer 2), so it missed them, round after round on the GPU machine (four
    rounds in a row found no partner once). Now it re-announces as soon as a later window opens, and peers whose
    window follows a lone one that just closed wait for that peer: all three meet."""
    makers, ids = _makers(swarm, behind=2)
    results = _form_all(makers, 10, {2: 0.0, 0: WINDOW + 0.8, 1: WINDOW + 0.8})
    assert len(results) == PEERS, results
    for i in range(PEERS):
        members, outcome, _ = results[i]
        assert outcome == "joined" and members == ["p0", "p1", "p2"], (i, results)


def test_a_peer_announcing_alone_and_never_coming_is_not_waited_for_after_its_second_miss(swarm):
    """The wait for a lone peer is bounded like any other: a key holder that announces alone just before the others
    in every round and never re-announces is absent from their windows, and from its second miss they read theirs
    without waiting for it (before the bound they waited for it as long as it might still re-announce: the slack
    and two polls after its window closed, about 15 s here)."""
    makers, ids = _makers(swarm, behind=2, slack=LONG)  # a long slack: waiting for it would show
    for maker in makers[:2]:
        maker.pace.missed(ids[2])  # its second miss
    makers[2]._announce(30)  # ready, alone, and it never reads its window or re-announces
    time.sleep(WINDOW + 0.2)  # its window has closed: waited for, it would hold theirs about 15 s (slack + 2 polls)
    results = _form_all(makers, 30, {0: 0.0, 1: 0.0})
    for i in (0, 1):
        members, outcome, seconds = results[i]
        assert members == ["p0", "p1"] and outcome == "joined", results
        assert seconds < LONG / 3, results  # read once both were in, not after waiting for the lone peer


def test_a_peer_after_a_window_that_drew_everyone_it_expects_skips_the_round_at_once(swarm):
    """Peers 0 and 1 form the round without peer 2 (not waited for); peer 2 announces after their window closed.
    Everyone it expects drew before its window opened, so nobody is coming: it skips the round (``late``) at once
    and trains on, instead of waiting its own window (:data:`LONG` here) and the slack out first."""
    makers, ids = _makers(swarm, behind=2, long_window=2)
    results = _form_all(makers, 20, {0: 0.0, 1: 0.0, 2: WINDOW + 1.0})
    assert results[0][0] == results[1][0] == ["p0", "p1"], results
    members, outcome, seconds = results[2]
    assert members is None and outcome == "late", results
    assert seconds < LONG / 3, results  # it knew at its first read, not after its window and the slack
    assert makers[2].why_none(20) == "no partner: late"  # what its metrics line says (outer_skipped)


@pytest.mark.parametrize("late", [WINDOW / 2, LONG / 2])
def test_a_wide_window_ends_a_gap_after_its_announcements_stop_for_every_reader(swarm, late):
    """Peer 0 opens a window of :data:`LONG` seconds (a deadline without history opens its ceiling) and peer 1
    joins it at once; peer 2, whom both wait for, comes ``late``. Within the chain gap (the opener's shortest
    window) it is in the window; a gap after the others it is out of it for all three alike: peers 0 and 1 draw
    their pair a gap and the slack after their announcements (before: they waited for peer 2, as long as the
    window), and peer 2 skips the round (``late``) instead of confirming a group nobody else drew."""
    makers, ids = _makers(swarm, behind=None, slack=0.5, wide=0)
    results = _form_all(makers, 40 + int(late), {0: 0.0, 1: 0.1, 2: late})
    if late < WINDOW:
        for i in range(PEERS):
            assert results[i][:2] == (["p0", "p1", "p2"], "joined"), (i, results)
        return
    for i in (0, 1):  # not held open until peer 2 came: it would be in their group
        assert results[i][:2] == (["p0", "p1"], "joined"), results
    assert results[2][:2] == (None, "late"), results


def test_a_peer_after_a_window_that_drew_when_nobody_is_due_any_more_skips_the_round_at_once(swarm):
    """As above, but peer 2 expects nobody: the peers it would wait for have moved on to a later round (what a peer
    that started late, in step in pace but not in phase, sees). A group of the round drew before its window: it
    skips the round at once (before: it waited its own window out alone, round after round, and never caught up:
    seen on the 2-core machine, ``late`` in each of its rounds after 3.5 s of matchmaking)."""
    makers, ids = _makers(swarm, behind=2, long_window=2)
    makers[2].expected = lambda r: set()
    results = _form_all(makers, 60, {0: 0.0, 1: 0.0, 2: WINDOW + 1.0})
    assert results[0][0] == results[1][0] == ["p0", "p1"], results
    members, outcome, seconds = results[2]
    assert members is None and outcome == "late", results
    assert seconds < LONG / 3, results


def test_a_chain_ends_a_gap_after_the_first_announcement_no_other_follows_in_time():
    assert chain_end([10.0, 10.2, 10.5], gap=1.0) == 11.5  # each followed in time: a gap after the last
    assert chain_end([10.5, 10.0, 12.0, 10.2], gap=1.0) == 11.5  # any order; 12.0 comes too late
    assert chain_end([10.0, 12.0, 12.5, 14.0], gap=1.0) == 13.5  # the first two are always in: a pair never splits
    assert chain_end([10.0, 12.0], gap=1.0) == 13.0


def test_a_chain_gap_needs_a_width_it_fits():
    assert gap_error({"w": 3.0, "g": 1.0}) is None and gap_error({"w": 3.0, "g": 3}) is None
    assert "without a window width" in gap_error({"g": 1.0})
    for bad in (0, -1.0, 3.5, float("nan"), float("inf"), True, "1", None):
        assert gap_error({"w": 3.0, "g": bad}) is not None, bad


def test_formed_without_needs_every_expected_peer_in_a_window_that_drew_before():
    entries = [("a", 10.0), ("b", 10.2), ("c", 13.0)]
    cut = [(10.0, 11.0), (13.0, 14.0)]
    assert formed_without(entries, cut, 13.0, {"a", "b"})
    assert not formed_without(entries, cut, 13.0, {"a", "b", "d"})  # d may still come
    assert not formed_without(entries, cut, 13.0, set())  # nobody expected: nothing known
    lone = [("a", 10.0), ("c", 13.0)]  # a was alone there: it re-announces, nothing formed
    assert not formed_without(lone, [(10.0, 11.0), (13.0, 14.0)], 13.0, {"a"})
    assert not formed_without(entries, cut, 10.0, {"a"})  # nothing closed before the first window


def test_waiting_alone_is_a_peer_whose_lone_window_closed_within_the_grace():
    entries = [("a", 10.0), ("b", 11.5), ("c", 11.6)]
    cut = [(10.0, 11.0), (11.5, 12.5)]
    assert waiting_alone(entries, cut, 11.5, now=11.6, grace=1.0) == {"a"}
    assert waiting_alone(entries, cut, 11.5, now=12.5, grace=1.0) == set()  # it would have re-announced by now
    pair = [("a", 10.0), ("d", 10.5), ("b", 11.5)]  # a window of two drew: nobody waits
    assert waiting_alone(pair, cut, 11.5, now=11.6, grace=1.0) == set()
    assert waiting_alone(entries, cut, 10.0, now=10.1, grace=1.0) == set()  # its own window is not before it


def test_latest_incarnations_keeps_one_entry_per_name_and_none_of_this_peers_own():
    entries = [{"peer": "old", "name": "p2", "t": 5.0}, {"peer": "new", "name": "p2", "t": 9.0},
               {"peer": "x", "name": "p0", "t": 7.0}, {"peer": "me-before", "name": "p1", "t": 8.0}]  # fmt: skip
    assert [e["peer"] for e in latest_incarnations(entries, "p1")] == ["new", "x"]
    assert [e["peer"] for e in latest_incarnations(entries, "p9")] == ["new", "x", "me-before"]
    assert latest_incarnations([], "p0") == []


def _penalize(makers, peers: list[str], round_index: int) -> None:
    """Each of ``makers`` strikes each of ``peers`` in ``round_index`` until it penalizes it (never confirming)."""
    for maker in makers:
        for peer in peers:
            for _ in range(maker.strikes_before_penalty):
                maker._strike(maker._strikes, peer, round_index, "no_confirm", "ready but did not confirm")


def test_a_chain_of_penalized_announcements_does_not_end_the_window_of_the_peers_that_leave_them_out(
    in_process_peers,
):
    """Two identities that peers 0 and 1 penalize (a key holder's sybils, ready at once in every round) open a wide
    window; peers 0 and 1 come a gap after them. They leave the two out of their draw, so the chain they read is
    their own: they draw their pair. Before, the penalized pair's chain ended the window for them and both skipped
    the round as ``late``: what brought a CI run of the sybil attack (tests/swarm/test_hostile_rounds.py) to 3 of
    20 rounds."""
    with in_process_peers(RUN + "-penalized", "catch-up-test-key-0123456789", 4) as peers:
        makers, ids = _makers(peers, behind=None, slack=0.5, wide=2)
        _penalize(makers[:2], ids[2:], 69)
        results = _form_all(makers, 70, {2: 0.0, 3: 0.1, 0: 2 * WINDOW, 1: 2 * WINDOW + 0.1})
    for i in (0, 1):
        assert results[i][:2] == (["p0", "p1"], "joined"), (i, results)
    for i in (2, 3):  # they draw among themselves (nobody leaves them out): the pair their window holds
        assert results[i][:2] == (["p2", "p3"], "joined"), (i, results)


def test_a_window_of_penalized_announcements_is_no_group_that_formed_without_the_peers_that_leave_them_out(
    in_process_peers,
):
    """Two identities that peers 0 and 1 penalize announce first and draw their own pair; peers 0 and 1 expect
    nobody (what a peer sees once the others are listed out of step) and come a window later, peer 1 a second after
    peer 0. The penalized window is no group peer 0 would have joined: it waits its window and draws with peer 1.
    Before, peer 0 read the penalized pair as the round formed without it and skipped the round at once, and so did
    peer 1: what brought the sybil attack (tests/swarm/test_hostile_rounds.py) to 0 of 20 rounds."""
    with in_process_peers(RUN + "-penalized-window", "catch-up-test-key-0123456789", 4) as peers:
        makers, ids = _makers(peers, behind=None, slack=0.5)
        _penalize(makers[:2], ids[2:], 79)
        for maker in makers[:2]:
            maker.expected = lambda r: set()
        results = _form_all(makers, 80, {2: 0.0, 3: 0.1, 0: 2 * WINDOW, 1: 2 * WINDOW + 1.0})
    for i in (0, 1):
        assert results[i][:2] == (["p0", "p1"], "joined"), (i, results)


def test_a_member_that_read_the_window_early_waits_for_one_that_read_it_at_its_close(swarm):
    """Peer 0 waits for peer 1 only and reads the window as soon as peer 1 is in; peer 1 also waits for peer 2, who
    never comes, and reads it at its close plus the slack. Both draw the pair. Peer 0's confirmation wait, learned
    from rounds where both read at once, is short (``min_confirm``); counted from its own early read it ran out
    before peer 1 had read at all, so peer 0 gave up on a group that peer 1 then confirmed (peer 0's join had
    arrived) and sent its data to: refused as ``unexpected`` (the exchanges refused on the 16-core straggler runs).
    Counted from the window's latest read (its end and the slack), both confirm."""
    makers, ids = _makers(swarm, behind=None)
    makers[0].expected = lambda r: {ids[1]}
    for maker in makers:
        maker.confirm_deadline = type(maker.confirm_deadline)(0.3, 6.0, 4.0, 16, 4)  # min_confirm 0.3 s
        for _ in range(8):
            maker.confirm_deadline.observe(0.05)  # history: confirmations came at once
    results = _form_all(makers, 80, {0: 0.0, 1: 0.1})
    for i in (0, 1):
        assert results[i][:2] == (["p0", "p1"], "joined"), (i, results)


def test_peers_drawn_with_unreachable_identities_redraw_together_whatever_they_read_when(in_process_peers):
    """Peers 2 and 3 announce but serve nothing (their endpoints closed: a join to them fails at once, as to a key
    holder's daemonless sybil identities). Peer 0 reads the window as soon as peer 1 is in; peer 1 also waits for
    a peer that never comes and reads it at its close and the slack. Drawn with 2 or 3, each fails at once and
    redraws among the window's peers whose ``retry`` came. Peer 0 used to draw a second and a half after its own
    early failure, before peer 1 had read the window: it found no retry and skipped the round, while peer 1 drew
    peer 0 and waited for it to the end of matchmaking (``redraw failed``, as in CI's sybil attack). Counted from
    the window's last read, both redraw the pair. Two rounds (a draw pairs 0 with 1 a third of the time, and needs
    no redraw), before the no-shows' penalty (2 strikes) leaves them out."""
    with in_process_peers(RUN + "-unreachable", "catch-up-test-key-0123456789", 4) as peers:
        makers, ids = _makers(peers, behind=None, slack=0.5)
        makers[0].expected = lambda r: {ids[1]}
        makers[1].expected = lambda r: {ids[0], "nobody-announces-this-peer-id"}
        for _, endpoint in peers[2:]:
            endpoint.close()
        results = {}
        for round_index in (90, 91):
            for gone in makers[2:]:
                gone._announce(round_index)
            results[round_index] = _form_all(makers[:2], round_index, {0: 0.3, 1: 0.4})
    for round_index, result in results.items():
        for i in (0, 1):
            assert result[i][:2] == (["p0", "p1"], "joined"), (round_index, i, result)


def test_a_rounds_record_tells_where_its_matchmaking_time_went(swarm):
    """``rounds.jsonl`` splits matchmaking into reading the registry, the DHT's announcements and the confirmation
    (how the 64-peer sweep found its registry reads growing as N x N): a registry that answers in 0.3 s shows as
    0.3 s of ``listing_seconds``, and the phases never add up to more than the whole."""
    makers, ids = _makers(swarm, behind=None)
    for maker in makers:
        expected = maker.expected
        maker.expected = lambda r, expected=expected: (time.sleep(0.3), expected(r))[1]
    results = _form_all(makers, 40, {0: 0.0, 1: 0.0, 2: 0.0})
    for i, maker in enumerate(makers):
        record = maker.rounds[-1]
        assert results[i][1] == "joined", results
        assert 0.3 <= record.listing_seconds < record.matchmaking_seconds, record
        assert record.dht_seconds > 0 and record.confirm_seconds > 0, record  # reads: test_push.py
        phases = record.listing_seconds + record.dht_seconds + record.confirm_seconds
        assert phases <= record.matchmaking_seconds, record
