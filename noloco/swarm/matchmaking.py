"""Swarm matchmaking: groups form among the peers that are ready for a round, found over the hivemind DHT.

Implements the open-swarm group formation of NoLoCo (arXiv 2506.10911, docs/design.md §3.1): a
peer ready for outer round ``r`` never waits for a slow one beyond a bounded time, and a peer that
finds no partner in time gets ``None`` and keeps training. Design (details and failure modes in
docs/swarm.md):

1. *Announce*: store ``(t, name)`` under DHT key ``<run>/ready/<r>``, subkey = peer id, with an
   expiry, an HMAC of (run, r, peer, t, name) under the run key and an Ed25519 signature of the same
   text by the peer's own identity (its libp2p id names the public key:
   :mod:`noloco.swarm.identity`). Entries without a valid MAC (another key) are ignored and counted as
   ``unauthenticated``; entries with a valid MAC that the peer of their subkey did not sign (a key
   holder writing under another peer's subkey) as ``forged``.
2. *Windows*: the valid announcements of round ``r`` are cut, by their announce times, into
   windows of ``window`` seconds: the first starts at the earliest announcement, each next one at
   the first announcement after the previous window closed. Every peer computes the same windows
   from the same entries; a late peer lands in a later window instead of delaying the early ones.
   A peer reads its window when it has closed (plus ``slack`` for DHT propagation) or, earlier, as
   soon as every peer it *expects* (live in the registry, at most one round behind) has announced
   in it: so peers in step pay almost no waiting, and a peer ahead of the others waits for them (up
   to ``window``), which pulls clusters of peers back into one.
   With ``push`` (the default), a peer also sends its announcement, the same signed record, straight to
   the peers it expects (and to those whose announcements of the round it has seen) as a control message
   over the endpoint, stores it in the DHT without waiting, and watches the records pushed to it: a window
   whose expected peers are all in is read without touching the DHT, and any other outcome (the window
   closed, a late or lone peer) is decided on a DHT read, so every member's draw still rests on what the
   DHT holds. Polling the DHT was what grew with N: every peer of a key read it every ``poll`` while all
   announced at once.
   A peer alone in its window re-announces (moving its entry to now, which changes no other
   peer's window) and tries the next window, until ``timeout``; this also re-synchronises a peer
   that runs ahead of the others, since all members of a window leave matchmaking together. With
   adaptive deadlines it re-announces as soon as a later window opens, whose peers wait for it
   (:func:`waiting_alone`), and a peer that finds everyone it expects drawn in earlier windows skips
   the round at once (:func:`formed_without`).
3. *Draw*: the peer orders its window's peers by a hash of (seed, r, window start, peer id); consecutive
   slices of ``group_size`` form the groups (a single leftover joins the last group;
   ``group_size=None`` means one group of everyone: the DiLoCo mode).
4. *Confirm*: each member opens the group on its :class:`~noloco.swarm.endpoint.SwarmEndpoint` (so data
   for it is accepted from then on), sends an authenticated ``join`` to every other member over
   libp2p and waits up to ``confirm_timeout`` for theirs. The group id hashes (run, r, window,
   members), so members whose views of the DHT differ compute different ids: when a member's
   ``join`` names another group, the draw is redone once from the closed window (which all members
   see alike), also leaving out the peers that the group's members list in their ``join`` as left
   out by them (their penalties can differ: they saw a no-show a different number of times); such a
   claim counts for that redraw only. Any other failure gives ``None`` for that round (the round is
   skipped, nothing is half-applied).

5. *Penalties*: a member that was ready in this peer's window, drawn into its group and sent it
   nothing at all in that round (no ``join``, not even one naming another group: every peer also
   sends its ``join`` to the other peers of its window, in the background, so that an honest peer
   whose view differed is never mistaken for a silent one) is *struck* once the next round begins,
   unless its ``join`` arrived late meanwhile, or it shares this peer's window only as this peer's penalties cut
   it (``no_confirm``; :meth:`SwarmMatchmaking._unpenalized_mates`). So is a member that confirmed and then
   delivered no data at all in the exchange while this peer timed out waiting for it or could not
   send to it (``no_data``; a member that sent part of its data, or that this peer never waited for,
   is not struck: in a group of three with one silent member, the other honest member is not blamed
   for the round). From the
   ``strikes_before_penalty``-th strike of a kind in a row (for ``no_confirm`` no confirmation in
   between, for ``no_data`` no data delivered in between; one silent round can be an honest peer that
   never drew or a slow link) a struck peer is left out of this peer's draws for at least
   ``L = penalty_rounds × 2**(strikes − strikes_before_penalty)`` swarm rounds (``L`` at most
   ``max_penalty_rounds``), until the end of the next block of ``L`` rounds, so that peers that
   struck it a round apart let it back in together and their draws stay alike. Strikes and exclusions
   are counted (``no_confirm``, ``no_data``, ``penalized``).

6. *Rounds and their cycle*: a swarm round is one outer exchange of the algorithm (every ``outer.every /
   outer.fragments`` inner steps). With ``cycle = outer.fragments`` > 1 round ``r`` exchanges fragment
   ``(r + 1) mod cycle``, so a peer that catches up with the swarm skips whole cycles only: its swarm round
   stays congruent to its own round modulo ``cycle`` and every member of a group exchanges the same fragment.
   A peer is in one round at a time: :meth:`SwarmMatchmaking.form` skips a round (``busy``) while a group of
   an earlier round is still open (the overlapped exchange never does that: it sends round ``r + 1`` only
   after round ``r``'s exchange has landed and its group was released).

7. *Buckets* (``buckets`` = B > 1, for swarms of hundreds of peers): a round's announcements are spread over B
   keys, ``<run>/ready/<r>/<b>``; a peer's key in round ``r`` is :func:`bucket_of` (a hash of run, round and
   peer id modulo B, so it changes every round and nobody picks it), and it reads, expects and draws within its
   key only. With one key every peer reads all N announcements at every poll and the DHT nodes holding the key
   serve N² records a round; with B keys, (N/B)² each. An entry under a key that is not its peer's bucket is
   dropped: the DHT records' signatures keep others from putting a peer's record there, so only the peer itself
   can, announcing in several keys to be drawn more than once. A peer that expects peers
   (``expected``) but none in its bucket skips the round at once (``alone in its bucket``); one that expects
   nobody (a registry not yet read) skips it if nobody else announced in its bucket by the end of its window.

:class:`PeerRegistry` is the list of live peers (name, inner step) that late joiners read to find a
peer to download the current slow weights from. :func:`implausible_rounds` drops entries listing a
round or step the schedule does not have (a key holder listing step 10**9); :func:`implausible_steps`
also drops, for a joiner, sources further ahead than the other live peers' median allows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from noloco.comm.base import ByteCounter, CommError, CommUnreachable
from noloco.gossip.base import Group, GroupSource
from noloco.swarm.deadline import AdaptiveDeadline, PeerPace, window_need
from noloco.swarm.endpoint import RunKey, SwarmEndpoint, SwarmTransport
from noloco.swarm.identity import verify

logger = logging.getLogger(__name__)


def get_dht_time() -> float:
    """hivemind's DHT clock (wall-clock seconds), imported lazily so this module imports without hivemind."""
    from hivemind.utils.timed_storage import get_dht_time as dht_time

    return dht_time()


def _digest(*parts: object, size: int = 16) -> str:
    return hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=size).hexdigest()


def bucket_of(run_id: str, round_index: int, peer: str, buckets: int) -> int:
    """The readiness key (0 … ``buckets`` − 1) of ``peer`` in swarm round ``round_index``: a hash of the three, so
    every peer computes every other peer's, it changes every round, and no peer chooses it."""
    if buckets <= 1:
        return 0
    return int(_digest("bucket", run_id, int(round_index), peer, size=8), 16) % int(buckets)


@dataclass(frozen=True)
class Announcement:
    peer: str
    time: float
    name: str
    width: float | None = None  # seconds of the window this announcement opens (None: the reader's peer.window)
    gap: float | None = None  # the window this announcement opens ends a gap this long after its announcements stop


#: Widest window an announcement may ask for (seconds); a record asking for more is refused (``invalid_record``).
MAX_WINDOW = 600.0
#: Fewest seconds between two DHT reads of :meth:`SwarmMatchmaking.gathering` (without push).
GATHERING_READ = 1.0


def windows(times: list[float], width: float) -> list[tuple[float, float]]:
    """Cut sorted-or-not announce ``times`` into chained windows ``[start, start + width]``."""
    return cut_windows([(t, width) for t in times])


