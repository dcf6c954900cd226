"""Transports: moving bytes between peers, with byte counters (DESIGN §2)."""

from noloco.comm.base import ByteCounter, CommError, CommTimeout, Transport
from noloco.comm.local import LocalFabric, LocalTransport
from noloco.comm.swarm import SwarmEndpoint
from noloco.comm.torchdist import TorchDistTransport

__all__ = [
    "ByteCounter",
    "CommError",
    "CommTimeout",
    "LocalFabric",
    "LocalTransport",
    "SwarmEndpoint",
    "TorchDistTransport",
    "Transport",
]
