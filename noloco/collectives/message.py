"""The body of one collective message: an encoded segment laid out as bytes, and back (docs/design.md §3.4).

Every reduction sends a segment of ``numel`` values in a codec's spec as its payload sections (``codes``,
``scales``, ``zero_points`` / ``mins``, :meth:`~noloco.quant.QuantSpec.layout` order) concatenated, each
starting at a multiple of :data:`ALIGN` bytes (the padding between them zero). There is no per-payload
header and no checksum: sizes are a pure function of ``(spec, numel)`` (:func:`message_layout`), which both
members know (the message header of :mod:`noloco.collectives.protocol` checks that they agree on codec and
numel), so a receiver checks the exact length and the zero padding before it looks at anything, and then
every value a genuine encoder never writes
(:func:`noloco.quant.wire.validate_values`). Integrity in transit is the transport's job: the swarm's frames
carry an HMAC-SHA256 of every byte, torch.distributed runs over TCP, the in-process fabric hands over memory.

The same layout serves :func:`~noloco.collectives.device.allreduce_device` (NCCL/gloo tensors) and the byte
transports: on CUDA a segment is encoded where it lives, its message copied to pinned host memory in one
transfer (:func:`host_buffer`), and a received message goes back to the device in one transfer before it is
validated and decoded there. Nothing else of the segment's size touches the host.
"""

from __future__ import annotations

import functools

import torch

from noloco.quant import Packed, PayloadError, QuantSpec
from noloco.quant.wire import validate_values

__all__ = [
    "ALIGN",
    "message_layout",
    "message_gaps",
    "zero_gaps",
    "pack_into",
    "unpack",
    "message_view",
    "device_message",
    "host_buffer",
    "as_uint8",
    "check_message",
]

#: every payload section starts at a multiple of this many bytes (Triton's pointer-divisibility unit)
ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@functools.lru_cache(maxsize=1024)
def message_layout(spec: QuantSpec, numel: int) -> tuple[tuple[tuple[str, torch.dtype, int, int], ...], int]:
    """Where the payload sections of ``numel`` values in ``spec`` sit in one message.

    Returns ``(sections, nbytes)``: ``sections`` is ``((name, dtype, count, byte offset), ...)`` in
    :meth:`QuantSpec.layout` order, each offset a multiple of :data:`ALIGN`; ``nbytes`` is the message
    size (a multiple of :data:`ALIGN`; 0 for 0 values). A pure function of ``(spec, numel)``, which is
    what lets a receiver preallocate and check every message without a header.
    """
    sections, offset = [], 0
    for name, dtype, count in spec.layout(numel):
        sections.append((name, dtype, count, offset))
        offset += _aligned(count * torch.empty(0, dtype=dtype).element_size())
    return tuple(sections), offset