def cut_windows(entries: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cut ``(announce time, width)`` pairs into chained windows: each starts at the first announcement after the
    previous window closed and lasts the width *that* announcement carries (the width its announcer's adaptive
    deadline chose: :mod:`noloco.swarm.deadline`). Every reader of the same records cuts the same windows."""
    out: list[tuple[float, float]] = []
    for t, width in sorted(entries):
        if not out or t > out[-1][1]:
            out.append((t, t + width))
    return out


def chain_end(times: list[float], gap: float) -> float:
    """Where a window's chain of announcements ends: ``t + gap`` for the first announcement ``t`` from the second
    on that no other follows within ``gap`` seconds (the last one's, if each is followed in time).

    ``times``: the announce times in the window (two or more; any order). A window is read as the announcements up
    to the earlier of its end and this: a peer that announces a gap after the others (a straggler the others
    still wait for: in the first rounds, or one they expect again) is out of it for every reader alike, which the
    times alone decide.
    It costs the others ``gap`` and the slack after their last announcement instead of the rest of a wide window
    (the ceiling of a round without history). The first two announcements are always in: a pair is never split.
    """
    values = sorted(times)
    for here, after in zip(values[1:], values[2:]):
        if after - here > gap:
            return here + gap
    return values[-1] + gap


def drawn_before(times: list[float], cut: list[tuple[float, float]], start: float) -> list[tuple[float, float]]:
    """The windows of ``cut`` that closed before ``start`` and held two or more of the announce ``times``: a group
    of the round was drawn in each, before the window starting at ``start`` opened."""
    return [(a, b) for a, b in cut if b < start and sum(a <= t <= b for t in times) > 1]


def formed_before(times: list[float], cut: list[tuple[float, float]], start: float) -> bool:
    """Whether a group of the round was drawn before the window starting at ``start`` opened (its peer came late)."""
    return bool(drawn_before(times, cut, start))


def formed_without(entries: list[tuple[str, float]], cut: list[tuple[float, float]], start: float,
                   expected: set[str]) -> bool:  # fmt: skip
    """Whether every peer of ``expected`` (a non-empty set) announced ``(peer, time)`` in a window of ``cut`` that
    closed before ``start`` and held two or more announcements: the round formed without the window starting at
    ``start``, and no peer its announcer expects is still to come (it need not wait its window out to know)."""
    formed = drawn_before([t for _, t in entries], cut, start)
    where = dict(entries)
    return bool(expected) and all(p in where and any(a <= where[p] <= b for a, b in formed) for p in expected)


def waiting_alone(entries: list[tuple[str, float]], cut: list[tuple[float, float]], start: float, now: float,
                  grace: float) -> set[str]:  # fmt: skip
    """Peers of ``(peer, time)`` announcements alone in a window of ``cut`` that closed before ``start``
    less than ``grace`` seconds ago: each is about to re-announce (a peer alone in its window does, at the latest
    a slack after its close), into the window starting at ``start``. Its readers wait for it there, whatever its
    pace: a peer arriving ahead of the others (a restarted one catching up) otherwise fell into the gap between
    its window's close and its re-announcement, and missed every group (its next windows opened too early again)."""
    out = set()
    for a, b in cut:
        inside = [p for p, t in entries if a <= t <= b]
        if len(inside) == 1 and b < start and now - b < grace:
            out.add(inside[0])
    return out


def width_error(width: object) -> str | None:
    """Why an announcement's window ``width`` is refused (not a number, not finite, not in (0, MAX_WINDOW]), or None."""
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width):
        return f"window width {str(width)[:32]!r} is not a finite number"
    if not 0 < width <= MAX_WINDOW:
        return f"window width {width:.6g} s is not in (0, {MAX_WINDOW:g}]"
    return None


def gap_error(value: dict) -> str | None:
    """Why an announcement's chain ``gap`` (``value["g"]``) is refused: without a width, not a finite number, or not
    in (0, width]; else None."""
    gap, width = value["g"], value.get("w")
    if width is None:
        return "a chain gap without a window width"
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap):
        return f"chain gap {str(gap)[:32]!r} is not a finite number"
    if not 0 < gap <= width:
        return f"chain gap {gap:.6g} s is not in (0, {width:.6g}] (the window's width)"
    return None


