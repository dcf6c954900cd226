"""The hivemind swarm: every piece of noloco that speaks libp2p or the DHT (docs/swarm.md).

- :mod:`~noloco.swarm.endpoint`: :class:`SwarmEndpoint`, noloco's authenticated frames over libp2p
  streams, and the group-local :class:`SwarmTransport`;
- :mod:`~noloco.swarm.dht`: starting a ``hivemind.DHT`` that never outlives its peer;
- :mod:`~noloco.swarm.matchmaking`: :class:`SwarmMatchmaking`, a :class:`~noloco.gossip.GroupSource`
  that forms groups among ready peers, and the :class:`PeerRegistry` of live peers;
- :mod:`~noloco.swarm.state`: the late-join state a live peer serves (tensors, not algorithms).

Nothing below this package imports it: ``import noloco.gossip`` loads no libp2p code.
"""

from noloco.swarm.dht import start_dht, start_peer_dht
from noloco.swarm.endpoint import RunKey, SwarmEndpoint, SwarmTransport, run_key_from
from noloco.swarm.matchmaking import PeerRegistry, SwarmMatchmaking
from noloco.swarm.state import STATE_SERVICE, StateError, StateServer, decode_state, encode_state

__all__ = [
    "STATE_SERVICE",
    "PeerRegistry",
    "RunKey",
    "StateError",
    "StateServer",
    "SwarmEndpoint",
    "SwarmMatchmaking",
    "SwarmTransport",
    "decode_state",
    "encode_state",
    "run_key_from",
    "start_dht",
    "start_peer_dht",
]
