"""The hivemind backend: one peer of an open swarm per process (``python train.py backend=hivemind``).

The decentralized mode (NoLoCo, arXiv 2506.10911, over an open swarm):
:func:`launch` starts a ``hivemind.DHT`` (its own p2pd daemon; it prints the multiaddrs other
peers pass as ``peer.initial_peers``), a :class:`~noloco.swarm.endpoint.SwarmEndpoint` on the same
daemon, and :class:`~noloco.swarm.matchmaking.SwarmMatchmaking` as the outer algorithm's group
source with ``skip_failed_rounds=True``, then runs the same worker loop as every backend
(:func:`~noloco.train.loop.train_worker`) with a :class:`HivemindBackend`. ``outer.algo=diloco``
averages with all peers ready in the same window instead of pairs.

Rounds: a swarm round is one outer exchange, every ``outer.every / outer.fragments`` inner steps
(:func:`exchange_period`), numbered as the outer algorithm numbers them (the exchange ending step s is round
s / period − 1), so the registry's rounds, their plausibility bound, a resumed peer's next round and a joiner's
start all count the same rounds. With ``outer.fragments=k`` round r exchanges fragment (r + 1) mod k, and a
peer catching up with the swarm skips whole cycles of k rounds (``SwarmMatchmaking(cycle=k)``), so the members
of a group always exchange the same fragment. ``outer.overlap`` runs matchmaking and the exchange on the
algorithm's exchange thread while the next round trains; one round at a time, as when blocking.

Late join: every peer serves its current state (inner step, slow weights, outer momentum) to
authenticated requests, zlib-compressed (lossless), and lists itself in the DHT after each outer
round. A new peer (``peer.join=auto``) downloads the state of the most advanced live peer before its
first inner step, checks it (MAC, sizes, finite values, step on a round boundary: a multiple of the exchange
period) and starts from that step; if no live peer answers it starts from the seed's initial weights.

Hostile peers (docs/swarm.md, threat model): the DHT runs a
:class:`~noloco.swarm.dht.RunRecordValidator` (records without the run key's MAC, not signed by the peer
their subkey names (its Ed25519 identity, which is its peer id), or expiring too far ahead, are refused
by every honest node); registry entries claiming a round or step beyond the
schedule or far above the other live peers' median are ignored, and a joiner refuses a state past
that bound; a joiner's state source is rate-limited per requester.

Outputs under ``runs/<run>/peer-<name>/``: ``metrics.jsonl`` (as every backend), ``rounds.jsonl``
(matchmaking per round: ready peers, partners, outcome, seconds, bytes) and ``summary.json`` (rounds
joined, partners, failed rounds, bytes per round, rejected messages and records by reason, states
served and refused, peak resident memory). The run key comes from
``peer.run_key`` or ``$NOLOCO_RUN_KEY``; it is removed from the config before anything is written.
Failure modes: no key → error at start; a dead or silent partner costs at most ``comm.recv_timeout``
(usually much less: a failed stream or confirmation), and the round is skipped.

Progress: the same step bar as every backend (:class:`~noloco.train.run.Progress`), with the last round's
partners or outcome and, while a round looks for partners, ``round r: finding partners``; each phase
before it (DHT start, joining) prints a line. Ctrl-C: the peer stops at its next step, saves a checkpoint
and exits 130 with the resume line (:class:`PeerInterrupted`), with no ``summary.json`` and without
listing itself as finished in the registry (round -1 means "completed" to the other peers). A peer whose
data stream runs out (``data.stream_end=stop``) is a run of its own: it ends alone at the end of that round
(:meth:`Backend.agree_stop`'s default) and leaves the swarm as at the end of a run, summary and all.
"""

from __future__ import annotations

import hashlib
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from noloco.comm.base import CommError
from noloco.gossip.base import Group, GroupSource
from noloco.optim import OuterAlgorithm, OuterState
from noloco.optim.overlap import overlap_rule
from noloco.swarm import (
    STATE_SERVICE,
    PeerDHTStart,
    PeerIdentity,
    PeerRegistry,
    RunRecordValidator,
    StateError,
    StateServer,
    SwarmEndpoint,
    SwarmMatchmaking,
    announcement_ttl,
    decode_state,
    implausible_rounds,
    implausible_steps,
    latest_incarnations,
    run_key_from,
    step_bound,
)
from noloco.train import checkpoint
from noloco.train.backends.base import Backend
from noloco.train.config import ConfigError
from noloco.train.device import warm_device
from noloco.train.interrupt import INTERRUPT, Interrupted
from noloco.train.loop import WorkerResult, train_worker
from noloco.train.run import Progress, Run, finish


def exchange_period(cfg: DictConfig) -> int:
    """Inner steps per swarm round: between two outer exchanges, ``outer.every / outer.fragments``."""
    return int(cfg.outer.every) // int(cfg.outer.fragments)


def worker_of(peer_id: str) -> int:
    """A peer's worker index when ``peer.worker`` is not set: a 31-bit hash of its peer id. It picks the peer's data
    stream (batches by ``(seed, worker, step)``) and names its checkpoint file; it orders nothing (a swarm has
    no ranks: groups are formed by matchmaking)."""
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