def draw_groups(
    peers: list[str], group_size: int | None, seed: int, round_index: int, salt: str = ""
) -> list[list[str]]:
    """Deterministic groups of ``peers`` (peer ids) for round ``round_index``; identical on every member.

    A seeded round robin (the circle method): the peers are shuffled by a hash of (seed, epoch, peer
    id), where an epoch is ``m - 1`` consecutive rounds (``m`` = peer count rounded up to even), and
    round ``r`` rotates that order by ``r mod (m - 1)``. Within an epoch a stable set of peers meets
    every other peer exactly once in pairs, where independent random draws repeat themselves (with 4
    peers the same pairs come back in consecutive rounds a third of the time). The pairs are then cut
    into groups of ``group_size``; a single leftover peer (the one without a partner when the count is
    odd) joins the last group. Members of each group are sorted. ``salt`` is accepted for callers that
    mix in the window and ignored: the draw must not change between the windows of one epoch.
    """
    del salt
    if group_size is None or group_size >= len(peers):
        return [sorted(peers)] if peers else []
    m = len(peers) + len(peers) % 2
    epoch, turn = divmod(round_index, m - 1)
    order: list[str | None] = sorted(peers, key=lambda p: _digest("group-order", seed, epoch, p))
    if len(order) < m:
        order.append(None)  # the bye
    rest = order[1:]
    rest = rest[turn:] + rest[:turn]
    circle = [order[0], *rest]
    pairs = [(circle[i], circle[m - 1 - i]) for i in range(m // 2)]
    pairs.sort(key=lambda pair: None in pair)  # the peer with the bye goes last: it becomes the leftover
    flat = [p for pair in pairs for p in pair if p is not None]
    groups = [flat[i : i + group_size] for i in range(0, len(flat), group_size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return [sorted(g) for g in groups]


#: Defaults of ``peer.strikes_before_penalty``, ``peer.penalty_rounds``, ``peer.max_penalty_rounds``: a peer
#: struck in STRIKES_BEFORE_PENALTY consecutive rounds with this one (for one kind of silence) is left out of its
#: draws for PENALTY_ROUNDS * 2**(penalties - 1) rounds (aligned to blocks of that length), at most
#: MAX_PENALTY_ROUNDS.
STRIKES_BEFORE_PENALTY = 2
PENALTY_ROUNDS = 4
MAX_PENALTY_ROUNDS = 256
#: Most peer ids a ``join`` lists as left out of the window (a control message is at most 4 KiB).
MAX_CLAIMED = 64
#: The control tag of an announcement pushed to a peer (its group: the round's DHT key, :meth:`_ready_key`).
PUSH_TAG = "ready"
#: How far above the median listed step of the other live, trained peers a joiner's source may be: this many
#: rounds (× every), or a tenth of the run if that is more.
TOLERANCE_ROUNDS = 4


def _split_plausible(entries: list[dict], ok: Callable[[dict], bool], endpoint: SwarmEndpoint | None, seen: set,
                     what: str) -> list[dict]:  # fmt: skip
    kept = []
    for entry in entries:
        if ok(entry):
            kept.append(entry)
            continue
        stamp = (entry["peer"], entry["step"], entry["round"])
        if endpoint is not None and stamp not in seen:  # count each claim once
            seen.add(stamp)
            endpoint.count_rejection("implausible_step", f"{what}: step {entry['step']}, round {entry['round']}",
                                     entry["peer"])  # fmt: skip
    return kept


def implausible_rounds(entries: list[dict], steps: int, every: int, endpoint: SwarmEndpoint | None = None,
                       seen: set | None = None) -> list[dict]:  # fmt: skip
    """Registry entries whose listed swarm round the schedule allows; the others are counted and dropped.

    A listed round must be -1 (finished) or within ``0..ceil(steps / every)`` (and the step within
    ``0..steps``), ``every`` being the inner steps per swarm round (``outer.every / outer.fragments``): a key
    holder listing round 10**9 would otherwise drag every peer's matchmaking there.
    No bound relative to the other peers: a lone honest peer ahead of peers that fell behind (or that
    resumed) must still be followed, and nothing in the registry tells it from a liar; a liar within the
    schedule can only move the swarm's round label forward, which the honest peers then share.
    """
    last = -(-int(steps) // int(every))

    def ok(e: dict) -> bool:
        return 0 <= e["step"] <= steps and (e["round"] == -1 or 0 <= e["round"] <= last)

    return _split_plausible(entries, ok, endpoint, seen if seen is not None else set(), "registry round")


def latest_incarnations(entries: list[dict], own_name: str) -> list[dict]:
    """Registry entries ``{"peer", "name", "t", ...}`` with one per name, the latest published, and none named
    ``own_name``: a peer restarted from its checkpoint comes back under a new identity and the same name, and its
    earlier identity stays listed until it is no longer fresh. Counted as live, it was *expected* in every window
    meanwhile: the others held their windows open for a peer that was gone, and the restarted one, waiting for
    itself, could not see that its round had formed without it. Two live peers sharing a name (a misconfigured
    ``peer.name``) are counted as one: the other is still drawn whenever it announces, only not waited for."""
    latest: dict[str, dict] = {}
    for e in entries:
        if e["name"] != own_name and (e["name"] not in latest or e["t"] > latest[e["name"]]["t"]):
            latest[e["name"]] = e
    keep = {id(e) for e in latest.values()}
    return [e for e in entries if id(e) in keep]


def step_bound(entries: list[dict], steps: int, every: int, fresh_within: float | None = None,
               tolerance: int = TOLERANCE_ROUNDS) -> int:  # fmt: skip
    """The most advanced step a joiner accepts from a source.

    At most ``steps``, and at most ``max(tolerance × every, steps // 10)`` above the median (the lower one)
    of the listed steps of the live peers that have trained (step > 0, not finished; published within
    ``fresh_within`` seconds if any did, so that a dead peer's old entry does not pull the median down). With
    two such peers the lower is the median: a peer claiming to be far ahead needs others to back it.
    """
    trained = [e for e in entries if e["round"] >= 0 and 0 < e["step"] <= steps]
    if fresh_within is not None:
        now = time.time()
        trained = [e for e in trained if now - e["t"] <= fresh_within] or trained
    if not trained:
        return int(steps)
    tol = max(tolerance * int(every), int(steps) // 10)
    return min(int(steps), statistics.median_low([e["step"] for e in trained]) + tol)


def implausible_steps(entries: list[dict], steps: int, every: int, endpoint: SwarmEndpoint | None = None,
                      seen: set | None = None, fresh_within: float | None = None) -> list[dict]:  # fmt: skip
    """Registry entries a joiner may download from: step within :func:`step_bound`; the rest counted, dropped."""
    bound = step_bound(entries, steps, every, fresh_within)
    return _split_plausible(entries, lambda e: 0 <= e["step"] <= bound, endpoint,
                            seen if seen is not None else set(), "registry step")  # fmt: skip


def announcement_ttl(window: float, slack: float, confirm_timeout: float) -> float:
    """Seconds a readiness announcement lives in the DHT (long enough for every window of a round)."""
    return max(60.0, 10 * (float(window) + float(slack) + float(confirm_timeout)))


SIGNATURE_DOMAIN = b"noloco-record/1|"


def sign_record(endpoint: SwarmEndpoint, text: bytes) -> dict[str, str]:
    """The ``mac`` (run key) and ``sig`` (this peer's identity) fields of a record whose canonical text is ``text``."""
    if endpoint.identity is None:
        raise ValueError("this endpoint has no PeerIdentity: it cannot publish DHT records")
    return {"mac": endpoint.key.mac(text).hex(), "sig": endpoint.identity.sign(SIGNATURE_DOMAIN + text).hex()}


@functools.lru_cache(maxsize=8192)
def _signed_by(peer: str, text: bytes, signature: str) -> bool:
    """Whether ``signature`` (hex) is ``peer``'s over ``text`` (cached: the same entries are read every poll)."""
    return verify(peer, SIGNATURE_DOMAIN + text, bytes.fromhex(signature))


#: Longest peer name a record may carry (it goes into logs, metrics and the summary).
MAX_NAME_CHARS = 64
#: Most seconds a record's time may lie ahead of this peer's clock (peers' clocks differ a little); a time
#: further ahead, or older than the record's lifetime plus this, is not a time an honest peer writes.
MAX_CLOCK_SKEW = 30.0


def record_time_error(t: object, now: float, lifetime: float) -> str | None:
    """Why ``t`` (a record's time field, seconds of the DHT clock) is not one an honest peer writes, or None.

    It must be a real number (not a bool), finite, at most :data:`MAX_CLOCK_SKEW` ahead of ``now`` and at most
    ``lifetime + MAX_CLOCK_SKEW`` behind it (a record does not outlive its expiry). A NaN time once broke the
    window search of every peer (every round skipped); an infinite one kept a peer "live" for ever.
    """
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return f"time is a {type(t).__name__}, not a number"
    if not math.isfinite(t):
        return f"time {t!r} is not finite"
    if t > now + MAX_CLOCK_SKEW or t < now - float(lifetime) - MAX_CLOCK_SKEW:
        return f"time {t:.6g} is {t - now:+.6g} s from now"
    return None


def name_error(name: object) -> str | None:
    """Why a record's peer ``name`` is refused (not a string, empty, too long, control characters), or None."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
        return f"name {str(name)[:32]!r} is not a printable string of 1..{MAX_NAME_CHARS} characters"
    return None


def signed_entries(found, text: Callable[[str, dict], bytes], endpoint: SwarmEndpoint, seen: set, what: str,
                   check: Callable[[str, dict], str | None] | None = None,
                   on_invalid: Callable[[str, str], None] | None = None) -> list[tuple[str, dict]]:  # fmt: skip
    """``(peer, value)`` for the subkeys of a DHT dictionary record that the peer named by the subkey signed.

    ``text(peer, value)`` is the entry's canonical text (raising ``KeyError``/``TypeError``/``ValueError`` if
    malformed); the value's ``mac`` must be the run key's HMAC of it and its ``sig`` the Ed25519 signature of
    it by ``peer`` itself (the key its libp2p id names). Other entries are ignored and counted on
    ``endpoint`` as ``unauthenticated`` (malformed, or a bad MAC: not a key holder) or ``forged`` (a key
    holder's entry under another peer's subkey), each (peer, stamp) once (``seen`` remembers them).

    Every field of an authentic entry is still untrusted: ``check(peer, value)`` says why one is refused (a
    NaN or absurd time, a bad name), or None; such entries are dropped and counted as ``invalid_record``
    (each once), or, with ``on_invalid(peer, reason)``, handed to it to count (matchmaking strikes the peer
    that signed it).
    """
    if found is None or not isinstance(found.value, dict):
        return []
    good = []
    for peer, item in found.value.items():
        value = getattr(item, "value", None)
        reason = "unauthenticated"
        try:
            data = text(str(peer), value)
            if hmac.compare_digest(str(value["mac"]), endpoint.key.mac(data).hex()):
                reason = None if _signed_by(str(peer), data, value["sig"]) else "forged"
        except (TypeError, KeyError, ValueError, AttributeError, OverflowError):
            pass
        detail = "with a bad MAC" if reason == "unauthenticated" else "not signed by the peer it names"
        if reason is None and check is not None:
            problem = check(str(peer), value)
            if problem is not None:
                reason, detail = "invalid_record", problem
        if reason is None:
            good.append((str(peer), value))
            continue
        stamp = (str(peer), repr(value.get("t"))[:64] if isinstance(value, dict) else None)
        if stamp not in seen:  # count each bad entry once
            seen.add(stamp)
            if reason == "invalid_record" and on_invalid is not None:
                on_invalid(str(peer), f"{what} {detail}")  # counts it, with the strike
            else:
                endpoint.count_rejection(reason, f"{what} {detail}", str(peer))
    return good


def _log_failed_store(round_index: int, future) -> None:
    """A background store of an announcement that failed or found no DHT node: logged (the peers it was pushed to
    still have it; the others find it only in the DHT)."""
    error = future.exception() if not future.cancelled() else "cancelled"
    if error is not None or future.result() is False:
        logger.warning("swarm: storing the announcement of round %d in the DHT failed: %s", round_index,
                       error or "no node took it")  # fmt: skip


class _Mismatch(RuntimeError):
    """Members computed different groups (their views of the round's announcements differed)."""


class _Late(RuntimeError):
    """This peer is alone in its window and the round already formed without it (an earlier window drew)."""


@dataclass
class RoundRecord:
    """What matchmaking did for one round (for the per-peer summary). ``round`` is the swarm round; ``fragment``
    is set by the training side (``outer.fragments`` > 1: the fragment its exchange carried)."""

    round: int
    ready: int = 0
    partners: list[str] = field(default_factory=list)
    outcome: str = ""
    matchmaking_seconds: float = 0.0
    exchange_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    fragment: int | None = None
    redrawn: bool = False  # formed by the second draw among the peers whose first group failed to confirm
    retried: bool = False  # exchanged again among the members that delivered, after one failed (SwarmMatchmaking.retry)
    window_width: float = 0.0  # seconds of the window this peer's (first) announcement of the round asked for
    why: str = ""  # outcome ``late``: which rule told this peer the round formed without it
    # where matchmaking_seconds went (the rest: waiting for the window to fill or close, and for a redraw)
    listing_seconds: float = 0.0  # reading the registry of live peers (who is expected, the front, anyone left)
    dht_seconds: float = 0.0  # announcing and reading the round's announcements
    dht_reads: int = 0  # reads of the round's announcements (each a DHT search)
    confirm_seconds: float = 0.0  # confirming the drawn group with its members

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the seconds of the ``with`` block to ``<phase>_seconds``."""
        started = time.monotonic()
        try:
            yield
        finally:
            setattr(self, f"{phase}_seconds", getattr(self, f"{phase}_seconds") + time.monotonic() - started)


def _check_options(group_size: int | None, buckets: int, cycle: int, penalty_rounds: int, strikes_before_penalty: int,
                   max_penalty_rounds: int) -> None:  # fmt: skip
    """ValueError (one line) for a :class:`SwarmMatchmaking` option out of range."""
    if group_size is not None and group_size < 2:
        raise ValueError(f"group_size must be >= 2 or None, got {group_size}")
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")
    if buckets > 1 and group_size is None:
        raise ValueError("buckets > 1 needs groups (group_size); one group of every ready peer needs one key")
    if penalty_rounds < 0 or strikes_before_penalty < 1 or max_penalty_rounds < 1:
        raise ValueError("penalty_rounds must be >= 0, strikes_before_penalty and max_penalty_rounds >= 1")
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 1:
        raise ValueError(f"cycle must be an integer >= 1, got {cycle!r}")


class SwarmMatchmaking(GroupSource):
    """A :class:`~noloco.gossip.base.GroupSource` for an open swarm (see the module docstring).

    Args:
        dht: a running ``hivemind.DHT``. :meth:`form` and :meth:`release` run on the thread that runs the outer
            exchange (the training thread, or with ``outer.overlap`` the exchange's own), one round at a time;
            :class:`PeerRegistry` publishes from the training thread meanwhile (the DHT of
            :func:`~noloco.swarm.dht.start_dht` takes such calls from several threads).
        endpoint: this peer's :class:`SwarmEndpoint` (same run id and key).
        name: human-readable peer name used in logs and metrics.
        group_size: target group size (>= 2), or ``None`` for one group of all ready peers.
        window: seconds during which ready peers are gathered into one draw.
        slack: extra seconds after a window closes before reading it (DHT propagation).
        confirm_timeout: seconds to wait for every member's ``join``.
        timeout: most seconds one round's matchmaking may take before giving up (``None`` for the round).
        seed: run seed mixed into the draw.
        expected: ``expected(r)`` → peer ids expected in round ``r`` (live and at most one round behind);
            once all of them have announced in this peer's window, the window is read without waiting
            for it to close.
        front: ``front()`` → the next swarm round of the most advanced live peers (see :meth:`form`).
        others: ``others()`` → how many other peers are live and still training; when it has been 0 for
            ``alone_after`` seconds the round is skipped at once (outcome ``no live peers``) instead of
            waiting ``timeout`` for nobody. (A single empty DHT read must not cost a round.)
        alone_after: seconds without seeing another live peer before rounds are skipped at once.
        poll: seconds between reads of the round's announcements while waiting.
        penalty_rounds: rounds a struck peer (no confirmation, or no data after confirming) is first left
            out of draws for (doubling with each further strike; 0 turns penalties off, strikes are still
            counted).
        strikes_before_penalty: strikes of one kind in a row before the first penalty.
        max_penalty_rounds: the longest penalty.
        retry_wait: seconds the members of a failed exchange wait for each other's confirmation of the retry among
            those that delivered (:meth:`retry`; default ``confirm_timeout``; a member may notice the failure up to
            one receive timeout after another).
        cycle: swarm rounds come in cycles of this many (``outer.fragments``: round ``r`` exchanges fragment
            ``(r + 1) mod cycle``); a peer catching up skips whole cycles, so that its swarm round is congruent
            to its own round modulo ``cycle`` (see :meth:`form`).
        adaptive: per-round deadlines (:class:`~noloco.swarm.deadline.AdaptiveDeadline`) instead of the fixed
            waits: the width of the windows this peer opens follows how late, after a window opened, the last
            of its peers announced in recent rounds (between ``min_window`` and ``window``), and the wait for
            the members' ``join`` follows how long recent confirmations took (between ``min_confirm`` and
            ``confirm_timeout``); an expected peer that missed a window is not waited for until it has been in
            step for a streak of windows (:class:`~noloco.swarm.deadline.PeerPace`);
            a peer that finds its round already formed without it skips it at once (outcome ``late``) and joins
            the next one, instead of waiting alone until ``timeout``.
        min_window, min_confirm: the adaptive deadlines' lower bounds (seconds).
        deadline_spread: an adaptive deadline is the median of recent rounds plus this many robust spreads.
        deadline_rounds: recent rounds an adaptive deadline is estimated from.
        buckets: readiness keys a round's announcements are spread over (:func:`bucket_of`; 1: one key for the
            whole swarm); groups form within a key. For swarms of hundreds of peers: about N/32.
    """

    def __init__(
        self,
        dht,
        endpoint: SwarmEndpoint,
        name: str,
        group_size: int | None = 2,
        window: float = 2.0,
        slack: float = 1.0,
        confirm_timeout: float = 5.0,
        timeout: float = 10.0,
        seed: int = 0,
        expected: Callable[[int], set[str]] | None = None,
        front: Callable[[], int] | None = None,
        others: Callable[[], int] | None = None,
        alone_after: float = 30.0,
        poll: float = 0.25,
        penalty_rounds: int = PENALTY_ROUNDS,
        strikes_before_penalty: int = STRIKES_BEFORE_PENALTY,
        max_penalty_rounds: int = MAX_PENALTY_ROUNDS,
        cycle: int = 1,
        retry_wait: float | None = None,
        adaptive: bool = False,
        min_window: float = 0.5,
        min_confirm: float = 2.0,
        deadline_spread: float = 4.0,
        deadline_rounds: int = 16,
        buckets: int = 1,
        push: bool = True,
    ):
        _check_options(group_size, buckets, cycle, penalty_rounds, strikes_before_penalty, max_penalty_rounds)
        self.dht, self.endpoint, self.name = dht, endpoint, name
        self.key: RunKey = endpoint.key
        self.run_id, self.peer_id = endpoint.run_id, endpoint.peer_id
        self.group_size, self.window, self.slack = group_size, float(window), float(slack)
        self.confirm_timeout, self.timeout, self.seed = float(confirm_timeout), float(timeout), int(seed)
        self.expected, self.front, self.others, self.poll = expected, front, others, float(poll)
        self.alone_after = float(alone_after)
        self._others_seen = time.monotonic()  # when another live peer was last listed
        self.next_round = 0
        self.matching: int | None = None  # the swarm round form() is in now (None: none)
        self.cycle, self.buckets, self.push = cycle, buckets, bool(push)
        self._push_to: set[str] = set()  # the peers this peer's announcements of the round being formed go to
        self._last_read: tuple[int, list[Announcement]] = (-1, [])  # the round's latest DHT read of announcements
        self._gathering_read = -math.inf  # monotonic time of gathering()'s latest DHT read
        self.counter: ByteCounter = endpoint.counter
        self.rounds: list[RoundRecord] = []
        self._by_own: dict[int, RoundRecord] = {}  # this peer's own round index -> its record (record_of)
        self._open: dict[str, tuple[RoundRecord, float, dict[str, int]]] = {}
        self._bad_entries: set[tuple[str, float]] = set()
        self._init_penalties(penalty_rounds, strikes_before_penalty, max_penalty_rounds)
        self._confirm_by = 0.0  # monotonic deadline of the latest confirmation
        self._read_by = 0.0  # monotonic time by which every member has read the window of the latest confirmation
        self.retry_wait = float(confirm_timeout if retry_wait is None else retry_wait)
        self._invalid: list[tuple[str, int]] = []  # (peer, round) it sent an invalid payload in; settled next round
        self._invalid_strikes: dict[str, int] = {}  # peer -> invalid payloads it sent (never reset)
        self._failed_in: dict[str, set[str]] = {}  # failed group id -> its culprits (SwarmMatchmaking.retry)
        self._retries: dict[str, tuple[str, set[str], int]] = {}  # retry group id -> (failed group id, culprits, round)
        self.adaptive = bool(adaptive)
        history = max(1, int(deadline_rounds))
        self.window_deadline = AdaptiveDeadline(min(float(min_window), self.window), self.window, deadline_spread,
                                                history, min(4, history))  # fmt: skip
        self.confirm_deadline = AdaptiveDeadline(min(float(min_confirm), self.confirm_timeout), self.confirm_timeout,
                                                 deadline_spread, history, min(4, history))  # fmt: skip
        self._width = self.window  # the width of this peer's latest announcement
        self._gap: float | None = None  # the chain gap of this peer's latest announcement (adaptive deadlines)
        self.pace = PeerPace()  # expected peers that missed windows: waited for again after a streak in step
        self._behind = False  # the round being formed is ahead of this peer's own (it is catching up)

    def _init_penalties(self, penalty_rounds: int, strikes_before_penalty: int, max_penalty_rounds: int) -> None:
        """The strikes and penalties this peer keeps (docs/swarm.md, *Penalties*), all empty."""
        self.penalty_rounds, self.strikes_before_penalty = int(penalty_rounds), int(strikes_before_penalty)
        self.max_penalty_rounds = int(max_penalty_rounds)
        self._strikes: dict[str, int] = {}  # peer -> silent rounds with this peer since it last confirmed
        self._mute_strikes: dict[str, int] = {}  # peer -> exchanges it sent nothing in since it last sent data
        self._record_strikes: dict[str, int] = {}  # peer -> DHT records it signed with refused fields
        self._mute: list[tuple[str, int]] = []  # (peer, round) it confirmed and sent no data in; settled next round
        self._penalty_lock = threading.Lock()  # release() may run in an overlapped exchange's thread
        self._late: dict[str, int] = {}
        self._banned_until: dict[str, int] = {}  # peer -> last swarm round it is left out of
        self.penalties: dict[str, int] = {}  # reason -> penalties this peer imposed for it (a peer's summary)
        self._silent: list[tuple[str, int]] = []  # (peer, round) it sent nothing in; settled next round
        self._unreachable: set[tuple[str, int]] = set()  # of those, the ones that could not be reached at all
        self._heard: set[tuple[str, int]] = set()  # (peer, round) whose join this peer took
        self._excluded: set[tuple[str, int]] = set()  # (peer, round) exclusions already counted
        self._window_excluded: list[str] = []  # penalized peers of the window being drawn
        # who shares that window as a peer penalizing nobody reads it (None: no window read, every member counts)
        self._plain_mates: set[str] | None = None

    @property
    def ready_ttl(self) -> float:
        """Seconds a readiness announcement lives in the DHT."""
        return announcement_ttl(self.window, self.slack, self.confirm_timeout)

    # ------------------------------------------------------------------ penalties
    def _settle(self) -> None:
        """Strike the peers that stayed silent in an earlier round, unless their join arrived late since.

        Two kinds: no ``join`` (``no_confirm``) and no data after confirming (``no_data``, noted by
        :meth:`release`). Each strike is counted; from the ``strikes_before_penalty``-th of a kind in a row
        each one also leaves the peer out of the draws (:meth:`_strike`). A silent member that this peer could
        not reach at all (no route: an identity without a daemon, or a peer that died) is left out from its first
        strike: the strikes before a penalty spare a slow honest peer, and an absent one is not slow (a peer that
        restarts comes back under a new identity).
        """
        for peer, round_index in dict.fromkeys(self._silent):
            if (peer, round_index) in self._heard:
                continue
            if self.endpoint.control_tags(f"r{round_index}", peer):
                self._late[peer] = self._late.get(peer, 0) + 1
                if self._late[peer] < 2:  # late once: a slow honest peer; late every time: a strike too
                    continue
            absent = (peer, round_index) in self._unreachable
            self._strike(self._strikes, peer, round_index, "no_confirm", f"ready in round {round_index} but "
                         + ("could not be reached" if absent else "did not confirm"), at_once=absent)  # fmt: skip
        self._silent.clear()
        self._unreachable.clear()
        self._heard.clear()
        with self._penalty_lock:
            mute, self._mute = self._mute, []
            for peer, round_index in dict.fromkeys(mute):
                self._strike(self._mute_strikes, peer, round_index, "no_data", f"confirmed round {round_index} "
                             "but did not deliver its data")  # fmt: skip
            invalid, self._invalid = self._invalid, []
            for peer, round_index in dict.fromkeys(invalid):
                self._strike(self._invalid_strikes, peer, round_index, "invalid_data", f"sent an invalid payload "
                             f"in round {round_index}")  # fmt: skip

    def _strike(self, strikes_of: dict[str, int], peer: str, round_index: int, reason: str, what: str,
                at_once: bool = False) -> None:  # fmt: skip
        """Count one strike of ``peer`` in ``strikes_of``; from ``strikes_before_penalty`` in a row (``at_once``:
        from this one), leave it out."""
        least = self.strikes_before_penalty if at_once else 1
        strikes = strikes_of[peer] = max(strikes_of.get(peer, 0) + 1, least)
        if strikes < self.strikes_before_penalty or self.penalty_rounds <= 0:
            self.endpoint.count_rejection(reason, f"{what} (strike {strikes}, no penalty)", peer)
            return
        length = min(self.max_penalty_rounds, self.penalty_rounds * 2 ** (strikes - self.strikes_before_penalty))
        # The penalty ends with a block of `length` rounds, not `length` rounds after the strike: peers that
        # struck the same no-show a round apart then let it back in the same round, and their draws stay
        # alike (a peer let back in by one member only makes both members' rounds fail).
        until = ((round_index + length) // length + 1) * length - 1
        self._banned_until[peer] = max(self._banned_until.get(peer, -1), until)
        self.penalties[reason] = self.penalties.get(reason, 0) + 1
        self.endpoint.count_rejection(reason, f"{what}; left out until round {until} (strike {strikes})", peer)

    def _strike_record(self, round_index: int, peer: str, what: str) -> None:
        """Strike ``peer`` for a record it signed whose fields are refused (``invalid_record``; once per record)."""
        with self._penalty_lock:
            self._strike(self._record_strikes, peer, round_index, "invalid_record", what)

    def strike_record(self, peer: str, what: str) -> None:
        """:meth:`_strike_record` in the round this peer matches in now (or next): for the registry's entries."""
        matching = self.matching
        self._strike_record(self.next_round if matching is None else matching, peer, what)

    def penalized(self, peer: str, round_index: int) -> bool:
        """Whether ``peer`` is left out of this peer's draw in swarm round ``round_index``."""
        return self.penalty_rounds > 0 and self._banned_until.get(peer, -1) >= round_index

    def _left_out(self, peer: str, round_index: int, also: frozenset[str] = frozenset()) -> bool:
        """Whether this peer leaves ``peer`` out of its draw in ``round_index`` (penalized, or in ``also``)."""
        return peer != self.peer_id and (peer in also or self.penalized(peer, round_index))

    def _drop_penalized(self, entries: list[Announcement], round_index: int,
                        also: frozenset[str] = frozenset()) -> list[Announcement]:  # fmt: skip
        """``entries`` without the peers this peer penalizes in ``round_index`` and those in ``also``."""
        kept = []
        self._window_excluded = []
        for entry in entries:
            if entry.peer != self.peer_id and entry.peer in also:
                self._window_excluded.append(entry.peer)
                continue
            if entry.peer != self.peer_id and self.penalized(entry.peer, round_index):
                self._window_excluded.append(entry.peer)
                if (entry.peer, round_index) not in self._excluded:
                    self._excluded.add((entry.peer, round_index))
                    self.endpoint.count_rejection("penalized", f"left out of round {round_index}", entry.peer)
                continue
            kept.append(entry)
        return kept

    # ------------------------------------------------------------------ DHT entries
    def _text(self, round_index: int, peer: str, t: float, name: str, width: float | None = None,
              gap: float | None = None) -> bytes:  # fmt: skip
        parts = (("ready", self.run_id, round_index, peer, t, name) + (() if width is None else (width,))
                 + (() if gap is None else ("gap", gap)))  # fmt: skip
        return "|".join(map(str, parts)).encode()

    @property
    def window_width(self) -> float:
        """Seconds of the windows this peer opens now: ``window``, or with ``adaptive`` its adaptive deadline."""
        return self.window_deadline.value() if self.adaptive else self.window

    def _announce(self, round_index: int, record: RoundRecord | None = None) -> float:
        """Store this peer's announcement for ``round_index``; its time (seconds in ``record.dht_seconds``)."""
        with record.timed("dht") if record is not None else contextlib.nullcontext():
            return self._store_announcement(round_index)

    def _store_announcement(self, round_index: int) -> float:
        now = get_dht_time()
        width = self._width = self.window_width
        gap = self._gap = self.window_deadline.floor if self.adaptive else None
        text = self._text(round_index, self.peer_id, now, self.name, width if self.adaptive else None, gap)
        value = {"t": now, "name": self.name, **({"w": width, "g": gap} if self.adaptive else {}),
                 **sign_record(self.endpoint, text)}  # fmt: skip
        expiry = now + self.ready_ttl
        if not self.push:
            self.dht.store(self._ready_key(round_index), value, expiry, subkey=self.peer_id)
            return now
        payload = json.dumps(value, separators=(",", ":")).encode()
        for peer in sorted(self._push_to - {self.peer_id}):  # in the background: a dead peer delays nobody
            self.endpoint.post_control(self._ready_key(round_index), round_index, peer, PUSH_TAG, payload,
                                       self.slack + self.poll)  # fmt: skip
        # the DHT copy is for the peers not pushed to (a newcomer, one whose listing differs) and for the reads
        # that decide a closed window: nobody's read of this round waits for it to land, so neither does this peer
        stored = self.dht.store(self._ready_key(round_index), value, expiry, subkey=self.peer_id, return_future=True)
        stored.add_done_callback(functools.partial(_log_failed_store, round_index))
        return now

    def _bucket(self, round_index: int, peer: str | None = None) -> int:
        return bucket_of(self.run_id, round_index, self.peer_id if peer is None else peer, self.buckets)

    def _ready_key(self, round_index: int) -> str:
        """The DHT key of this peer's announcements in ``round_index``: one per round, or its bucket's."""
        key = f"{self.run_id}/ready/{round_index}"
        return key if self.buckets == 1 else f"{key}/{self._bucket(round_index)}"

    def _ready(self, round_index: int, record: RoundRecord | None = None) -> list[Announcement]:
        """The valid announcements of ``round_index`` (a read counted, and its seconds added, in ``record``)."""
        if record is None:
            return self._read_announcements(round_index)
        record.dht_reads += 1
        with record.timed("dht"):
            return self._read_announcements(round_index)

    def _read_announcements(self, round_index: int) -> list[Announcement]:
        return self._announcements(round_index, self.dht.get(self._ready_key(round_index), latest=True),
                                   "DHT announcement")  # fmt: skip

    def _pushed(self, round_index: int) -> tuple[list[Announcement], int]:
        """The valid announcements of ``round_index`` pushed to this peer (checked as the DHT's are, the sender
        being the subkey), and how many were pushed."""
        if not self.push:
            return [], 0
        found = self.endpoint.control_from(self._ready_key(round_index), PUSH_TAG)
        values = {}
        for sender, payload in found:
            try:
                value = json.loads(bytes(payload))
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = None  # refused below as unauthenticated, like a malformed DHT entry
            values[sender] = SimpleNamespace(value=value)
        return self._announcements(round_index, SimpleNamespace(value=values), "pushed announcement"), len(found)

    def _entries(self, round_index: int, record: RoundRecord, read_dht: bool) -> tuple[list[Announcement], int]:
        """Other peers' announcements of ``round_index``, each peer's latest: those pushed to this peer and the
        round's latest DHT read (read now with ``read_dht``); and how many were pushed."""
        if read_dht or self._last_read[0] != round_index:
            self._last_read = (round_index, self._ready(round_index, record) if read_dht else [])
        pushed, heard = self._pushed(round_index)
        latest: dict[str, Announcement] = {}
        for e in [*self._last_read[1], *pushed]:
            if e.peer != self.peer_id and (e.peer not in latest or e.time > latest[e.peer].time):
                latest[e.peer] = e
        return list(latest.values()), heard

    def _wait(self, round_index: int, seconds: float, heard: int) -> None:
        """Sleep ``seconds``; with push, wake as soon as another announcement is pushed."""
        if self.push:
            self.endpoint.wait_control(self._ready_key(round_index), PUSH_TAG, heard, max(0.0, seconds))
        else:
            time.sleep(max(0.0, seconds))

    def _announcements(self, round_index: int, found, what: str) -> list[Announcement]:
        def text(peer: str, value) -> bytes:
            float(value["t"])  # a time that does not parse is malformed
            return self._text(round_index, peer, value["t"], str(value["name"]), value.get("w"), value.get("g"))

        def check(peer: str, value: dict) -> str | None:
            return (record_time_error(value["t"], get_dht_time(), self.ready_ttl) or name_error(value["name"])
                    or ("w" in value and width_error(value["w"])) or ("g" in value and gap_error(value))
                    or None)  # fmt: skip

        entries = signed_entries(found, text, self.endpoint, self._bad_entries, what, check,
                                 functools.partial(self._strike_record, round_index))  # fmt: skip
        if self.buckets > 1:  # a peer announcing outside its own bucket (only it can sign there) is not drawn
            mine = self._bucket(round_index)
            entries = [(peer, value) for peer, value in entries if self._bucket(round_index, peer) == mine]
        self.endpoint.note_peers(peer for peer, _ in entries)
        return [Announcement(peer, float(value["t"]), str(value["name"]), float(value["w"]) if "w" in value else None,
                             float(value["g"]) if "g" in value else None) for peer, value in entries]  # fmt: skip

    def gathering(self, round_index: int) -> bool:
        """Whether a window of ``round_index`` that will hold this peer is gathering: another peer's valid
        announcement of it came recently enough (its width and the slack ago at most). With push, only one pushed
        to this peer counts: a peer pushes to those it expects, and holds its window open for them; one that does
        not expect this peer closes its window once those it expects are in, and would read the round without an
        announcement it did not wait for (the members' views would differ, and the group fail to confirm). Without
        push, the round's DHT entries, read at most once per :data:`GATHERING_READ` seconds."""
        if self.push:
            found, _ = self._pushed(round_index)
        elif time.monotonic() - self._gathering_read > GATHERING_READ:
            self._gathering_read = time.monotonic()
            found = self._read_announcements(round_index)
        else:
            return False
        now = get_dht_time()
        return any(e.peer != self.peer_id and now - e.time <= (e.width or self.window) + self.slack for e in found)

    # ------------------------------------------------------------------ GroupSource
    def target(self, round_index: int, ahead: int) -> int:
        """The swarm round this peer's round ``round_index`` matches in, given the round ``ahead`` it should
        catch up with: the first round at or after both that is congruent to ``round_index`` modulo
        :attr:`cycle` (with fragments, the next round of the swarm that exchanges the same fragment)."""
        behind = max(0, int(ahead) - int(round_index))
        return int(round_index) + -(-behind // self.cycle) * self.cycle

    @property
    def listed_round(self) -> int:
        """The swarm round this peer lists in the registry: the one it is matching in now, else the next one.

        With ``outer.overlap`` the training thread publishes while the exchange thread matches; listing the
        next round then would make a peer that reads it as the ``front`` skip the round this peer waits in.
        """
        matching = self.matching
        return self.next_round if matching is None else matching

    def record_of(self, round_index: int) -> RoundRecord | None:
        """The record of this peer's own round ``round_index`` (its swarm round may be later), if it formed one."""
        return self._by_own.get(int(round_index))

    def why_none(self, round_index: int) -> str:
        """The matchmaking outcome of this peer's round ``round_index`` that formed no group (``late``, ``timeout``,
        ``no partner``, ``busy: ...``, ``confirm failed: ...``), prefixed ``no partner`` for what metrics read."""
        record = self.record_of(round_index)
        outcome = record.outcome if record is not None and record.outcome else ""
        return "no partner" if outcome in ("", "no partner") else f"no partner: {outcome}"

    def form(self, round_index: int, timeout: float) -> Group | None:
        """The group of this peer's outer round ``round_index``.

        Groups form in *swarm rounds*: normally the local round, but a peer that has fallen behind
        matches in the round the most advanced live peers do next (``front``), so it rejoins them
        instead of waiting in rounds nobody else is in; with a :attr:`cycle` > 1, in the first such round
        that is congruent to its own modulo the cycle (:meth:`target`). ``Group.round`` is the swarm round.
        """
        started = time.monotonic()
        ahead, listed = self.next_round, time.monotonic()
        if self.front is not None:
            try:
                ahead = max(ahead, self.front())
            except Exception:  # noqa: BLE001 - the registry is a hint
                pass
        target = self.target(round_index, ahead)
        record = RoundRecord(target, listing_seconds=time.monotonic() - listed)
        self.rounds.append(record)
        self._by_own[int(round_index)] = record
        for old in [r for r in self._by_own if r < round_index - 8]:  # the training side reads the latest only
            del self._by_own[old]
        self.matching = target  # listed while it matches (set before next_round: a reader never sees target + 1)
        self.next_round = target + 1
        if self._open:  # a group of an earlier round is still exchanging: never in two rounds at once
            busy = ", ".join(str(r.round) for r, _, _ in self._open.values())
            logger.warning("swarm: round %d skipped: round %s is still exchanging", target, busy)
            record.outcome = f"busy: round {busy} still exchanging"
            self.matching = None
            return None
        self._behind = target > round_index  # catching up with the swarm: it skipped rounds, the others are ahead
        try:
            group = self._form(target, record, started + timeout)
        except Exception as exc:  # noqa: BLE001 - the DHT or a peer failed: skip the round, keep training
            logger.warning("swarm: matchmaking for round %d failed: %s: %s", round_index, type(exc).__name__, exc)
            record.outcome, group = f"error: {type(exc).__name__}", None
        finally:
            self.matching = None
        record.matchmaking_seconds = time.monotonic() - started
        if group is not None:
            self._open[group.transport.group_id] = (record, time.monotonic(), self.counter.state_dict())
        return group

    def _form(self, round_index: int, record: RoundRecord, deadline: float) -> Group | None:
        deadline = min(deadline, time.monotonic() + self.timeout)
        self._settle()
        with record.timed("listing"):
            others = self.others() if self.others is not None else None
            expected = self.expected(round_index) if self.expected is not None else set()
        if others is not None:
            if others > 0:
                self._others_seen = time.monotonic()
            elif time.monotonic() - self._others_seen > self.alone_after:
                record.outcome = "no live peers"
                return None
        if self.buckets > 1:  # only the peers of this peer's bucket announce where it reads
            bucket = self._bucket(round_index)
            mates = {p for p in expected if self._bucket(round_index, p) == bucket}
            if expected and not mates:  # peers in step are listed, none drew this key: nobody to wait for
                record.outcome = "alone in its bucket"
                return None
            expected = mates
        self._push_to = set(expected)
        mine = self._announce(round_index, record)
        record.window_width = self._width
        claimed: frozenset[str] = frozenset()
        stale: str | None = None  # the group of a draw whose members disagreed, closed once the redraw differs
        for attempt in range(2):
            # Attempt 0 may read the window early (all expected peers in); if members then disagree on
            # the group, attempt 1 reads the closed window, which every member sees alike, and also leaves
            # out the peers that the members of attempt 0's group said they leave out (penalties differ
            # between peers that saw a no-show a different number of times).
            try:
                gathered = self._gather(round_index, record, deadline, mine, expected if attempt == 0 else set(),
                                        claimed)  # fmt: skip
            except _Late as late:  # the round formed without this peer: train on and join the next one, instead of
                record.outcome, record.why, gathered = "late", str(late), None  # waiting alone until the timeout
            if gathered is None:
                if stale is not None:
                    self.endpoint.close_group(stale)
                return None
            in_window, start, mine, read_by = gathered
            names = {e.peer: e.name for e in in_window}
            record.ready = len(in_window)
            members = next(g for g in draw_groups(list(names), self.group_size, self.seed, round_index, repr(start))
                           if self.peer_id in g)  # fmt: skip
            group_id = _digest("group", self.run_id, round_index, repr(start), *members)
            record.partners = [names[m] for m in members if m != self.peer_id]
            if stale is not None and stale != group_id:
                self.endpoint.close_group(stale)
            stale = None
            transport = self.endpoint.open_group(group_id, round_index, members)
            outside = [p for p in [*names, *self._window_excluded] if p not in members]
            try:
                # behind the swarm and last in a window of three or more: the others may have read it before this
                # peer announced (early: they no longer wait for a peer that missed a round), so their silence is
                # no evidence against them: no strike
                late = self._behind and len(in_window) > 2 and mine >= max(e.time for e in in_window)
                with record.timed("confirm"):
                    self._confirm(round_index, group_id, members, names, deadline, fast_mismatch=attempt == 0,
                                  window_peers=outside, strike=not (self.adaptive and late),
                                  read_by=read_by)  # fmt: skip
            except _Mismatch as exc:
                claimed = self._claimed_exclusions(round_index, members, names)
                # kept open until the redraw: if it draws the same group, a member that confirmed it meanwhile
                # may already be sending its data (closing and reopening would refuse it)
                stale = group_id
                record.outcome = f"confirm failed: {exc}"
                continue
            except Exception as exc:  # noqa: BLE001 - unreachable, refused or silent member: draw again without it
                self.endpoint.close_group(group_id)
                record.outcome = f"confirm failed: {exc}"
                return self._fallback(round_index, record, deadline, names, members,
                                      unreachable=isinstance(exc, CommError))  # fmt: skip
            record.outcome = "joined"
            return Group(transport, list(range(len(members))), round_index, [names[m] for m in members])
        if stale is not None:
            self.endpoint.close_group(stale)
        return None

    def _fallback(self, round_index: int, record: RoundRecord, deadline: float, names: dict[str, str],
                  failed_group: list[str], unreachable: bool = False) -> Group | None:  # fmt: skip
        """A second draw in the same window among the peers whose first group failed to confirm too.

        The members of this peer's group that sent nothing at all (after an unreachable member: the unreachable
        ones) are left out; to every other peer of the window this peer posts ``retry/<round>`` (the round's, so
        that peers whose penalties differ, and so whose windows start at different times, find each other's), waits
        until its first confirmation deadline plus ``max(0.5, slack)``
        (so that a peer whose group timed out is in as well; if the failure was a member that could not be reached,
        which fails every group at once, only ``max(1, 2 slack) + max(0.5, slack)`` seconds after the window's
        last read, when every member has read it and tried its group; if less than
        ``min(1, confirm_timeout / 2)`` of the round's matchmaking time would be left, it skips the round), then
        draws among itself and the peers whose ``retry`` arrived, and confirms that group. Identities that never
        answer (no daemon, or never confirming) send no ``retry`` and are drawn around within the round; peers whose
        retry sets differ compute different group ids and skip the round, as before.
        """
        channel = f"r{round_index}"
        # the round's, not the window's: peers whose penalties differ see windows that start at different times
        # (a penalized identity that announced first opens no window), and must still find each other's retry
        tag = "retry/" + _digest("retry", self.run_id, round_index, size=8)
        if unreachable:  # at once, when others of the group may not have read the window yet: only the unreached
            failed = {m for m, r in self._silent if r == round_index and m in failed_group and m != self.peer_id}
        else:
            failed = {
                m
                for m in failed_group
                if m != self.peer_id
                and (m, round_index) not in self._heard
                and not self.endpoint.control_tags(channel, m)
            }  # sent nothing at all by the confirmation deadline (a join for another group is
            # something: an honest member whose view of the window differed falls back too)
        # the retry lists the peers this one leaves out (penalized): a peer that does not penalize them yet
        # leaves them out of this redraw too, so that both draw the same group (a claim counts for this redraw only)
        left_out = json.dumps(sorted(failed | set(self._window_excluded))[:MAX_CLAIMED]).encode()
        for peer in names:
            if peer != self.peer_id and peer not in failed:
                self.endpoint.post_control(channel, round_index, peer, tag, left_out, self.confirm_timeout)
        # a member that could not be reached failed the group at once (as it does every honest peer drawn with an
        # identity that has no daemon): draw soon, counted from when every peer of the window has read it (one that
        # read it at its close fails that much later, and its retry must be in); a silent one only at the
        # confirmation deadline
        wait = max(1.0, 2 * self.slack) if unreachable else 0.0
        draw_at = min(self._confirm_by, max(time.monotonic(), self._read_by) + wait) + max(0.5, self.slack)
        if deadline - draw_at < min(1.0, self.confirm_timeout / 2):  # no time left to confirm a redraw (a member
            return None  # that gives up while the other confirmed would make the other's data be refused)
        while time.monotonic() < draw_at:
            time.sleep(min(0.05, max(0.0, draw_at - time.monotonic())))
        claims: dict[str, bytes | None] = {p: self.endpoint.take_control(channel, p, tag, 0.0) for p in names
                                           if p != self.peer_id and p not in failed}  # fmt: skip
        back = {p for p, claim in claims.items() if claim is not None}
        for claim in [c for c in claims.values() if c is not None]:
            try:
                listed = json.loads(claim.decode())
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
            if isinstance(listed, list):
                back -= {p for p in listed[:MAX_CLAIMED] if isinstance(p, str) and p != self.peer_id}
        if not back:
            return None
        members = next(g for g in draw_groups(sorted(back | {self.peer_id}), self.group_size, self.seed, round_index)
                       if self.peer_id in g)  # fmt: skip
        group_id = _digest("group", self.run_id, round_index, "retry", *members)  # one group a round per peer
        transport = self.endpoint.open_group(group_id, round_index, members)
        try:
            with record.timed("confirm"):
                self._confirm(round_index, group_id, members, names, deadline, fast_mismatch=False)
        except Exception as exc:  # noqa: BLE001 - the retry failed as well: skip the round
            self.endpoint.close_group(group_id)
            record.outcome = f"redraw failed: {exc}"
            return None
        record.partners = [names[m] for m in members if m != self.peer_id]
        record.outcome = "joined"
        record.redrawn = True
        return Group(transport, list(range(len(members))), round_index, [names[m] for m in members])

    def _claimed_exclusions(self, round_index: int, members: list[str], names: dict[str, str]) -> frozenset[str]:
        """Peers of the window that the other members of this peer's group said (in their ``join``) they leave out.

        Only members' claims count, and only about the window's other peers: a key holder in the group can
        fail the round anyway, and a claim lasts for this round's redraw only (it is never adopted as a
        penalty).
        """
        out: set[str] = set()
        for member in members:
            if member == self.peer_id:
                continue
            for payload in self.endpoint.control_payloads(f"r{round_index}", member):
                try:
                    listed = json.loads(payload.decode())
                except (ValueError, UnicodeDecodeError, RecursionError):
                    continue
                if isinstance(listed, list):
                    out.update(p for p in listed[:MAX_CLAIMED] if isinstance(p, str) and p in names)
        out.discard(self.peer_id)
        return frozenset(out)

    def _cut(self, entries: list[Announcement], mine: float) -> tuple[list[tuple[float, float]], float, float]:
        """The round's windows cut from ``entries`` (:func:`cut_windows`) and the start and end of this peer's (at
        ``mine``); notes who shares it as a peer penalizing nobody reads it (:meth:`_unpenalized_mates`)."""
        cut = cut_windows([(e.time, self.window if e.width is None else e.width) for e in entries])
        start, end = next(w for w in cut if w[0] <= mine <= w[1])
        self._plain_mates = self._unpenalized_mates(entries, start, end, mine)
        return cut, start, end

    @staticmethod
    def _unpenalized_mates(entries: list[Announcement], start: float, end: float, mine: float) -> set[str]:
        """The peers that share this peer's window of ``[start, end]`` as a peer that penalizes nobody reads it (its
        chain opened and ended by every announcement in it); empty when this peer is not in that window.

        A peer's penalties end its chain (:func:`chain_end`) at other announcements than another's do, so a member
        drawn only because this peer leaves some announcements out may have read another window and never drawn
        this peer: its silence is no evidence against it, and only the members of this set are struck for it."""
        plain = [e for e in entries if start <= e.time <= end]
        gap = min(plain, key=lambda e: (e.time, e.peer)).gap if plain else None
        if gap is not None and len(plain) > 1:
            end = min(end, chain_end([e.time for e in plain], gap))
        return {e.peer for e in plain if e.time <= end} if mine <= end else set()

    def _gather(self, round_index: int, record: RoundRecord, deadline: float, mine: float, expected: set[str],
                also: frozenset[str] = frozenset()):  # fmt: skip
        """Wait for this peer's window to be readable; ``(announcements in it, window start, my time, read by)`` or
        None; ``read by``: the monotonic time by which every member has read the window (its end and the slack).

        ``also``: peers left out of the draw besides this peer's own penalties. With :attr:`adaptive`, raises
        :class:`_Late` when this peer is alone in its window and an earlier window of the round already drew two or
        more others (the round formed without it: it skips it and joins the next one). With :attr:`push`, polls
        see the announcements pushed here; outcomes but "all waited for are in" read the DHT."""
        mates_expected = bool(expected)  # with buckets: peers expected in this peer's bucket (before a re-announce)
        observed = expected  # whose pace the window read tells (the first announcement's window only)
        read_dht = not self.push
        while True:
            others, heard = self._entries(round_index, record, read_dht)
            fresh, read_dht = read_dht, not self.push  # fresh: this poll's entries include a DHT read
            entries = [*others, Announcement(self.peer_id, mine, self.name, self._width, self._gap)]
            cut, start, end = self._cut(entries, mine)
            now = get_dht_time()
            # the chain and the formed-without-it tests are of the announcements this peer draws with: ones it leaves
            # out (a key holder's penalized sybils, ready at once each round) would end its window or pass for a group
            counted = [e for e in entries if not self._left_out(e.peer, round_index, also)]
            inside = [e for e in counted if start <= e.time <= end]
            gap = min(inside, key=lambda e: (e.time, e.peer)).gap  # the window's opener's, as its width: alike for all
            if gap is not None and len(inside) > 1:  # the window ends where its chain of announcements does
                end = min(end, chain_end([e.time for e in inside], gap))
                if mine > end:  # this peer came a gap after the others: out of the window for every reader alike
                    if now < end + self.slack:  # an announcement still on its way may bridge the gap
                        self._wait(round_index, min(self.poll, end + self.slack - now), heard)
                        continue
                    if not fresh:  # one the DHT holds and nobody pushed here may bridge it
                        read_dht = True
                        continue
                    raise _Late(f"round {round_index} formed without this peer (it announced after the window's "
                                "announcements had stopped)")  # fmt: skip
            in_window = self._drop_penalized([e for e in entries if start <= e.time <= end], round_index, also)
            present = {e.peer for e in in_window}
            eligible = {p for p in expected if not self.penalized(p, round_index)}
            wanted = {p for p in eligible if not self.adaptive or self.pace.waited_for(p)}
            alone = len(in_window) == 1
            late, lone = (self._skip_or_wait(round_index, counted, cut, start, now, alone, eligible, also)
                          if self.adaptive else (None, set()))  # fmt: skip
            wanted |= lone
            everyone = bool(wanted) and wanted <= present
            # alone, and a later window has opened: re-announce into it now, not a slack later (its peers wait for a
            # peer whose lone window just closed; one of the closed window still on its way finds the new one in its)
            moved_on = self.adaptive and alone and now > end and any(e.time > end for e in entries)
            if late is None and now < end + self.slack and not everyone and not moved_on:
                if time.monotonic() > deadline:
                    record.outcome = "timeout"
                    return None
                self._wait(round_index, min(self.poll, end + self.slack - now), heard)
                continue
            # skipping, a closed window, a lone peer, an expected peer not waited for and not pushed here (one that
            # expects nobody pushes to nobody): decided on what the DHT holds
            if not fresh and (late is not None or alone or not everyone or not eligible <= present):
                read_dht = True
                continue
            if late is not None:
                raise _Late(late)
            if not alone:
                self._note_window(round_index, in_window, start, observed)
                # by when every member has read it (one that waits for a peer still out reads at the close and the
                # slack), on this peer's clock: its confirmation wait counts from there
                return in_window, start, mine, time.monotonic() + max(0.0, end + self.slack - now)
            if self.adaptive and formed_before([e.time for e in counted], cut, start):
                raise _Late(f"round {round_index} formed without this peer")
            if self.buckets > 1 and len(entries) == 1 and not mates_expected:  # nobody else drew this key this round
                record.outcome = "alone in its bucket"
                return None
            # Alone in the window: move this peer's announcement to now and wait for the next window of
            # the round (nobody else was in the old window, so no other peer's draw changes).
            if time.monotonic() + self.slack > deadline:
                record.outcome = "no partner"
                return None
            self._push_to |= {e.peer for e in entries}
            mine = self._announce(round_index, record)
            observed = set()
            if not self.adaptive:  # adaptive: still read at once when every peer it waits for is in the new window
                expected = set()

    def _skip_or_wait(self, round_index: int, entries: list[Announcement], cut: list[tuple[float, float]],
                      start: float, now: float, alone: bool, eligible: set[str], also: frozenset[str]):  # fmt: skip
        """Adaptive deadlines, for a window starting at ``start`` (``entries``: the announcements this peer draws
        with): why this peer skips the round (it formed without it), or None; and the lone peers it waits for
        besides those it expects."""
        announced = [(e.peer, e.time) for e in entries]
        if alone and formed_without(announced, cut, start, eligible):
            return f"round {round_index} formed without this peer (every peer expected drew before)", set()
        # nobody is due in this round any more (the peers listed have moved on to a later one) and a group
        # of it drew before: a peer that is behind in phase, not in pace (it started late), otherwise waited
        # its whole window out alone in every round and never caught up with the others
        if alone and not eligible and formed_before([t for _, t in announced], cut, start):
            return f"round {round_index} formed without this peer (nobody else is due in it)", set()
        # a lone peer is waited for if expected (listed, in step) and at most one miss behind: one that
        # announces alone and never comes (a key holder delaying every round) is absent from the window,
        # so _note_window counts a miss each round, and from its second it is no longer waited for
        lone = waiting_alone(announced, cut, start, now, self.slack + 2 * self.poll)
        return None, {p for p in lone & eligible if p not in also and self.pace.level(p) <= 1}

    def _note_window(self, round_index: int, in_window: list[Announcement], start: float, expected: set[str]) -> None:
        """What the read window says for the adaptive deadlines: how late its peers in step announced after it
        opened (:func:`window_need`: a straggler's late tail left out, or every peer would learn to wait for it),
        and which expected peers were absent or in that late tail (:attr:`pace`: a peer behind the others is not
        waited for again until it has announced in step with them for a streak of windows)."""
        deadline = self.window_deadline
        need = window_need([e.time - start for e in in_window], deadline.spread, deadline.floor)
        deadline.observe(need)
        in_step = {e.peer for e in in_window if e.time - start <= need}
        for peer in expected:
            if peer in in_step:
                self.pace.in_step(peer)
            else:
                self.pace.missed(peer)

    def _confirm(self, round_index, group_id, members, names, deadline, fast_mismatch: bool,
                 window_peers: list[str] = (), strike: bool = True, read_by: float = 0.0) -> None:  # fmt: skip
        """Send ``join/<group id>`` to every other member and wait for theirs; raise on failure.

        The same ``join`` goes, in the background, to the window's peers outside the group (penalized
        ones included): it tells them this peer is here, with another group, so that none of them takes
        it for a no-show (a wrongly penalized honest peer must not penalize this one in turn).
        Members that sent nothing at all by the deadline are remembered (:meth:`_settle` strikes them).
        """
        channel = f"r{round_index}"
        began = time.monotonic()
        wait = self.confirm_deadline.value() if self.adaptive else self.confirm_timeout
        # counted from when every member has read the window (``read_by``), not from this peer's own read: one that
        # read it early (everyone it waits for was in) otherwise gave up on a group that a member reading at the
        # close then confirmed and sent its data to (refused as unexpected: an exchange lost, a receive timeout)
        confirm_by = self._confirm_by = min(deadline, max(began, read_by) + wait)
        self._read_by = read_by
        others = [m for m in members if m != self.peer_id]
        tag = f"join/{group_id}"
        # the join says whom this peer left out of the window (a member whose penalties differ redraws with them)
        left_out = json.dumps(sorted(self._window_excluded)[:MAX_CLAIMED]).encode()
        for peer in window_peers:  # first: they hear from this peer even if a member of its group is unreachable
            self.endpoint.post_control(channel, round_index, peer, tag, left_out, self.confirm_timeout)
        unreachable: list[CommError] = []
        for member in others:  # every reachable member hears from this peer, even when another is unreachable
            try:
                self.endpoint.send_control(channel, round_index, member, tag, left_out,
                                           max(0.1, confirm_by - time.monotonic()))  # fmt: skip
            except CommError as exc:
                self._silent.append((member, round_index))  # unreachable: gone, or refusing us
                if isinstance(exc, CommUnreachable):
                    self._unreachable.add((member, round_index))
                unreachable.append(exc)
        if unreachable:
            raise unreachable[0]
        waiting = set(others)
        while waiting:
            for member in list(waiting):
                if self.endpoint.take_control(channel, member, tag, 0.0) is not None:
                    waiting.discard(member)
                    self._heard.add((member, round_index))
                    self._strikes.pop(member, None)
                    self._late.pop(member, None)
                elif fast_mismatch and self.endpoint.control_tags(channel, member):
                    raise _Mismatch(f"{names[member]} formed a different group")
            if waiting and time.monotonic() > confirm_by:
                if strike:  # only members that share this peer's window whoever's penalties cut it
                    self._silent.extend((m, round_index) for m in waiting if (m, round_index) not in self._heard
                                        and not self.endpoint.control_tags(channel, m)
                                        and (self._plain_mates is None or m in self._plain_mates))  # fmt: skip
                raise TimeoutError(", ".join(sorted(names[m] for m in waiting)) + " did not confirm")
            if waiting:
                time.sleep(0.02)
        # every member confirmed: how long it took past the later of this peer's start and the window's last read
        self.confirm_deadline.observe(max(0.0, time.monotonic() - max(began, read_by)))

    def retry(self, group: Group, error: BaseException) -> Group | None:
        """After ``group``'s exchange failed: the group of the members that delivered, confirmed by each of them.

        The *culprits* are the members this peer waited for in vain (a ``recv`` timed out), could not send to,
        and the one whose payload failed to decode or validate (non-finite values, wrong size, a header that
        disagrees: ``error`` is a ``ValueError`` raised on the payload :attr:`SwarmTransport.last_from` returned;
        an error marker, :class:`~noloco.collectives.protocol.RemoteFailure`, blames nobody: its sender only
        reports a failure). The others (at least two, this peer included) form a group whose id hashes the failed
        group's and the survivors; each confirms it with a ``join`` (within :attr:`retry_wait`, as members notice
        a failure up to one receive timeout apart), and the round's exchange runs again over it. Members that
        saw different culprits compute different ids, never confirm each other, and skip the round: honest
        members either all apply the same result over the same members, or skip.

        A member whose payload was invalid is struck at once (``invalid_data``); one that delivered part of its
        data and then nothing is struck (``no_data``) when the retry without it delivers in full (so an honest
        member that stopped because another failed is not blamed).
        """
        from noloco.collectives.protocol import RemoteFailure

        transport = group.transport
        if not isinstance(transport, SwarmTransport) or group.transport.group_id not in self._open:
            return None
        culprits = set(transport.waited_on | transport.refused_by)
        if isinstance(error, ValueError) and not isinstance(error, RemoteFailure) and transport.last_from:
            culprits.add(transport.last_from)
            with self._penalty_lock:
                self._invalid.append((transport.last_from, group.round))
        culprits.discard(self.peer_id)
        self._failed_in[transport.group_id] = culprits  # their data in this group resets no strikes (release)
        survivors = [m for m in transport.members if m not in culprits]
        if not culprits or len(survivors) < 2:
            return None
        names = dict(zip(transport.members, group.peer_ids or transport.members, strict=False))
        group_id = _digest("retry", transport.group_id, *survivors)
        record = self._open[transport.group_id][0]
        retry = self.endpoint.open_group(group_id, group.round, survivors)
        try:
            self._confirm(group.round, group_id, survivors, names, time.monotonic() + self.retry_wait,
                          fast_mismatch=False)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the others saw it differently, or are gone: skip the round
            logger.warning("swarm: round %d: retry without %s failed: %s", group.round,
                           ", ".join(names[c] for c in sorted(culprits)), exc)  # fmt: skip
            self.endpoint.close_group(group_id)
            return None
        record.retried = True
        record.partners = [names[m] for m in survivors if m != self.peer_id]
        self._retries[group_id] = (transport.group_id, culprits, group.round)
        self._open[group_id] = (record, time.monotonic(), self.counter.state_dict())
        return Group(retry, list(range(len(survivors))), group.round, [names[m] for m in survivors])

    def release(self, group: Group) -> None:
        """Close the round's group; members that sent no data and that this peer waited for are noted.

        "Waited for": a ``recv`` from it timed out, or a ``send`` to it failed (a member that confirms and then
        refuses the data fails the round at once instead of by a timeout). They are struck (``no_data``) when
        the next round begins; a member that delivered data clears its ``no_data`` strikes.
        """
        transport = group.transport
        group_id = transport.group_id
        if isinstance(transport, SwarmTransport):
            delivered = self.endpoint.delivered_from(group_id)
            with self._penalty_lock:
                for peer in delivered - self._failed_in.pop(group_id, set()):
                    self._mute_strikes.pop(peer, None)
                silent = (transport.waited_on | transport.refused_by) - delivered
                retried = self._retries.pop(group_id, None)
                if retried is not None and not silent and delivered >= set(transport.members) - {self.peer_id}:
                    silent = retried[1]  # the retry without them delivered in full: they were the ones that failed
                self._mute.extend((peer, group.round) for peer in sorted(silent))
        transport.close()
        if group_id in self._open:
            record, since, before = self._open.pop(group_id)
            after = self.counter.state_dict()
            record.exchange_seconds = time.monotonic() - since
            record.bytes_sent = after["bytes_sent"] - before["bytes_sent"]
            record.bytes_received = after["bytes_received"] - before["bytes_received"]


class PeerRegistry:
    """Live peers of a run under DHT key ``<run>/peers`` (subkey = peer id), each entry MAC'd and signed.

    ``publish`` is called after every outer round with this peer's inner step (and as a heartbeat
    during long rounds); entries expire after ``ttl`` seconds, so a dead peer drops out. Entries
    whose MAC fails are ignored and counted as ``unauthenticated`` rejections, entries the peer of
    their subkey did not sign as ``forged`` (:func:`signed_entries`).
    """

    def __init__(self, dht, endpoint: SwarmEndpoint, name: str, ttl: float = 120.0,
                 on_invalid: Callable[[str, str], None] | None = None):  # fmt: skip
        self.dht, self.endpoint, self.name, self.ttl = dht, endpoint, name, float(ttl)
        self.on_invalid = on_invalid  # told of (and counts) each authentic entry whose fields are refused
        self._bad_entries: set[tuple[str, object]] = set()

    def _text(self, peer: str, step: int, next_round: int, t: float, name: str) -> bytes:
        return f"alive|{self.endpoint.run_id}|{peer}|{step}|{next_round}|{t}|{name}".encode()

    def publish(self, step: int, next_round: int) -> None:
        """List this peer as live at inner ``step``, next matching in swarm round ``next_round``."""
        now = get_dht_time()
        text = self._text(self.endpoint.peer_id, int(step), int(next_round), now, self.name)
        value = {"step": int(step), "round": int(next_round), "t": now, "name": self.name,
                 **sign_record(self.endpoint, text)}  # fmt: skip
        self.dht.store(self.key, value, now + self.ttl, subkey=self.endpoint.peer_id)

    @property
    def key(self) -> str:
        return f"{self.endpoint.run_id}/peers"

    def fetch(self):
        """The DHT search of :meth:`live`, started: its future, for ``live(fetched)`` (a peer reads the registry a
        step before its round, so that the round's matchmaking does not wait for a search of ~20 nodes)."""
        return self.dht.get(self.key, latest=True, return_future=True)

    def live(self, fetched=None) -> list[dict]:
        """Valid entries of other peers, most advanced first: ``{"peer", "name", "step", "round", "t"}``.

        ``fetched``: a :meth:`fetch` to read instead of searching the DHT now."""

        def text(peer: str, value) -> bytes:
            float(value["t"])  # a time that does not parse is malformed
            return self._text(peer, int(value["step"]), int(value["round"]), value["t"], str(value["name"]))

        def check(peer: str, value: dict) -> str | None:
            for key in ("step", "round"):
                if isinstance(value[key], bool) or not isinstance(value[key], int):
                    return f"{key} is a {type(value[key]).__name__}, not an integer"
            return record_time_error(value["t"], get_dht_time(), self.ttl) or name_error(value["name"])

        found = (self.fetch() if fetched is None else fetched).result()
        entries = signed_entries(found, text, self.endpoint, self._bad_entries, "registry entry", check,
                                 self.on_invalid)  # fmt: skip
        self.endpoint.note_peers(peer for peer, _ in entries)
        out = [{"peer": peer, "name": str(value["name"]), "step": int(value["step"]), "round": int(value["round"]),
                "t": float(value["t"])}
               for peer, value in entries if peer != self.endpoint.peer_id]  # fmt: skip
        return sorted(out, key=lambda e: (-e["step"], -e["t"]))
