"""The ``peer`` config section's one check: the swarm's limits against hostile peers and its deadlines.

Pure (no libp2p code): the config checks a run's ``peer`` section with it before any work starts, whatever the
backend, so that a bad value is one line, not a traceback from a peer already in its swarm (docs/swarm.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: peer.<key> -> the least integer it may be
INTEGER_LEAST = {
    "max_unauth_per_peer": 1, "max_unauth_streams": 1, "state_burst": 1, "state_concurrency": 1,
    "strikes_before_penalty": 1, "penalty_rounds": 0, "max_penalty_rounds": 1, "buckets": 1,
}  # fmt: skip
#: peer.<key> holding seconds, each > 0
SECONDS = ("header_timeout", "state_interval", "window", "confirm_timeout", "min_window", "min_confirm")
DEADLINES = ("adaptive", "fixed")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_peer_settings(peer: Mapping) -> None:
    """ValueError, naming the key, for the first value of ``peer`` (the config's ``peer`` section) out of range."""

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(message)

    for key, least in INTEGER_LEAST.items():
        value = peer[key]
        require(_integer(value) and value >= least, f"peer.{key} must be an integer >= {least}, got {value!r}")
    for key in SECONDS:
        require(_number(peer[key]) and peer[key] > 0, f"peer.{key} must be a number of seconds > 0, got {peer[key]!r}")
    require(peer["deadlines"] in DEADLINES, f"peer.deadlines must be adaptive or fixed, got {peer['deadlines']!r}")
    for key in ("push", "catch_up"):
        require(isinstance(peer[key], bool), f"peer.{key} must be true or false, got {peer[key]!r}")
    spread = peer["deadline_spread"]
    require(_number(spread) and spread >= 0, f"peer.deadline_spread must be a number >= 0, got {spread!r}")
    rounds = peer["deadline_rounds"]
    require(
        _integer(rounds) and 1 <= rounds <= 1000, f"peer.deadline_rounds must be an integer in 1..1000, got {rounds!r}"
    )
    worker = peer.get("worker")
    require(worker is None or (_integer(worker) and worker >= 0),
            f"peer.worker must be an integer >= 0 (or null: from the peer id), got {worker!r}")  # fmt: skip
