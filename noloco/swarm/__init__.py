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

Nothing below this package imports it: ``import noloco.gossip`` loads no libp2p code.
"""

from noloco.swarm.dht import RunRecordValidator, start_dht, start_peer_dht
from noloco.swarm.endpoint import RunKey, SwarmEndpoint, SwarmTransport, run_key_from
from noloco.swarm.identity import PeerIdentity
from noloco.swarm.matchmaking import (
    PeerRegistry,
    SwarmMatchmaking,
    announcement_ttl,
    implausible_rounds,
    implausible_steps,
    step_bound,
)
from noloco.swarm.state import STATE_SERVICE, StateError, StateServer, decode_state, encode_state

__all__ = [
    "STATE_SERVICE",
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
    "decode_state",
    "encode_state",
    "implausible_rounds",
    "implausible_steps",
    "run_key_from",
    "start_dht",
    "start_peer_dht",
    "step_bound",
]
