"""The hivemind swarm: every piece of noloco that speaks libp2p or the DHT (docs/swarm.md).

- :mod:`~noloco.swarm.endpoint`: :class:`SwarmEndpoint`, noloco's authenticated frames over libp2p
  streams, and the group-local :class:`SwarmTransport`;
- :mod:`~noloco.swarm.identity`: :class:`PeerIdentity`, a peer's Ed25519 key, which is its libp2p id and
  signs its DHT records;
- :mod:`~noloco.swarm.dht`: starting a ``hivemind.DHT`` that never outlives its peer, and the
  :class:`RunRecordValidator` that makes its records verifiable under the run key and as their owner's;
- :mod:`~noloco.swarm.matchmaking`: :class:`SwarmMatchmaking`, a :class:`~noloco.gossip.GroupSource`
  that forms groups among ready peers, and the :class:`PeerRegistry` of live peers;
- :mod:`~noloco.swarm.state`: the late-join state a live peer serves (tensors, not algorithms).

- :mod:`~noloco.swarm.settings`: the one check of the ``peer`` config section (no libp2p code).

Nothing below this package imports it: ``import noloco.gossip`` loads no libp2p code. The names below are
loaded on first use, so reading the settings (a local run's config check) loads no libp2p code either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name loads on first use
    from noloco.swarm.dht import PeerDHTStart, RunRecordValidator, start_dht, start_peer_dht
    from noloco.swarm.endpoint import RunKey, SwarmEndpoint, SwarmTransport, run_key_from
    from noloco.swarm.identity import PeerIdentity
    from noloco.swarm.matchmaking import (
        PeerRegistry,
        SwarmMatchmaking,
        announcement_ttl,
        implausible_rounds,
        implausible_steps,
        latest_incarnations,
        step_bound,
    )
    from noloco.swarm.settings import check_peer_settings
    from noloco.swarm.state import STATE_SERVICE, StateError, StateServer, decode_state, encode_state

#: public name -> the module of this package that defines it
_WHERE = {
    "PeerDHTStart": "dht", "RunRecordValidator": "dht", "start_dht": "dht", "start_peer_dht": "dht",
    "RunKey": "endpoint", "SwarmEndpoint": "endpoint", "SwarmTransport": "endpoint", "run_key_from": "endpoint",
    "PeerIdentity": "identity",
    "PeerRegistry": "matchmaking", "SwarmMatchmaking": "matchmaking", "announcement_ttl": "matchmaking",
    "implausible_rounds": "matchmaking", "implausible_steps": "matchmaking", "step_bound": "matchmaking",
    "latest_incarnations": "matchmaking",
    "STATE_SERVICE": "state", "StateError": "state", "StateServer": "state", "decode_state": "state",
    "encode_state": "state",
    "check_peer_settings": "settings",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "STATE_SERVICE",
    "PeerDHTStart",
    "PeerIdentity",
    "PeerRegistry",
    "RunKey",
    "RunRecordValidator",
    "StateError",
    "StateServer",
    "SwarmEndpoint",
    "SwarmMatchmaking",
    "SwarmTransport",
    "announcement_ttl",
    "check_peer_settings",
    "decode_state",
    "encode_state",
    "implausible_rounds",
    "implausible_steps",
    "latest_incarnations",
    "run_key_from",
    "start_dht",
    "start_peer_dht",
    "step_bound",
]
