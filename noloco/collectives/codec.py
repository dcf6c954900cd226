"""Codecs: how one segment of a reduction is turned into bytes and back.

A codec is the only place a collective touches number formats. ``fp32`` sends raw little-endian
float32 and is exact. Quantized codecs (``int4``, ``int8``, ``mxfp4``, …) come from
:mod:`noloco.quant` and are added to this registry by the kernels layer.

``decode`` always receives the number of elements the receiver expects, and rejects a payload of
any other size before allocating anything from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class PayloadMismatch(ValueError):
    """A peer's payload does not have the size, format or values this member expects."""


class Codec(ABC):
    """Encodes a flat fp32 tensor segment to bytes and decodes it back."""

    name: str

    @abstractmethod
    def encode(self, segment: torch.Tensor) -> bytes:
        """``segment``: 1-D float tensor. Returns the wire bytes."""

    @abstractmethod
    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Return a 1-D float32 CPU tensor of ``numel`` elements; raise :class:`PayloadMismatch`."""


class Fp32Codec(Codec):
    """Uncompressed float32: 4 bytes per element, exact."""

    name = "fp32"

    def encode(self, segment: torch.Tensor) -> bytes:
        return segment.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        if len(payload) != 4 * numel:
            raise PayloadMismatch(f"fp32 payload has {len(payload)} bytes, expected {4 * numel}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(bytearray(payload), dtype=torch.float32)


_CODECS: dict[str, type[Codec]] = {"fp32": Fp32Codec}


def get_codec(name: str | Codec) -> Codec:
    """Return the codec called ``name`` (``fp32``, or a :mod:`noloco.quant` spec string)."""
    if isinstance(name, Codec):
        return name
    if name in _CODECS:
        return _CODECS[name]()
    raise ValueError(f"unknown codec {name!r}; known: {sorted(_CODECS)}")


def known_codecs() -> list[str]:
    return sorted(_CODECS)
