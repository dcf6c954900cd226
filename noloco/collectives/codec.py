"""Codecs: how one segment of a reduction is turned into a message body and back.

A codec is the only place a collective touches number formats. ``fp32`` sends raw little-endian
float32 and is exact. Every :mod:`noloco.quant` spec string (``int4``, ``int8:g64``, ``mxfp4``,
``mxfp8+hadamard``, ``bf16``, ...) is a codec too: its message body is the payload sections of the
encoding, each 16-byte aligned (:mod:`noloco.collectives.message`), with no per-payload header or
checksum, since both members know the spec and the element count.

Encoding runs where the segment lives (the Triton kernels on CUDA) and writes the body into one host
buffer (:meth:`Codec.encode_message`), pinned on CUDA, after room the caller reserves for its message
header, so a message costs one device-to-host transfer and no host copy. ``decode`` always receives the
number of elements the receiver expects and rejects a payload of any other length, or holding values no
encoder writes, before anything of its claimed size is allocated (:class:`PayloadMismatch`, a
:class:`~noloco.quant.PayloadError` and so a ``ValueError``); on CUDA the body goes to the device in one
transfer and is validated and decoded there.
"""

from __future__ import annotations

import functools
import math
import re
from abc import ABC, abstractmethod

import torch

from noloco.collectives.message import (
    as_uint8,
    check_message,
    device_message,
    host_buffer,
    message_layout,
    message_view,
    pack_into,
    zero_gaps,
)
from noloco.quant import Packed, PayloadError, QuantSpec, coset, dequantize, quantize

#: Names listed by :func:`known_codecs`; any other spec :meth:`QuantSpec.parse` accepts works too.
BASE_CODECS = (
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "int3",
    "int2",
    "sign",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "topk:64/4096+int2",
    "coset3",
)

Buffer = bytes | bytearray | memoryview


class PayloadMismatch(PayloadError):
    """A peer's payload does not have the size, format or values this member expects."""


