"""The hivemind backend: one peer of an open swarm per process (``python train.py backend=hivemind``).

Implements the decentralized mode of issue 5 (NoLoCo, arXiv 2506.10911, over an open swarm):
:func:`run_peer` starts a ``hivemind.DHT`` (its own p2pd daemon; it prints the multiaddrs other
peers pass as ``peer.initial_peers``), a :class:`~noloco.comm.swarm.SwarmEndpoint` on the same
daemon, and :class:`~noloco.gossip.matchmaking.SwarmMatchmaking` as the outer algorithm's group
source with ``skip_failed_rounds=True``, then runs the same worker loop as every backend
(:func:`~noloco.train.loop.train_worker`). ``outer.algo=diloco`` averages with all peers ready in
the same window instead of pairs.

Late join: every peer serves its current state (inner step, slow weights, outer momentum) to
authenticated requests, zlib-compressed (lossless), and lists itself in the DHT after each outer
round. A new peer (``peer.join=auto``) downloads the state of the most advanced live peer before its
first inner step, checks it (MAC, sizes, finite values, step on a round boundary) and starts from
that step; if no live peer answers it starts from the seed's initial weights.

Outputs under ``runs/<run>/peer-<name>/``: ``metrics.jsonl`` (as every backend), ``rounds.jsonl``
(matchmaking per round: ready peers, partners, outcome, seconds, bytes) and ``summary.json`` (rounds
joined, partners, failed rounds, bytes per round, rejected messages). The run key comes from
``peer.run_key`` or ``$NOLOCO_RUN_KEY``; it is removed from the config before anything is written.
Failure modes: no key → error at start; a dead or silent partner costs at most ``comm.timeout``
(usually much less: a failed stream or confirmation), and the round is skipped.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
import zlib
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.comm.base import CommError
from noloco.comm.swarm import SwarmEndpoint, run_key_from, start_dht
from noloco.gossip.matchmaking import PeerRegistry, SwarmMatchmaking
from noloco.train.algorithms import Algorithm, OuterAlgorithm, copy_flat_into
from noloco.train.config import ConfigError
from noloco.train.data import eval_batches, prepare_corpus
from noloco.train.loop import RunContext, build_model, train_worker
from noloco.train.metrics import MetricsLogger

STATE_SERVICE = "state/1"
STATE_HEADER = struct.Struct("!QQB")  # inner step, numel, has velocity


class StateError(ValueError):
    """A downloaded peer state is malformed, of the wrong size or not finite."""


def encode_state(step: int, slow: torch.Tensor, velocity: torch.Tensor | None) -> bytes:
    """``step``, flat fp32 ``slow`` and optional ``velocity`` → header ‖ zlib(slow) ‖ zlib(velocity)."""
    slow_z = zlib.compress(slow.float().contiguous().numpy().tobytes(), 1)
    vel_z = b"" if velocity is None else zlib.compress(velocity.float().contiguous().numpy().tobytes(), 1)
    return STATE_HEADER.pack(step, slow.numel(), velocity is not None) + struct.pack("!Q", len(slow_z)) + slow_z + vel_z


def _inflate(blob: bytes, numel: int) -> torch.Tensor:
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(blob, 4 * numel)
    except zlib.error as exc:
        raise StateError(f"bad compressed tensor: {exc}") from None
    if len(raw) != 4 * numel or inflater.unconsumed_tail or not inflater.eof:
        raise StateError(f"compressed tensor does not hold exactly {numel} fp32 values")
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if not torch.isfinite(tensor).all():
        raise StateError("peer state holds non-finite values")
    return tensor


def decode_state(payload: bytes, numel: int, every: int) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`encode_state`, validated against the model size ``numel`` and ``outer.every``."""
    if len(payload) < STATE_HEADER.size + 8:
        raise StateError("peer state is truncated")
    step, count, has_velocity = STATE_HEADER.unpack_from(payload)
    (slow_len,) = struct.unpack_from("!Q", payload, STATE_HEADER.size)
    if count != numel:
        raise StateError(f"peer state has {count} weights, this model has {numel}")
    if step % every:
        raise StateError(f"peer state is at step {step}, not on an outer-round boundary (every={every})")
    body = payload[STATE_HEADER.size + 8 :]
    if slow_len > len(body):
        raise StateError("peer state is truncated")
    slow = _inflate(body[:slow_len], numel)
    velocity = _inflate(body[slow_len:], numel) if has_velocity else None
    if not has_velocity and len(body) != slow_len:
        raise StateError("peer state has trailing bytes")
    return int(step), slow, velocity