class HivemindBackend(Backend):
    """One peer of an open swarm: matchmaking as the group source, late join, liveness in the DHT.

    ``say`` prints a line for the user (a no-op when quiet). Checkpoints need no barrier: a peer's run
    folder is its own.
    """

    name = "hivemind"
    skip_failed_rounds = True
    progress: Progress | None = None  # the peer's step bar (set by launch): rounds and waits are shown on it

    def __init__(self, cfg: DictConfig, dht, endpoint: SwarmEndpoint, name: str, rank: int, say, validator=None):
        super().__init__(rank)
        self.cfg, self.endpoint, self.peer_name, self.say = cfg, endpoint, name, say
        self.validator = validator  # the DHT's RunRecordValidator: its refusals go into the summary
        self.registry = PeerRegistry(dht, endpoint, name, ttl=cfg.peer.registry_ttl)
        group_size = None if cfg.outer.algo == "diloco" else (cfg.peer.group_size or cfg.outer.group_size)
        self.matchmaking = SwarmMatchmaking(
            dht, endpoint, name, group_size=group_size, window=cfg.peer.window, slack=cfg.peer.slack,
            confirm_timeout=cfg.peer.confirm_timeout, timeout=cfg.peer.matchmaking_timeout, seed=cfg.run.seed,
            expected=self._expected, front=self._front, others=self._others, alone_after=cfg.peer.live_timeout,
            penalty_rounds=cfg.peer.penalty_rounds, strikes_before_penalty=cfg.peer.strikes_before_penalty,
            max_penalty_rounds=cfg.peer.max_penalty_rounds, cycle=int(cfg.outer.fragments),
            retry_wait=float(cfg.comm.recv_timeout) + float(cfg.peer.confirm_timeout),
            adaptive=cfg.peer.deadlines == "adaptive", min_window=cfg.peer.min_window,
            min_confirm=cfg.peer.min_confirm, deadline_spread=cfg.peer.deadline_spread,
            deadline_rounds=cfg.peer.deadline_rounds, buckets=int(cfg.peer.buckets), push=cfg.peer.push,
        )  # fmt: skip
        self.registry.on_invalid = self.matchmaking.strike_record  # a bad registry entry strikes its signer
        self.state = StateServer(interval=cfg.peer.state_interval, concurrency=cfg.peer.state_concurrency,
                                 burst=cfg.peer.state_burst)  # fmt: skip
        self.state.register(endpoint, STATE_SERVICE)
        self.joined_from: dict = {}
        self._heartbeat = time.monotonic()
        self._said_alone = False  # the line that says why a round waited for partners in vain, said once
        self._implausible: set = set()  # registry claims already counted as implausible
        self.period = exchange_period(cfg)  # inner steps per swarm round
        self._listing: tuple[float, list[dict]] = (-math.inf, [])  # (monotonic time read, _fresh()) of this round
        self._fetched: tuple[float, object] = (-math.inf, None)  # (asked at, PeerRegistry.fetch) for the next round
        # a resumed peer's checkpoint step (resume_at), or the step of a round it missed behind the swarm, until a
        # round of its is joined or in step with the swarm; and what that step was, for its log
        self._catching_up: int | None = None
        self._catching_up_since = "its checkpoint"

    # --- what matchmaking asks of the registry -------------------------------------------------------
    def _fresh(self) -> list[dict]:
        """Live peers that published recently, one per name (not this peer's earlier incarnation: it resumed),
        without those listing a round the swarm cannot be in.

        Read once for the questions of one round (the front, anyone left, who is expected): each read is a DHT
        search that visits up to ~20 nodes and returns every live peer's entry, so three a round grew the swarm's
        DHT traffic as N x N for nothing. The read starts a step before the round (:meth:`after_step`), so the
        round waits for it only if that step was shorter than the search."""
        read_at, cached = self._listing
        if time.monotonic() - read_at < LISTING_REUSE:
            return cached
        (asked_at, fetched), self._fetched = self._fetched, (-math.inf, None)
        if fetched is not None and time.monotonic() - asked_at > self.cfg.peer.live_timeout:
            fetched = None  # a read that old no longer tells who is live
        try:
            live = self.registry.live(fetched)
        except Exception:  # noqa: BLE001 - the early read failed (the DHT was busy then): read now
            if fetched is None:
                raise
            live = self.registry.live()
        now = time.time()
        live = latest_incarnations(live, self.peer_name)
        fresh = [e for e in live if now - e["t"] <= self.cfg.peer.live_timeout]
        fresh = implausible_rounds(fresh, self.cfg.steps, self.period, self.endpoint, self._implausible)
        self._listing = (time.monotonic(), fresh)
        return fresh

    def _expected(self, round_index: int) -> set[str]:
        """Peers that published recently and will match next in this round or the one before."""
        return {e["peer"] for e in self._fresh() if round_index - 1 <= e["round"] <= round_index}

    def _front(self) -> int:
        return max((e["round"] for e in self._fresh()), default=0)

    def _others(self) -> int:  # live peers still training (finished ones publish round -1)
        return sum(1 for e in self._fresh() if e["round"] >= 0)

    # --- the Backend interface ------------------------------------------------------------------------
    def peers(self) -> GroupSource:
        return self.matchmaking if self.progress is None else ShownRounds(self.matchmaking, self.progress)

    def publish(self, step: int, next_round: int | None = None) -> None:
        """List this peer as live (best effort: the DHT may be unreachable for a moment)."""
        try:
            self.registry.publish(step, self.matchmaking.listed_round if next_round is None else next_round)
        except Exception as exc:  # noqa: BLE001 - the DHT is best effort; training goes on
            self.say(f"noloco peer {self.peer_name}: could not publish liveness: {exc}")

    def resume_at(self, step: int) -> None:
        """A peer resuming its own checkpoint: matchmaking catches up with the swarm's round from there.

        With ``peer.catch_up`` (and no ``outer.overlap``), when the swarm is rounds ahead the peer lists itself in the
        swarm's next round at once, so the others expect it there (they wait for it and push their announcements
        to it), and :meth:`next_step` skips ahead to that round as soon as its window gathers."""
        own = step // self.period  # the round whose exchange ends next
        self.matchmaking.next_round = own
        if self.cfg.peer.catch_up and overlap_rule(self.cfg.outer.overlap) is None:
            self._catching_up, self._catching_up_since = step, "its checkpoint"
            try:
                self.matchmaking.next_round = max(own, self._front())
            except Exception:  # noqa: BLE001 - the registry is a hint: next_step reads it again
                pass
        self.publish(step)

    def next_step(self, step: int, algo) -> int:
        """``step + 1``; while a resumed peer catches up (:meth:`resume_at`) and the swarm's next round has begun to
        gather for it (:meth:`~noloco.swarm.matchmaking.SwarmMatchmaking.gathering`: an announcement pushed to it by
        a peer that expects it), the step that ends that round: the peer takes that step and joins the round with
        what it trained since its checkpoint, instead of training a whole round first and meeting the swarm a round
        later. It keeps itself listed in the registry's front round meanwhile. Catching up ends with its first round
        joined, or one in step with the swarm (its own round was the swarm's: none ahead, or none at all); a round it
        missed behind the swarm (late, or its group failed to confirm) leaves it catching up. A running peer that
        falls behind the swarm's steps catches up too (:meth:`_out_of_step`).

        The round is the registry's front, refused beyond the steps the live peers' listing allows
        (:func:`~noloco.swarm.matchmaking.step_bound`, as a joiner's state is): a key holder listing and announcing
        a round far ahead cannot make a resumed peer skip its training."""
        info = algo.last_round
        record = self.matchmaking.record_of(info.round) if info is not None else None
        if self._catching_up is None:
            return self._out_of_step(step, algo, info, record)
        in_step = record is not None and record.round == info.round  # its own round was the swarm's (or no swarm)
        if (info is not None and (info.skipped is None or in_step)) or not getattr(algo, "can_skip", False):
            self._catching_up = None  # a round joined, or one in step (or it cannot skip): nothing to catch up
            return self._out_of_step(step, algo, info, record)  # (a round joined behind the swarm: its step)
        try:
            fresh = self._fresh()
            front = max((e["round"] for e in fresh), default=-1)
            if front > max(self.matchmaking.next_round, step // self.period):  # listed there: the others expect it
                self.matchmaking.next_round = front
                self.publish(step)
            to = (front + 1) * self.period  # the step that ends the front's round
            if front < self.matchmaking.next_round:
                return step + 1  # the front's round is one this peer matched in already (the registry lags)
            if to <= step + 1 or to > self._skip_bound(fresh) or not self.matchmaking.gathering(front):
                return step + 1
        except Exception:  # noqa: BLE001 - the registry or the DHT is a hint: train on, ask again next step
            return step + 1
        trained = step - self._catching_up
        self.say(f"noloco peer {self.peer_name}: the swarm's round {front} is gathering: joining it with the "
                 f"{trained} step(s) trained since {self._catching_up_since} (step {step} → {to})")  # fmt: skip
        self._catching_up = None
        return to

    def _skip_bound(self, fresh: list[dict]) -> int:
        """The furthest step a skip may go to: the round after the steps the live peers' listing allows
        (:func:`~noloco.swarm.matchmaking.step_bound`, as for a joiner's state), at most the run's last step."""
        allowed = step_bound(fresh, self.cfg.steps, self.cfg.outer.every, self.cfg.peer.live_timeout)
        return min(self.cfg.steps, allowed + self.period)

    def _out_of_step(self, step: int, algo, info, record) -> int:
        """``step + 1``, unless the round this peer just had was a later swarm round than its own (it matched in the
        swarm's front, behind it in steps: after a round it waited out, a group that failed to confirm, a pause):
        - joined, its partners have just ended that round's step: the peer goes on from there (the steps between
          are skipped, as a resumed peer's are), so that its next rounds come when theirs do and its last ones are
          not trained alone after the swarm has finished (unless that round was the swarm's last; nor beyond the
          steps the live peers' listing allows, :func:`~noloco.swarm.matchmaking.step_bound`);
        - not joined (late, no partner, its group failed), it is out of step in time too: it catches up as a resumed
          peer does (:meth:`next_step`), joining the next round that gathers for it with the steps it trained.
        A round it came ``late`` to in step (the swarm's round, formed without it) puts it behind in time by less than a
        round, and it would come late again (docs/swarm.md, *Adaptive deadlines*): it catches up the same way, skipping
        the rest of its next round's steps once that round gathers.
        Only with ``peer.catch_up``, and without ``outer.overlap`` (whose rounds land a fixed number of steps on)."""
        behind = record is not None and (record.round > info.round or record.outcome == "late")
        if not behind or not self.cfg.peer.catch_up or not getattr(algo, "can_skip", False):
            return step + 1
        if info.skipped is not None:
            self._catching_up, self._catching_up_since = step, f"its round {info.round} (swarm round {record.round})"
            return step + 1
        to = (record.round + 1) * self.period  # the step its partners took last, the one that ended the round
        try:
            bound = self._skip_bound(self._fresh())
        except Exception:  # noqa: BLE001 - the registry is a hint: without it, the group's round is the bound
            bound = self.cfg.steps
        if to <= step or to > bound or to >= self.cfg.steps:
            return step + 1  # (to the swarm's last step: nobody is left to be in step with)
        self.say(f"noloco peer {self.peer_name}: its round {info.round} was the swarm's round {record.round}: "
                 f"going on from the swarm's step {to} (step {step} → {to + 1})")  # fmt: skip
        return to + 1

    def start(self, algo, model: torch.nn.Module) -> int:
        self._serve(algo)
        self.publish(0)  # listed (at step 0) before waiting, so peers waiting with peer.wait_for_peers see each other
        if self.progress is not None:
            self.progress.status("joining the swarm")
        start = join_swarm(self.cfg, self.endpoint, self.registry, algo, self.joined_from, self.say, self._implausible)
        self._serve(algo)
        self.matchmaking.next_round = start // self.period
        self.publish(start)
        if self.progress is not None:
            self.progress.status(None)
            self.progress.start_at(start)
        return start

    def after_step(self, step: int, algo) -> None:
        info = algo.last_round
        if info is not None:
            # the record of the round that landed (with outer.overlap the next one may be matching meanwhile)
            record = self.matchmaking.record_of(info.round)
            if record is not None:
                if info.skipped and record.outcome == "joined":  # formed, exchange failed
                    record.outcome = f"exchange failed: {info.skipped}"
                record.fragment = info.fragment
                if self.progress is not None:
                    self.progress.note(round=round_note(record))
                if record.outcome in ("no partner", "timeout") and not self._said_alone:  # once: why rounds are slow
                    self._said_alone = True
                    self.say(alone_line(self.peer_name, record.round, self.cfg.peer))
            self._serve(algo)
        # after every outer round, and as a heartbeat while a long round runs (others wait only for
        # peers that published within peer.live_timeout)
        if info is not None or time.monotonic() - self._heartbeat > self.cfg.peer.live_timeout / 3:
            self._heartbeat = time.monotonic()
            self.publish(step)
        every = getattr(algo, "period", 0)
        if every and (algo.inner_step + 1) % every == 0:  # the next step ends a round: its matchmaking reads the
            self._fetch_listing()  # registry

    def _fetch_listing(self) -> None:
        """Start the registry read of the next round's matchmaking (:meth:`_fresh`); best effort."""
        try:
            self._fetched = (time.monotonic(), self.registry.fetch())
        except Exception:  # noqa: BLE001 - the round reads it itself then
            self._fetched = (-math.inf, None)

    def barrier(self, step: int) -> bool:
        return True

    def marks_complete(self) -> bool:
        return True

    def _serve(self, algo) -> None:
        if isinstance(algo, OuterAlgorithm):
            state = algo.save_state()
            self.state.update(state.step, state.slow, state.velocity)


class PeerInterrupted(Interrupted):
    """Ctrl-C on a swarm peer: its resume line also says that the run key is needed again (it is never saved)."""

    def line(self) -> str:
        line = super().line()
        return line + " (and the run key: NOLOCO_RUN_KEY or peer.run_key)" if "resume=" in line else line


class ShownRounds(GroupSource):
    """The peer's matchmaking as its group source, showing on the step bar while a round looks for partners.

    After Ctrl-C a round that has not begun is skipped at once (the peer stops and saves at this step;
    it does not announce itself ready to peers it is leaving).
    """

    def __init__(self, matchmaking: SwarmMatchmaking, progress: Progress):
        self.matchmaking, self.progress = matchmaking, progress
        self.counter = matchmaking.counter
        self.group_size = matchmaking.group_size  # the eager overlap's share w = 1/ñ before a group has arrived

    def form(self, round_index: int, timeout: float) -> Group | None:
        if INTERRUPT.requested:
            return None
        wait = min(timeout, self.matchmaking.timeout)
        shown = self.matchmaking.target(round_index, self.matchmaking.next_round)  # before the registry's front
        self.progress.status(f"round {shown}: finding partners (≤ {wait:g} s)")
        try:
            return self.matchmaking.form(round_index, timeout)
        finally:
            self.progress.status(None)

    def release(self, group: Group) -> None:
        self.matchmaking.release(group)

    def why_none(self, round_index: int) -> str:
        return "no partner: interrupted" if INTERRUPT.requested else self.matchmaking.why_none(round_index)

    def retry(self, group: Group, error: BaseException) -> Group | None:
        self.progress.status(f"round {group.round}: a member failed, retrying with those that delivered")
        try:
            return self.matchmaking.retry(group, error)
        finally:
            self.progress.status(None)


def alone_line(name: str, round_index: int, peer) -> str:
    """Why a round trained on alone after waiting (said once per peer): no other ready peer in time."""
    return (f"noloco peer {name}: round {round_index} found no ready partner within peer.matchmaking_timeout="
            f"{peer.matchmaking_timeout:g} s and trains on alone; rounds wait that long for partners until no other "
            f"live peer has been seen for peer.live_timeout={peer.live_timeout:g} s, then go on at once")  # fmt: skip


def round_note(record) -> str:
    """One round on the step bar: ``3 with peer-1`` or ``3 alone (no partner)``."""
    if record.outcome == "joined":
        return f"{record.round} with {', '.join(record.partners)}"
    outcome = record.outcome if len(record.outcome) <= 40 else record.outcome[:39] + "…"
    return f"{record.round} alone ({outcome})"


def _announce(cfg: DictConfig, corpus, params: int, say) -> None:
    """Print what this peer runs (as every backend does)."""
    say(f"noloco peer: {cfg.outer.algo} ({cfg.comm.codec}) · {params / 1e6:.2f}M params · {cfg.steps} steps · "
        f"data {cfg.data.source}: {corpus.train.size:,} train / {corpus.val.size:,} held-out tokens · "
        f"swarm {cfg.peer.run_id}")  # fmt: skip


def launch(
    cfg: DictConfig,
    run_dir: Path | None = None,
    resume_from: Path | None = None,
    resume_step: int = 0,
    quiet: bool = False,
) -> dict:
    """Run one swarm peer until ``cfg.steps`` inner steps; returns (and writes) its summary.

    ``resume_from``: this peer's own checkpoint (``runs/<run>/peer-<name>/checkpoints/...``); the peer
    continues from it (model, optimizer, slow weights, momentum, error feedback) instead of joining
    from a live peer, and matchmaking catches it up with the swarm's current round. The placement: this
    process is one worker, a run of its own in ``runs/<run>/peer-<name>/``.
    """
    progress: Progress | None = None

    def say(*parts) -> None:  # a line for the user, above the step bar while it is shown
        if quiet:
            return
        line = " ".join(map(str, parts))
        if progress is not None:
            progress.write(line)
        else:
            print(line, flush=True)

    cfg, key = _checked(cfg)
    # the DHT node and p2pd start while this process reads its data and checks its checkpoint (one forked process;
    # forked here, before the check's threads), and the GPU wakes beside both
    starting, validator, identity = _begin_dht(cfg, key)
    warming = warm_device(str(cfg.device))
    try:
        run = Run(cfg, run_dir, resume_from, resume_step, quiet=quiet)
        corpus = run.load_corpus()
        run.check_resume(_resume_ranks(run.resume_from))  # a peer's folder holds its own worker, whatever its rank
        _announce(cfg, corpus, run.params, say)
    except BaseException:
        starting.cancel()
        raise
    warming.join()  # before a retried start of the DHT forks again
    dht = _dht_ready(cfg, starting, say)
    endpoint = None
    try:
        endpoint = SwarmEndpoint.from_dht(dht, cfg.peer.run_id, key, **_endpoint_options(cfg), identity=identity)
        worker, name = _worker_and_name(cfg, endpoint, run)
        if hasattr(corpus, "check_shards"):  # data.streaming: this peer's shard has documents (before its folder)
            corpus.check_shards([worker], cfg.workers * cfg.inner.processes)
        folder = run.folder if run.resume_from is not None and run.folder is not None else None  # the one resumed
        peer_dir = run.create(_peer_folder(cfg, dht, endpoint, name, say, folder), announce=False,
                              threads=cfg.threads or 1)  # fmt: skip
        backend = HivemindBackend(cfg, dht, endpoint, name, worker, say, validator)
        metrics = run.metrics(wandb_name=f"{peer_dir.parent.name}/{peer_dir.name}", wandb_group=peer_dir.parent.name)
        if run.resume_from is not None:
            say(f"noloco peer {name}: resuming from its own checkpoint at step {resume_step} ({resume_from})")
            backend.resume_at(resume_step)
        ctx = run.context(metrics, 1, quiet_start=True)
        progress = backend.progress = ctx.progress
        try:
            result = run.train(ctx, lambda: train_worker(ctx, backend), arm=False)
        finally:
            progress = None
        # Ctrl-C: saved at its step, not finished: no summary, and not listed as finished (round -1), so no peer
        # takes it for a completed one; its last entry ages out of the others' view like a dead peer's
        run.raise_if_stopped(ctx, kind=PeerInterrupted)
        backend.publish(cfg.steps, -1)  # finished: round -1 takes this peer out of others' front and expected sets
        summary = _summary(run, backend, result, peer_dir)
        say(
            f"noloco peer {name}: done · held-out loss {summary['final_eval_loss']:.4f} · rounds joined "
            f"{summary['rounds_joined']}/{summary['rounds']} · {summary['bytes_sent'] / 1e6:.2f} MB sent · {peer_dir}"
        )
        return summary
    finally:
        if endpoint is not None:
            endpoint.close()
        if INTERRUPT.requested:  # a terminal's Ctrl-C also stopped p2pd: the node cannot say goodbye
            dht.shutdown_timeout = min(dht.shutdown_timeout, 1.0)
        dht.shutdown()


def _resume_ranks(folder: Path | None) -> list[int]:
    """The worker a resumed peer's checkpoint holds (one per peer folder, whatever its rank); [] for a new peer."""
    if folder is None:
        return []
    ranks = checkpoint.worker_ranks(folder)
    if not ranks:
        raise checkpoint.CheckpointError(f"{folder} holds no worker state")
    return ranks


def _begin_dht(cfg: DictConfig, key) -> tuple[PeerDHTStart, RunRecordValidator, PeerIdentity]:
    """This peer's DHT node and p2p daemon (the run's record validator on it), forked now and waited for by
    :func:`_dht_ready`, with its validator and identity."""
    peer = cfg.peer
    identity = PeerIdentity.generate()  # this peer's libp2p id; it signs the DHT records under that id
    validator = RunRecordValidator.create(key, peer.run_id, record_ttl_bound(cfg), identity)
    starting = PeerDHTStart(list(peer.initial_peers), list(peer.host_maddrs), list(peer.announce_maddrs),
                            startup_timeout=cfg.comm.startup_timeout, record_validators=[validator],
                            identity=identity)  # fmt: skip
    return starting, validator, identity


def _dht_ready(cfg: DictConfig, starting: PeerDHTStart, say):
    """The started DHT of :func:`_begin_dht`; ConfigError when the daemon cannot start or no initial peer answers."""
    peer = cfg.peer
    say("noloco peer: starting its DHT node and p2p daemon (" + (f"joining through {len(peer.initial_peers)} "
        "initial peer(s)" if peer.initial_peers else "a new swarm: no peer.initial_peers") + ")")  # fmt: skip
    from hivemind.p2p import P2PDaemonError

    try:
        return starting.result()
    except P2PDaemonError as exc:  # a bootstrap peer that has exited, an address nobody listens on
        where = (
            f"none of peer.initial_peers={list(peer.initial_peers)} answered"
            if peer.initial_peers
            else f"its p2p daemon could not start on peer.host_maddrs={list(peer.host_maddrs)}"
        )
        reason = (str(exc).strip().splitlines() or ["P2PDaemonError"])[0][:200]
        raise ConfigError(f"noloco peer: {where} (is the bootstrap peer still running?): {reason}") from None


def _endpoint_options(cfg: DictConfig) -> dict:
    """The endpoint's limits from ``peer.*`` and its send timeout (``comm.recv_timeout``)."""
    peer = cfg.peer
    return dict(max_message_bytes=int(peer.max_message_mb * 2**20), send_timeout=cfg.comm.recv_timeout,
                header_timeout=peer.header_timeout, max_unauth_per_peer=peer.max_unauth_per_peer,
                max_unauth_streams=peer.max_unauth_streams)  # fmt: skip


def _worker_and_name(cfg: DictConfig, endpoint: SwarmEndpoint, run: Run) -> tuple[int, str]:
    """This peer's worker index (its data stream and checkpoint file: ``peer.worker``, else a hash of its peer id;
    a resumed peer keeps its checkpoint's) and its name (``peer.name``, else its worker index where given, else
    the end of its peer id; a resumed peer keeps its folder's)."""
    peer = cfg.peer
    worker = peer.worker if peer.worker is not None else worker_of(endpoint.peer_id)
    if run.resume_from is not None:  # the data stream (and checkpoint file) of the run being resumed
        worker = _checkpoint_rank(run.resume_from, worker)
    name = str(peer.name or (worker if peer.worker is not None else endpoint.peer_id[-8:]))
    if run.resume_from is not None and run.folder is not None and not peer.name:
        name = run.folder.name.removeprefix("peer-")
    return worker, name


#: Seconds of clock difference between peers that a DHT record's expiration may carry.
CLOCK_SKEW_SECONDS = 120.0
LISTING_REUSE = 1.0  # seconds a read of the registry answers the questions of one round (HivemindBackend._fresh)


def record_ttl_bound(cfg: DictConfig) -> float:
    """The furthest ahead a DHT record of this run may expire: the longest TTL honest peers use, plus skew."""
    peer = cfg.peer
    ready = announcement_ttl(peer.window, peer.slack, peer.confirm_timeout)
    return max(float(peer.registry_ttl), ready) + CLOCK_SKEW_SECONDS


def _checked(cfg: DictConfig):
    """(a copy of ``cfg`` without the run key, the key); :class:`ConfigError` when the swarm cannot run it."""
    try:
        key = run_key_from(cfg.peer.run_key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = cfg.copy()
    cfg.peer.run_key = None  # the key is never written to config.yaml, checkpoints or logs
    if cfg.outer.algo not in ("noloco", "diloco"):
        raise ConfigError(f"backend=hivemind runs outer.algo=noloco or diloco, not {cfg.outer.algo!r}")
    if cfg.peer.buckets > 1 and cfg.outer.algo == "diloco":
        raise ConfigError("peer.buckets > 1 needs outer.algo=noloco: DiLoCo averages every ready peer, under one key")
    return cfg, key


def _checkpoint_rank(folder: Path, default: int) -> int:
    """The worker rank a checkpoint folder holds (one worker per peer), else ``default``."""
    from noloco.train.checkpoint import worker_ranks

    ranks = worker_ranks(folder)
    return ranks[0] if len(ranks) == 1 else default


def _peer_folder(cfg: DictConfig, dht, endpoint: SwarmEndpoint, name: str, say, folder: Path | None = None) -> Path:
    """``runs/<run>/peer-<name>/`` (or ``folder``: the one being resumed) with its multiaddrs (the run writes
    its config there); prints how others join."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    say(f"noloco peer {name}: peer id {endpoint.peer_id}")
    say("noloco peer: others join with peer.initial_peers='[" + ",".join(f'"{m}"' for m in maddrs) + "]'")
    if folder is None:  # a new peer: its folder must not hold another run (run.overwrite)
        from noloco.train.run import new_run_folder

        folder = new_run_folder(cfg, Path(cfg.run.dir) / (cfg.run.name or cfg.peer.run_id) / f"peer-{name}")
    folder.mkdir(parents=True, exist_ok=True)
    # whole or not at all: others poll for it (a joiner's script, the fleet's health check) and read it at once
    listing = json.dumps({"peer_id": endpoint.peer_id, "maddrs": maddrs})
    checkpoint.atomic_write(folder / "maddrs.json", listing.encode())
    return folder


def join_swarm(cfg, endpoint: SwarmEndpoint, registry: PeerRegistry, algo, joined_from: dict, say,
               seen: set | None = None) -> int:  # fmt: skip
    """Download the most advanced live peer's state into ``algo`` (``peer.join=auto``); returns the start step.

    Only peers whose listed step is plausible are tried (at most ``steps``, and not far above the median
    listed step of the live peers that have trained: :func:`~noloco.swarm.matchmaking.step_bound`; a key
    holder claiming to be far ahead is ignored), and a downloaded state more than one round past that
    bound is refused; both are counted as ``implausible_step`` rejections. A state is at a round boundary: a
    multiple of the exchange period (``outer.every / outer.fragments``; the source serves its state after each
    exchange). The tolerance above the median stays in units of ``outer.every`` (a full cycle, in which every
    parameter is exchanged once), the same with or without fragments.
    """
    seen = set() if seen is None else seen
    steps, every, period = cfg.steps, cfg.outer.every, exchange_period(cfg)

    def plausible() -> list[dict]:
        return implausible_steps(registry.live(), steps, every, endpoint, seen, cfg.peer.live_timeout)

    seed_start = f"starting from the initial weights of run.seed={cfg.run.seed}"
    live = _wait_for_peers(cfg.peer, plausible, say, seed_start)
    deadline = time.monotonic() + cfg.peer.join_timeout
    ahead = [e for e in live if e["step"] > 0 and e["round"] >= 0]  # round -1: the peer has finished
    if cfg.peer.join == "auto" and not any(e["step"] > 0 for e in live):
        say(f"noloco peer: no live peer has trained yet: {seed_start}")
    if ahead:  # download right after the most advanced peer's next round, so this peer starts in step with it
        first = ahead[0]
        say(f"noloco peer: {first['name']} is furthest (step {first['step']}): downloading its state after its "
            "next round")  # fmt: skip
        while time.monotonic() < deadline:
            fresh = [e for e in plausible() if e["peer"] == first["peer"]]
            if not fresh or fresh[0]["step"] > first["step"]:
                break
            time.sleep(0.2)
        live = plausible()
    deadline = time.monotonic() + cfg.peer.join_timeout
    while True:  # try every live peer, most advanced first, until one answers or join_timeout passes
        # a state may be one round past its listing (the source finished a round since it published)
        bound = min(steps, step_bound(live, steps, every, cfg.peer.live_timeout) + period)
        for entry in live:
            if entry["step"] <= 0:
                continue
            try:
                payload = endpoint.request(
                    entry["peer"], STATE_SERVICE, b"", cfg.peer.join_timeout, 16 * algo.slow.numel() + 4096
                )
                step, slow, velocity = decode_state(payload, algo.slow.numel(), period)
                if step > bound:
                    endpoint.count_rejection("implausible_step", f"state at step {step} > bound {bound}",
                                             entry["peer"])  # fmt: skip
                    raise StateError(f"its state is at step {step}, beyond what the swarm allows ({bound})")
            except (CommError, StateError) as exc:
                say(f"noloco peer: could not join from {entry['name']}: {exc}; connected: {endpoint.connected_peers()}")
                continue
            try:
                algo.load_state(OuterState(step, slow, velocity))
            except ValueError as exc:
                say(f"noloco peer: refused the state of {entry['name']}: {exc}")
                continue
            joined_from.update(peer=entry["name"], step=step, bytes=len(payload))
            say(f"noloco peer: joined from {entry['name']} at step {step} ({len(payload) / 1e6:.2f} MB state)")
            return step
        if not any(e["step"] > 0 for e in live) or time.monotonic() > deadline:
            if any(e["step"] > 0 for e in live):
                say(f"noloco peer: no live peer's state could be downloaded in {cfg.peer.join_timeout:g} s: "
                    f"{seed_start}")  # fmt: skip
            return 0
        time.sleep(1.0)
        live = plausible()


def _wait_for_peers(peer, plausible, say, seed_start: str) -> list[dict]:
    """``peer.wait_for_peers`` other plausible live peers, waited for up to ``peer.join_timeout`` (saying how many
    are live as that changes); returns the live ones ([] with ``peer.join=never``)."""
    if peer.join != "auto":
        say(f"noloco peer: peer.join={peer.join}: {seed_start}")
    elif peer.wait_for_peers:
        say(f"noloco peer: waiting for {peer.wait_for_peers} other live peer(s) (peer.wait_for_peers, up to "
            f"{peer.join_timeout:g} s)")  # fmt: skip
    deadline = time.monotonic() + peer.join_timeout
    shown = -1
    while True:
        live = plausible() if peer.join == "auto" else []
        if len(live) >= peer.wait_for_peers or time.monotonic() > deadline:
            break
        if len(live) != shown and shown >= 0:
            say(f"noloco peer: {len(live)} of {peer.wait_for_peers} other peer(s) live")
        shown = len(live)
        time.sleep(0.5)
    if peer.join == "auto" and len(live) < peer.wait_for_peers:
        say(f"noloco peer: {len(live)} of {peer.wait_for_peers} other peer(s) live after "
            f"{peer.join_timeout:g} s; going on")  # fmt: skip
    return live


def rejection_counts(backend: HivemindBackend) -> dict[str, int]:
    """Every refusal by reason: the endpoint's (messages, registry claims, penalties) and the DHT node's records."""
    counts = dict(backend.endpoint.rejection_counts())
    if backend.validator is not None:
        counts.update({k: v for k, v in backend.validator.counts().items() if v})
    return counts


def _summary(run: Run, backend: HivemindBackend, result: WorkerResult, peer_dir: Path) -> dict:
    """The peer's :class:`~noloco.train.run.RunSummary` (a run of one worker) plus the swarm's own numbers."""
    rounds = backend.matchmaking.rounds
    with (peer_dir / "rounds.jsonl").open("w") as f:
        for record in rounds:
            line = {k: v for k, v in record.__dict__.items() if k != "fragment" or v is not None}
            f.write(json.dumps(line) + "\n")
    joined = [r for r in rounds if r.outcome == "joined"]
    slow = result.slow_weights
    extra = {
        "peer": backend.peer_name,
        "peer_id": backend.endpoint.peer_id,
        "rank": result.rank,
        "eval_history": result.eval_history,
        "slow_weights_finite": bool(torch.isfinite(slow).all()),
        "slow_weights_norm": float(slow.norm()),
        "rounds": len(rounds),
        "rounds_joined": len(joined),
        "failed_rounds": len(rounds) - len(joined),
        "rounds_redrawn": sum(r.redrawn for r in joined),  # formed by a second draw without the silent
        "rounds_retried": sum(r.retried for r in joined),  # exchanged again without the members that failed
        "round_outcomes": [r.outcome for r in rounds],
        "partners": [r.partners for r in joined],
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "bytes_sent_per_round": [r.bytes_sent for r in joined],
        "matchmaking_seconds_per_round": [round(r.matchmaking_seconds, 3) for r in rounds],
        "exchange_seconds_per_round": [round(r.exchange_seconds, 3) for r in joined],
        "rejected_messages": rejection_counts(backend),
        "penalties": dict(backend.matchmaking.penalties),  # by reason: strikes that left a peer out of draws
        "states_served": backend.state.served,
        "states_throttled": backend.state.throttled,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "joined_from": backend.joined_from or None,
    }
    summary = run.summary([result], None, peer_dir, start=backend.joined_from.get("step", run.resume_step),
                          extra=extra)  # fmt: skip
    return finish(run.cfg, summary, quiet=True)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience for `python -m`
    from noloco.train.cli import main as cli_main

    return cli_main(["backend=hivemind", *(argv if argv is not None else sys.argv[1:])])
