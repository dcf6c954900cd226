"""Transports: moving bytes between peers, with byte counters (DESIGN §2)."""

from noloco.comm.base import ByteCounter, CommError, CommTimeout, Transport
from noloco.comm.local import LocalFabric, LocalTransport

__all__ = ["ByteCounter", "CommError", "CommTimeout", "LocalFabric", "LocalTransport", "Transport"]