class PeerState:
    """This peer's latest post-round state, served to late joiners (updated by the training thread)."""

    def __init__(self) -> None:
        self.step, self.slow, self.velocity = 0, None, None

    def update(self, algo: OuterAlgorithm) -> None:
        velocity = getattr(algo.rule, "velocity", None)
        self.step, self.slow = algo.inner_step, algo.slow.clone()
        self.velocity = None if velocity is None else velocity.clone()

    def serve(self, request: bytes, src: str) -> bytes:
        step, slow, velocity = self.step, self.slow, self.velocity  # one consistent snapshot
        if slow is None:
            raise CommError("no state yet")
        return encode_state(step, slow, velocity)


def _peer_rank(peer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def _start_dht(cfg: DictConfig, attempts: int = 3):
    """Start the DHT (and its p2pd); p2pd sometimes fails to reach a busy bootstrap peer, so retry."""
    from hivemind.p2p import P2PDaemonError

    peer = cfg.peer
    kwargs = dict(host_maddrs=list(peer.host_maddrs), start=True, startup_timeout=60)
    if peer.announce_maddrs:
        kwargs["announce_maddrs"] = list(peer.announce_maddrs)
    for attempt in range(attempts):
        try:
            return start_dht(initial_peers=list(peer.initial_peers) or None, **kwargs)
        except P2PDaemonError:
            if attempt == attempts - 1:
                raise
            time.sleep(2.0)


def run_peer(cfg: DictConfig, quiet: bool = False, resume_from: Path | None = None, resume_step: int = 0) -> dict:
    """Run one swarm peer until ``cfg.steps`` inner steps; returns (and writes) its summary.

    ``resume_from``: this peer's own checkpoint (``runs/<run>/peer-<name>/checkpoints/...``); the peer
    continues from it (model, optimizer, slow weights, momentum, error feedback) instead of joining
    from a live peer, and matchmaking catches it up with the swarm's current round.
    """
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    try:
        key = run_key_from(cfg.peer.run_key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = cfg.copy()
    cfg.peer.run_key = None  # the key is never written to config.yaml, checkpoints or logs
    if cfg.outer.algo not in ("noloco", "diloco"):
        raise ConfigError(f"backend=hivemind runs outer.algo=noloco or diloco, not {cfg.outer.algo!r}")
    group_size = None if cfg.outer.algo == "diloco" else (cfg.peer.group_size or cfg.outer.group_size)
    started = time.perf_counter()
    corpus = prepare_corpus(
        cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir
    )
    torch.set_num_threads(cfg.threads or 1)

    dht = _start_dht(cfg)
    endpoint = None
    try:
        endpoint = SwarmEndpoint.from_dht(
            dht,
            cfg.peer.run_id,
            key,
            max_message_bytes=int(cfg.peer.max_message_mb * 2**20),
            send_timeout=cfg.comm.timeout,
        )
        rank = cfg.peer.rank if cfg.peer.rank is not None else _peer_rank(endpoint.peer_id)
        name = str(cfg.peer.name or (rank if cfg.peer.rank is not None else endpoint.peer_id[-8:]))
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        say(f"noloco peer {name}: peer id {endpoint.peer_id}")
        say("noloco peer: others join with peer.initial_peers='[" + ",".join(f'"{m}"' for m in maddrs) + "]'")
        run_dir = Path(cfg.run.dir) / (cfg.run.name or cfg.peer.run_id) / f"peer-{name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (run_dir / "maddrs.json").write_text(json.dumps({"peer_id": endpoint.peer_id, "maddrs": maddrs}))

        registry = PeerRegistry(dht, endpoint, name, ttl=cfg.peer.registry_ttl)

        def fresh() -> list[dict]:
            now = time.time()
            return [e for e in registry.live() if now - e["t"] <= cfg.peer.live_timeout]

        def expected(round_index: int) -> set[str]:
            # Peers that published recently and will match next in this round or the one before.
            return {e["peer"] for e in fresh() if round_index - 1 <= e["round"] <= round_index}

        def front() -> int:
            return max((e["round"] for e in fresh()), default=0)

        def others() -> int:  # live peers still training (finished ones publish round -1)
            return sum(1 for e in fresh() if e["round"] >= 0)

        groups = SwarmMatchmaking(
            dht,
            endpoint,
            name,
            group_size=group_size,
            window=cfg.peer.window,
            slack=cfg.peer.slack,
            confirm_timeout=cfg.peer.confirm_timeout,
            timeout=cfg.peer.matchmaking_timeout,
            seed=cfg.run.seed,
            expected=expected,
            front=front,
            others=others,
            alone_after=cfg.peer.live_timeout,
        )
        state = PeerState()
        endpoint.serve(STATE_SERVICE, state.serve)
        joined_from: dict = {}

        def join(algo: Algorithm, model: torch.nn.Module) -> int:
            state.update(algo)
            # listed (at step 0) before waiting, so that peers waiting for each other with
            # peer.wait_for_peers see each other
            try:
                registry.publish(0, groups.next_round)
            except Exception as exc:  # noqa: BLE001 - the DHT is best effort; _join still waits and retries
                say(f"noloco peer {name}: could not publish liveness: {exc}")
            start = _join(cfg, endpoint, registry, algo, joined_from, say)
            state.update(algo)
            groups.next_round = start // cfg.outer.every
            registry.publish(start, groups.next_round)
            return start

        heartbeat = {"last": time.monotonic()}

        def after_step(step: int, algo: Algorithm) -> None:
            info = algo.last_round
            if info is not None:
                last = groups.rounds[-1] if groups.rounds else None
                if info.skipped and last is not None and last.outcome == "joined":  # formed, exchange failed
                    last.outcome = f"exchange failed: {info.skipped}"
                state.update(algo)
            # after every outer round, and as a heartbeat while a long round runs (others wait only for
            # peers that published within peer.live_timeout)
            if info is not None or time.monotonic() - heartbeat["last"] > cfg.peer.live_timeout / 3:
                heartbeat["last"] = time.monotonic()
                try:
                    registry.publish(step, groups.next_round)
                except Exception as exc:  # noqa: BLE001 - the DHT is best effort; training goes on
                    say(f"noloco peer {name}: could not publish liveness: {exc}")

        metrics = MetricsLogger(
            run_dir, tensorboard=cfg.log.tensorboard, resume_step=resume_step if resume_from else None
        )
        if resume_from is not None:
            # the data stream (and checkpoint file) of the run being resumed: its rank, not the new peer id's
            saved = sorted(Path(resume_from).glob("worker_*.json"))
            if len(saved) == 1:
                rank = int(saved[0].stem.removeprefix("worker_"))
            say(f"noloco peer {name}: resuming from its own checkpoint at step {resume_step} ({resume_from})")
            groups.next_round = resume_step // cfg.outer.every
            try:
                registry.publish(resume_step, groups.next_round)
            except Exception as exc:  # noqa: BLE001 - the DHT is best effort; training goes on
                say(f"noloco peer {name}: could not publish liveness: {exc}")
        ctx = RunContext(
            cfg,
            corpus,
            run_dir,
            metrics,
            resume_from=resume_from,
            resume_step=resume_step,
            groups=groups,
            rank=rank,
            join=join,
            after_step=after_step,
        )
        try:
            result = train_worker(ctx, None)
        finally:
            metrics.close()
        try:  # finished: round -1 takes this peer out of others' round front and expected sets
            registry.publish(cfg.steps, -1)
        except Exception as exc:  # noqa: BLE001 - the DHT is best effort
            say(f"noloco peer {name}: could not publish that it finished: {exc}")
        with (run_dir / "rounds.jsonl").open("w") as f:
            for record in groups.rounds:
                f.write(json.dumps(record.__dict__) + "\n")
        summary = _summary(cfg, name, endpoint, groups, result, corpus, time.perf_counter() - started, joined_from)
        summary["run_dir"] = str(run_dir)
        summary["params"] = build_model(cfg, corpus.vocab_size).num_parameters()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        say(
            f"noloco peer {name}: done · held-out loss {summary['final_eval_loss']:.4f} · rounds joined "
            f"{summary['rounds_joined']}/{summary['rounds']} · {summary['bytes_sent'] / 1e6:.2f} MB sent · {run_dir}"
        )
        return summary
    finally:
        if endpoint is not None:
            endpoint.close()
        dht.shutdown()


def _join(cfg, endpoint: SwarmEndpoint, registry: PeerRegistry, algo, joined_from: dict, say) -> int:
    """Download the most advanced live peer's state into ``algo`` (``peer.join=auto``); returns the start step."""
    deadline = time.monotonic() + cfg.peer.join_timeout
    while True:
        live = registry.live() if cfg.peer.join == "auto" else []
        if len(live) >= cfg.peer.wait_for_peers or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    deadline = time.monotonic() + cfg.peer.join_timeout
    ahead = [e for e in live if e["step"] > 0 and e["round"] >= 0]  # round -1: the peer has finished
    if ahead:  # download right after the most advanced peer's next round, so this peer starts in step with it
        first = ahead[0]
        while time.monotonic() < deadline:
            fresh = [e for e in registry.live() if e["peer"] == first["peer"]]
            if not fresh or fresh[0]["step"] > first["step"]:
                break
            time.sleep(0.2)
        live = registry.live()
    deadline = time.monotonic() + cfg.peer.join_timeout
    while True:  # try every live peer, most advanced first, until one answers or join_timeout passes
        for entry in live:
            if entry["step"] <= 0:
                continue
            try:
                payload = endpoint.request(
                    entry["peer"], STATE_SERVICE, b"", cfg.peer.join_timeout, 16 * algo.slow.numel() + 4096
                )
                step, slow, velocity = decode_state(payload, algo.slow.numel(), cfg.outer.every)
            except (CommError, StateError) as exc:
                say(f"noloco peer: could not join from {entry['name']}: {exc}; connected: {endpoint.connected_peers()}")
                continue
            state = algo.state_dict()
            state.update(inner_step=step, slow=slow, rule={"velocity": velocity} if "velocity" in state["rule"] else {})
            algo.load_state_dict(state)
            copy_flat_into(algo.slow, algo.params)
            joined_from.update(peer=entry["name"], step=step, bytes=len(payload))
            say(f"noloco peer: joined from {entry['name']} at step {step} ({len(payload) / 1e6:.2f} MB state)")
            return step
        if not any(e["step"] > 0 for e in live) or time.monotonic() > deadline:
            return 0
        time.sleep(1.0)
        live = registry.live()


def _summary(cfg, name, endpoint, groups, result, corpus, seconds, joined_from) -> dict:
    rounds = groups.rounds
    joined = [r for r in rounds if r.outcome == "joined"]
    targets = torch.cat(
        [y for _, y in eval_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches)]
    )
    slow = result.slow_weights
    return {
        "backend": "hivemind",
        "algo": cfg.outer.algo,
        "codec": cfg.comm.codec,
        "peer": name,
        "peer_id": endpoint.peer_id,
        "rank": result.rank,
        "steps": cfg.steps,
        "final_eval_loss": result.final_eval_loss,
        "eval_history": result.eval_history,
        "unigram_eval_loss": corpus.unigram_loss(targets),
        "slow_weights_finite": bool(torch.isfinite(slow).all()),
        "slow_weights_norm": float(slow.norm()),
        "rounds": len(rounds),
        "rounds_joined": len(joined),
        "failed_rounds": len(rounds) - len(joined),
        "round_outcomes": [r.outcome for r in rounds],
        "partners": [r.partners for r in joined],
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "bytes_sent_per_round": [r.bytes_sent for r in joined],
        "matchmaking_seconds_per_round": [round(r.matchmaking_seconds, 3) for r in rounds],
        "exchange_seconds_per_round": [round(r.exchange_seconds, 3) for r in joined],
        "rejected_messages": endpoint.rejection_counts(),
        "joined_from": joined_from or None,
        "wall_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience for `python -m`
    from noloco.train.cli import main as cli_main

    return cli_main(["backend=hivemind", *(argv if argv is not None else sys.argv[1:])])