@functools.lru_cache(maxsize=1024)
def message_gaps(spec: QuantSpec, numel: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` byte ranges of a message that are alignment padding (always zero on the wire)."""
    sections, nbytes = message_layout(spec, numel)
    gaps, ends = [], [offset + count * torch.empty(0, dtype=dtype).element_size()
                      for _, dtype, count, offset in sections]  # fmt: skip
    for end, nxt in zip(ends, [offset for _, _, _, offset in sections[1:]] + [nbytes]):
        if nxt > end:
            gaps.append((end, nxt))
    return tuple(gaps)


def zero_gaps(body: torch.Tensor, spec: QuantSpec, numel: int) -> None:
    """Zero the alignment padding of the message in ``body`` (a host uint8 tensor starting at the message)."""
    for start, end in message_gaps(spec, numel):
        body[start:end] = 0


def pack_into(buf: torch.Tensor, packed: Packed, non_blocking: bool = False) -> None:
    """Copy ``packed``'s sections into ``buf`` (uint8, at least the message size, any device) at their offsets.

    Raises:
        ValueError: ``packed``'s pending non-finite check fails (:meth:`~noloco.quant.Packed.check`).
    """
    packed.check()
    sections, nbytes = message_layout(packed.spec, packed.numel)
    if buf.dtype != torch.uint8 or buf.numel() < nbytes:
        raise ValueError(f"message buffer of {buf.numel()} {buf.dtype} is smaller than {nbytes} bytes")
    for name, dtype, count, offset in sections:
        section = getattr(packed, name)
        if section is None or section.dtype != dtype or section.numel() != count:
            raise ValueError(f"{packed.spec} section {name} is not {count} x {dtype}")
        size = count * section.element_size()
        buf[offset : offset + size].copy_(section.reshape(-1).view(torch.uint8), non_blocking=non_blocking)


def unpack(buf: torch.Tensor, spec: QuantSpec, numel: int) -> Packed:
    """The :class:`Packed` of ``numel`` values whose message starts at ``buf[0]``; sections are views."""
    sections = {}
    for name, dtype, count, offset in message_layout(spec, numel)[0]:
        size = count * torch.empty(0, dtype=dtype).element_size()
        sections[name] = buf[offset : offset + size].view(dtype) if size else buf.new_empty(0, dtype=dtype)
    return Packed(spec, (numel,), torch.float32, **sections)


def message_view(packed: Packed) -> torch.Tensor | None:
    """``packed``'s message as a uint8 view, without a copy, or None if its sections are not laid out as one.

    The Triton kernels allocate all sections of an encoding in one buffer, each padded to 16 bytes in layout
    order, which is exactly :func:`message_layout`; then the message can be sent as it is (saving a copy of
    the codes). The layout is checked here, pointer by pointer, so any other allocation (the torch reference,
    scales replaced by a new tensor) falls back to :func:`pack_into`. Like it, checks ``packed`` first
    (:meth:`~noloco.quant.Packed.check`: ``ValueError`` on a failed non-finite check), since the view is
    what gets sent.
    """
    packed.check()
    sections, nbytes = message_layout(packed.spec, packed.numel)
    codes = packed.codes
    if not nbytes or codes.dtype != torch.uint8:
        return None
    base = codes.storage_offset()
    storage = codes.untyped_storage()
    if storage.nbytes() < base + nbytes:
        return None
    for name, dtype, count, offset in sections:
        section = getattr(packed, name)
        if (
            section is None
            or section.dtype != dtype
            or section.numel() != count
            or not section.is_contiguous()
            or section.untyped_storage().data_ptr() != storage.data_ptr()
            or section.storage_offset() * section.element_size() != base + offset
        ):
            return None
    return codes.as_strided((nbytes,), (1,), base)


def device_message(packed: Packed) -> torch.Tensor:
    """``packed``'s message as a 1-D uint8 tensor where it lives, its alignment padding zero (for device messages).

    The kernels' own buffer when they laid the sections out as one message (:func:`message_view`), else one new
    buffer (:func:`pack_into`). Raises ``ValueError`` if ``packed``'s deferred non-finite check fails.
    """
    view = message_view(packed)
    if view is None:
        view = torch.empty(message_layout(packed.spec, packed.numel)[1], dtype=torch.uint8, device=packed.codes.device)
        pack_into(view, packed)
    for start, end in message_gaps(packed.spec, packed.numel):
        view[start:end].zero_()
    return view


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A fresh uint8 host tensor of ``nbytes`` for a message from/to ``device``: pinned when that is CUDA.

    Pinned blocks come from torch's caching host allocator, so the buffers of successive rounds reuse the
    same memory; a copy from the GPU into one runs at full PCIe speed and needs no staging.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")


def as_uint8(payload: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """``payload`` as a 1-D uint8 CPU tensor: a view when it is writable and 16-byte aligned, else a copy.

    A view aliases the sender's message buffer (the in-process fabric hands buffers over): callers only read it.
    """
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1).view(torch.uint8)
    view = memoryview(payload).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    out = torch.frombuffer(view, dtype=torch.uint8)
    return out if out.data_ptr() % ALIGN == 0 else out.clone()


def check_message(payload: bytes | bytearray | memoryview | torch.Tensor, spec: QuantSpec, numel: int,
                  device: torch.device | str = "cpu") -> Packed:  # fmt: skip
    """Parse and validate a received message of ``numel`` values in ``spec``; its sections on ``device``.

    The length must be exactly :func:`message_layout`'s and the alignment padding zero before anything is
    copied; on CUDA the message goes to the device in one (non-blocking, from pinned memory) copy and is
    validated there. A CUDA uint8 tensor ``payload`` (a device message's body) is checked where it lives, its
    padding and values in one host read.

    Raises:
        PayloadError: wrong length, or values no encoder writes (:func:`~noloco.quant.wire.validate_values`).
    """
    _, nbytes = message_layout(spec, numel)
    if isinstance(payload, torch.Tensor) and payload.is_cuda:
        return _check_device_message(payload, spec, numel, nbytes, torch.device(device))
    if len(memoryview(payload).cast("B")) != nbytes:
        raise PayloadError(f"{spec} message of {len(memoryview(payload).cast('B'))} bytes; {numel} values need "
                           f"{nbytes}")  # fmt: skip
    host = as_uint8(payload)
    if any(bool(host[start:end].any()) for start, end in message_gaps(spec, numel)):
        raise PayloadError(f"{spec} message of {numel} values has non-zero alignment padding")
    raw = host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)
    packed = unpack(raw, spec, numel)
    try:
        validate_values(spec, numel, {name: getattr(packed, name) for name, _, _, _ in message_layout(spec, numel)[0]})
    finally:
        if raw is not host:  # the copy must have landed before the host buffer may be reused
            torch.cuda.current_stream(raw.device).synchronize()
    return packed


def _check_device_message(body: torch.Tensor, spec: QuantSpec, numel: int, nbytes: int,
                          device: torch.device) -> Packed:  # fmt: skip
    """:func:`check_message` of a message body in GPU memory: length, then padding and values in one host read."""
    body = body.reshape(-1)
    if body.dtype != torch.uint8 or body.numel() != nbytes:
        raise PayloadError(f"{spec} message of {body.numel()} {body.dtype} elements; {numel} values need "
                           f"{nbytes} bytes")  # fmt: skip
    if body.device != device:
        body = body.to(device)
    gaps = [body[start:end] for start, end in message_gaps(spec, numel)]
    reason = f"{spec} message of {numel} values has non-zero alignment padding"
    extra = ((torch.cat(gaps).any(), reason),) if gaps else ()
    packed = unpack(body, spec, numel)
    validate_values(spec, numel, {name: getattr(packed, name) for name, _, _, _ in message_layout(spec, numel)[0]},
                    extra)  # fmt: skip
    return packed