def _ready(device: torch.device) -> None:
    """Wait until this thread's stream on ``device`` has finished (a message's copy to the host, on CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Codec(ABC):
    """Encodes a flat fp32 tensor segment to a message body and decodes it back."""

    name: str
    #: decoded against the receiving member's own values (``decode(..., side=)``): the coset codes
    side_information: bool = False

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Bytes of the message body of ``numel`` values (a pure function of the codec and ``numel``)."""

    @abstractmethod
    def encode_message(self, segment: torch.Tensor, head: int = 0,
                       with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Encode the 1-D float ``segment`` (not modified) into a fresh uint8 host tensor.

        Returns ``(buffer, value)``: ``buffer[:head]`` is left for the caller (its message header),
        ``buffer[head:]`` is the body, complete when this returns; pinned when ``segment`` is on CUDA.
        ``value`` (with ``with_value``) is the fp32 segment a receiver decodes from the body, on
        ``segment``'s device (error feedback's residual is ``segment - value``); else None.

        Raises:
            ValueError: ``segment`` holds NaN/Inf and the codec cannot encode it.
        """

    def encode_device(self, segment: torch.Tensor,
                      with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Like :meth:`encode_message` with no head room, but the body stays on ``segment``'s (CUDA) device.

        For transports that hand GPU memory over (:class:`~noloco.comm.base.DeviceMessage`): the body is a
        fresh 1-D uint8 tensor nobody else writes, its alignment padding zero, in the same bytes as on a wire.
        """
        buffer, value = self.encode_message(segment, 0, with_value)
        return buffer.to(segment.device), value

    @abstractmethod
    def decode(self, payload: Buffer | torch.Tensor, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Return a 1-D float32 tensor of ``numel`` elements on ``device``; raise :class:`PayloadMismatch`.

        The length is checked first, then the body is copied to ``device`` (one transfer) and its values
        are validated and decoded there (the fused kernels on CUDA). The result owns its memory. A uint8
        tensor ``payload`` (a device message's body) is read where it lives.
        """

    def encode(self, segment: torch.Tensor) -> bytes:
        """The message body of ``segment`` as ``bytes`` (a convenience: the reductions use :meth:`encode_message`)."""
        buffer, _ = self.encode_message(segment)
        return bytes(buffer.numpy())

    def encode_with_value(self, segment: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """:meth:`encode` and the fp32 value a receiver will decode from those bytes."""
        buffer, value = self.encode_message(segment, with_value=True)
        return bytes(buffer.numpy()), value

    @property
    def exact(self) -> bool:
        """True when decode(encode(x)) == x for every finite fp32 x."""
        return False

    @property
    def checks_finite(self) -> bool:
        """True when :meth:`decode` can only return finite values (it refuses payloads that would decode to
        NaN/Inf), so a reduction need not scan the decoded values again."""
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

    def nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode_message(self, segment: torch.Tensor, head: int = 0,
                       with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        if head % 4:
            raise ValueError(f"fp32 message head room must be a multiple of 4 bytes, got {head}")
        value = segment.detach().to(dtype=torch.float32).contiguous().reshape(-1)
        buffer = host_buffer(head + 4 * value.numel(), value.device)
        buffer[head:].view(torch.float32).copy_(value, non_blocking=value.is_cuda)
        _ready(value.device)
        return buffer, (value if with_value else None)

    def encode_device(self, segment: torch.Tensor,
                      with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        value = segment.detach().to(dtype=torch.float32).reshape(-1)
        body = value.clone().view(torch.uint8)  # the sender may change ``segment`` once the call returns
        return body, (value if with_value else None)

    def decode(self, payload: Buffer | torch.Tensor, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        size = payload.numel() if isinstance(payload, torch.Tensor) else len(memoryview(payload).cast("B"))
        if size != 4 * numel:
            raise PayloadMismatch(f"fp32 payload has {size} bytes, expected {4 * numel}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=device)
        if isinstance(payload, torch.Tensor) and payload.is_cuda:
            return payload.view(torch.float32).to(device, copy=True)  # the result owns its memory
        values = as_uint8(payload).view(torch.float32)
        if torch.device(device).type == "cpu":
            return values.clone()  # may alias the sender's buffer: the caller owns the result
        out = values.to(device, non_blocking=True)
        _ready(out.device)  # the host buffer may be reused once the copy has landed
        return out

    @property
    def exact(self) -> bool:
        return True


class QuantCodec(Codec):
    """A :mod:`noloco.quant` format as a codec: ``quantize`` → the packed sections, 16-byte aligned, and back.

    Decoding checks that the body is exactly the length of ``numel`` values in this codec's spec (so a
    forged payload can never make the receiver allocate more than it expects) and that no section holds
    a value an encoder never writes (:func:`noloco.quant.wire.validate_values`: scales, zero points, MX
    NaN codes, padding, non-finite floats), on the device it decodes on.
    """

    def __init__(self, spec: QuantSpec | str):
        self.spec = QuantSpec.parse(spec)
        self.name = str(self.spec)

    def nbytes(self, numel: int) -> int:
        return message_layout(self.spec, numel)[1]

    def quantize(self, segment: torch.Tensor, generator: torch.Generator | None = None) -> Packed:
        """``segment`` (1-D float) → :class:`Packed`. NaN/Inf raise ``ValueError``: here on the CPU, from the
        payload's first use (:meth:`Packed.check`, e.g. :func:`message_of`) on CUDA, where the check is deferred."""
        return quantize(segment.detach().reshape(-1).float(), self.spec, generator=generator)

    def encode_message(self, segment: torch.Tensor, head: int = 0,
                       with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        packed = self.quantize(segment)
        value = dequantize(packed).reshape(-1) if with_value else None
        return message_of(packed, head), value

    def encode_device(self, segment: torch.Tensor,
                      with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        packed = self.quantize(segment)
        value = dequantize(packed).reshape(-1) if with_value else None
        return device_message(packed), value

    def unpack(
        self,
        payload: Buffer | torch.Tensor,
        numel: int,
        spec: QuantSpec | None = None,
        device: torch.device | str = "cpu",
    ) -> Packed:
        """Parse ``payload`` into a :class:`Packed` of ``numel`` elements in ``spec`` (default: ours) on ``device``."""
        spec = self.spec if spec is None else spec
        try:
            return check_message(payload, spec, numel, device)
        except PayloadError as err:
            raise PayloadMismatch(f"{spec} payload rejected: {err}") from err

    @property
    def checks_finite(self) -> bool:
        return True  # validate_values bounds every scale, zero point and minimum; float payloads are scanned

    def decode(self, payload: Buffer | torch.Tensor, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        packed = self.unpack(payload, numel, device=device)
        try:
            return dequantize(packed).reshape(-1)
        except PayloadError as err:  # e.g. a forged rotated payload whose inverse rotation overflows
            raise PayloadMismatch(f"{self.spec} payload rejected: {err}") from err


class CosetCodec(Codec):
    """The coset code (:mod:`noloco.quant.coset`): ``bits`` bits per value plus one grid exponent per 128, decoded
    against the receiver's own values (``decode(..., side=)``), so only for terms every member holds a close copy
    of (NoLoCo's slow-weight term φ − φ_0, ``comm.slow_codec=coset3``). Named ``coset<bits>`` or
    ``coset<bits>:m<margin>`` (the grid covers ``margin`` × the expected distance; default 1).

    A codec bound to a call's expected distances (:meth:`with_spread`, one per block; NaN: unknown) encodes on
    grids from them; unbound, on grids from its own values alone (twice their range). The reductions carry it by
    all-gather only (:func:`~noloco.collectives.allreduce`): a partial sum has no receiver-side copy.
    """

    side_information = True
    DEFAULT_MARGIN = 1.0  # measured on the CPU frontier: coset3 at margin 2 lost 6% more loss than at 1

    def __init__(self, bits: int, margin: float = DEFAULT_MARGIN, spread: torch.Tensor | None = None):
        if not coset.MIN_BITS <= bits <= coset.MAX_BITS:
            raise ValueError(f"coset codes have {coset.MIN_BITS}..{coset.MAX_BITS} bits, got {bits}")
        if not (math.isfinite(margin) and 0 < margin <= 64):
            raise ValueError(f"coset margin must be in (0, 64], got {margin!r}")
        self.bits, self.margin, self.spread = int(bits), float(margin), spread
        self.name = f"coset{self.bits}" + ("" if self.margin == self.DEFAULT_MARGIN else f":m{self.margin:g}")

    def exponents(self, segment: torch.Tensor) -> torch.Tensor:
        """The int8 grid exponent of each block of ``segment`` this codec encodes it with."""
        return coset.grid_exponents(segment.detach().reshape(-1).float(), self.spread, self.bits, self.margin)

    def with_spread(self, spread: torch.Tensor | None) -> CosetCodec:
        """This codec with grids for ``spread`` (one expected distance per block of 128 values; NaN: unknown)."""
        return CosetCodec(self.bits, self.margin, spread)

    def nbytes(self, numel: int) -> int:
        return coset.layout(numel, self.bits)[2]

    def _body(self, segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = segment.detach().reshape(-1).float()
        exponents = self.exponents(flat)
        codes, value = coset.encode(flat, exponents, self.bits)
        exps, _, nbytes = coset.layout(flat.numel(), self.bits)
        body = torch.zeros(nbytes, dtype=torch.uint8, device=flat.device)
        body[:exps] = exponents.view(torch.uint8)
        start = coset.codes_offset(flat.numel())
        body[start : start + codes.numel()] = codes
        return body, value

    def encode_message(self, segment: torch.Tensor, head: int = 0,
                       with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        body, value = self._body(segment)
        buffer = host_buffer(head + body.numel(), segment.device)
        buffer[head:].copy_(body)
        return buffer, value if with_value else None

    def encode_device(self, segment: torch.Tensor,
                      with_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        body, value = self._body(segment)
        return body, value if with_value else None

    @property
    def checks_finite(self) -> bool:
        return True  # decode refuses values beyond fp32

    def decode(self, payload: Buffer | torch.Tensor, numel: int, device: torch.device | str = "cpu",
               side: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if side is None or side.numel() != numel:
            raise ValueError(f"{self.name} decodes against the receiver's own {numel} values (side=)")
        exps, ncodes, nbytes = coset.layout(numel, self.bits)
        size = payload.numel() if isinstance(payload, torch.Tensor) else len(memoryview(payload).cast("B"))
        if size != nbytes:
            raise PayloadMismatch(f"{self.name} message of {size} bytes; {numel} values need {nbytes}")
        body = as_uint8(payload).to(side.device)
        start = coset.codes_offset(numel)
        if bool(body[exps:start].any()) or bool(body[start + ncodes :].any()):
            raise PayloadMismatch(f"{self.name} message of {numel} values has non-zero alignment padding")
        try:
            return coset.decode(body[:exps].view(torch.int8), body[start : start + ncodes], side, self.bits)
        except PayloadError as err:
            raise PayloadMismatch(f"{self.name} payload rejected: {err}") from err


_COSET = re.compile(r"coset(\d)(?::m([0-9]*\.?[0-9]+))?")


def message_of(packed: Packed, head: int = 0) -> torch.Tensor:
    """``packed``'s message body in a fresh host buffer after ``head`` free bytes (pinned for CUDA payloads).

    On CUDA the sections are copied in one transfer when the kernels laid them out as one message
    (:func:`~noloco.collectives.message.message_view`), else through one device staging buffer; the copy
    has landed when this returns. Raises ``ValueError`` if ``packed``'s deferred non-finite check fails.
    """
    nbytes = message_layout(packed.spec, packed.numel)[1]
    device = packed.codes.device
    buffer = host_buffer(head + nbytes, device)
    if device.type != "cuda":
        pack_into(buffer[head:], packed)
    else:
        view = message_view(packed)
        if view is None:
            view = torch.empty(nbytes, dtype=torch.uint8, device=device)
            pack_into(view, packed)
        buffer[head:].copy_(view, non_blocking=True)
        _ready(device)
    zero_gaps(buffer[head:], packed.spec, packed.numel)  # no stray bytes of earlier buffers on the wire
    return buffer


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
    match = _COSET.fullmatch(name.strip().lower())
    if match:
        return CosetCodec(int(match.group(1)), float(match.group(2) or CosetCodec.DEFAULT_MARGIN))
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
