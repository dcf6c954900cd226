"""Transports: moving bytes between peers, with byte counters (docs/design.md §2).

The in-process fabric (:class:`LocalFabric`) and torch.distributed (:class:`TorchDistTransport`) live
here; the hivemind swarm's transport is in :mod:`noloco.swarm` (it needs libp2p, so it is imported only
where a swarm runs).
"""

from noloco.comm.base import ByteCounter, CommAborted, CommError, CommTimeout, DeviceMessage, Transport
from noloco.comm.local import LocalFabric, LocalTransport
from noloco.comm.torchdist import TorchDistTransport

__all__ = [
    "ByteCounter",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "DeviceMessage",
    "LocalFabric",
    "LocalTransport",
    "TorchDistTransport",
    "Transport",
]
