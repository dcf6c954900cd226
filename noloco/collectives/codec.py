"""Codecs: how one segment of a reduction is turned into bytes and back.

A codec is the only place a collective touches number formats. ``fp32`` sends raw little-endian
float32 and is exact. Every :mod:`noloco.quant` spec string (``int4``, ``int8:g64``, ``mxfp4``,
``mxfp8+hadamard``, ``bf16``, ...) is a codec too: its wire bytes are ``Packed.to_bytes()`` (the
versioned, checksummed format of docs/quant.md) and decoding is bounded by the expected element count.

``decode`` always receives the number of elements the receiver expects, and rejects a payload of
any other size, spec or shape before allocating anything from it (:class:`PayloadMismatch`, a
:class:`~noloco.quant.PayloadError` and so a ``ValueError``).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch

from noloco.quant import Packed, PayloadError, QuantSpec, dequantize, quantize

#: Names listed by :func:`known_codecs`; any other spec :meth:`QuantSpec.parse` accepts works too.
BASE_CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "mxfp4", "mxfp6", "mxfp8")


class PayloadMismatch(PayloadError):
    """A peer's payload does not have the size, format or values this member expects."""


class Codec(ABC):
    """Encodes a flat fp32 tensor segment to bytes and decodes it back."""

    name: str

    @abstractmethod
    def encode(self, segment: torch.Tensor) -> bytes:
        """``segment``: 1-D float tensor. Returns the wire bytes."""

    @abstractmethod
    def decode(self, payload: bytes, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Return a 1-D float32 tensor of ``numel`` elements on ``device``; raise :class:`PayloadMismatch`.

        The payload is validated on the host before anything of its claimed size is allocated; only
        then are its codes copied to ``device`` and decoded there (the fused kernels on CUDA).
        """

    def encode_with_value(self, segment: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Wire bytes of ``segment`` and the fp32 value a receiver will decode from them.

        Used by error feedback (the residual is ``segment - value``). The default decodes the bytes.
        """
        payload = self.encode(segment)
        return payload, self.decode(payload, segment.numel(), segment.device)

    @property
    def exact(self) -> bool:
        """True when decode(encode(x)) == x for every finite fp32 x."""
        return False

    def __eq__(self, other: object) -> bool:  # equal wire formats: "int4" == "int4:g128"
        return isinstance(other, Codec) and type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Fp32Codec(Codec):
    """Uncompressed float32: 4 bytes per element, exact."""

    name = "fp32"

    def encode(self, segment: torch.Tensor) -> bytes:
        return segment.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()

    def decode(self, payload: bytes, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        if len(payload) != 4 * numel:
            raise PayloadMismatch(f"fp32 payload has {len(payload)} bytes, expected {4 * numel}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=device)
        return torch.frombuffer(bytearray(payload), dtype=torch.float32).to(device)

    def encode_with_value(self, segment: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        value = segment.detach().to(dtype=torch.float32).contiguous()
        return value.cpu().numpy().tobytes(), value

    @property
    def exact(self) -> bool:
        return True


class QuantCodec(Codec):
    """A :mod:`noloco.quant` format as a codec: ``quantize`` → ``Packed.to_bytes()`` and back.

    Decoding checks, besides everything ``Packed.from_bytes`` checks (magic, version, CRC-32,
    canonical spec, lengths, value ranges), that the payload carries this codec's spec and exactly
    ``numel`` elements as a 1-D tensor; ``max_numel`` is bounded by ``numel`` so a forged header can
    never make the receiver allocate more than it expects.
    """

    def __init__(self, spec: QuantSpec | str):
        self.spec = QuantSpec.parse(spec)
        self.name = str(self.spec)

    def quantize(self, segment: torch.Tensor, generator: torch.Generator | None = None) -> Packed:
        """``segment`` (1-D float) → :class:`Packed`. NaN/Inf raise ``ValueError``: here on the CPU, from the
        payload's first use (:meth:`Packed.check`, e.g. ``to_bytes``) on CUDA, where the check is deferred."""
        return quantize(segment.detach().reshape(-1).float(), self.spec, generator=generator)

    def encode(self, segment: torch.Tensor) -> bytes:
        return self.quantize(segment).to_bytes()

    def encode_with_value(self, segment: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        packed = self.quantize(segment)
        return packed.to_bytes(), dequantize(packed).reshape(-1)

    def unpack(self, payload: bytes, numel: int, spec: QuantSpec | None = None,
               device: torch.device | str = "cpu") -> Packed:
        """Parse ``payload`` into a :class:`Packed` of ``numel`` elements in ``spec`` (default: ours) on ``device``."""
        spec = self.spec if spec is None else spec
        try:
            packed = Packed.from_bytes(payload, max_numel=max(numel, 0), device=device)
        except PayloadError as err:
            raise PayloadMismatch(f"{spec} payload rejected: {err}") from err
        if packed.spec != spec:
            raise PayloadMismatch(f"payload is encoded as {packed.spec}, this member expects {spec}")
        if packed.shape != (numel,):
            raise PayloadMismatch(f"payload holds shape {packed.shape}, expected ({numel},)")
        return packed

    def decode(self, payload: bytes, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        packed = self.unpack(payload, numel, device=device)
        try:
            return dequantize(packed).reshape(-1)
        except PayloadError as err:  # e.g. a forged rotated payload whose inverse rotation overflows
            raise PayloadMismatch(f"{self.spec} payload rejected: {err}") from err


def get_codec(name: str | Codec) -> Codec:
    """Return the codec called ``name``: ``fp32`` or any :meth:`noloco.quant.QuantSpec.parse` string.

    Codecs are stateless and parsed once per name (cached); equal specs give equal codecs
    (``get_codec("int4") == get_codec("int4:g128")``).

    Raises:
        ValueError: ``name`` is not a known codec nor a parseable spec.
    """
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str):
        raise ValueError(f"codec must be a name or a Codec, got {type(name).__name__}")
    return _parse_codec(name)


@functools.lru_cache(maxsize=256)
def _parse_codec(name: str) -> Codec:
    if name.strip().lower() == "fp32":
        return Fp32Codec()
    try:
        spec = QuantSpec.parse(name)
    except ValueError as err:
        raise ValueError(f"unknown codec {name!r}; known: {known_codecs()} (and their :options): {err}") from None
    if spec.kind == "float" and spec.name == "fp32" and not spec.hadamard:
        return Fp32Codec()
    return QuantCodec(spec)


class CodecNames(list):
    """A sorted list of the base codec names whose ``in`` also accepts every parseable variant.

    ``"int4:g64" in known_codecs()`` is True (config validation uses ``in``); iterating lists the bases.
    """

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            get_codec(name)
        except ValueError:
            return False
        return True


def known_codecs() -> CodecNames:
    """The base codec names; membership (``in``) accepts every option variant as well."""
    return CodecNames(sorted(BASE_CODECS))
