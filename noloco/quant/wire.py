"""Wire format of a :class:`~noloco.quant.base.Packed` tensor: versioned header, payload, checksum.

Layout (all integers little-endian; docs/quant.md has the same table)::

    offset      size    field
    0           4       magic  b"NLQT"
    4           1       version (1)
    5           1       original dtype: 0 fp32, 1 bf16, 2 fp16, 3 fp64
    6           1       ndim (0..8)
    7           1       S = length of the spec string (1..64)
    8           S       canonical spec string, ASCII (e.g. "int4", "int8:g64:sym", "mxfp4+hadamard")
    8+S         8*ndim  dims, u64 each
    8+S+8*ndim  8       payload length P, u64 (must equal what spec and shape imply)
    ...         P       payload sections in QuantSpec.layout order (codes, scales, zero_points | mins)
    end-4       4       CRC-32 (zlib) of every byte before it

Decoding is strict: it checks the magic, version and checksum, re-parses the spec (which must be in
canonical form), bounds ndim, every dim (< 2**48) and the element count (``max_numel``, default 2**36),
requires the declared and actual lengths to match the spec exactly *before* allocating anything, and
then validates values that could decode to non-finite numbers (scales, zero points, E8M0 = 255, E4M3
NaN codes, non-zero padding, non-finite float payloads). Any failure raises ``PayloadError``. The
checksum catches accidental corruption, not a forger; the structural checks bound what a forger can
make us allocate (at most the size of the bytes received, and never more than ``max_numel`` elements).
"""

from __future__ import annotations

import math
import struct
import sys
import zlib

import torch

from .base import FLOAT_DTYPES, Packed, PayloadError, QuantSpec
from .intq import max_scale_bits16, padding_bits_bad
from .mx import element_params
from .signq import BF16_INF_BITS
from .topk import indices_bad

MAGIC = b"NLQT"
VERSION = 1
MAX_NDIM = 8
MAX_DIM = 1 << 48
DEFAULT_MAX_NUMEL = 1 << 36
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("noloco.quant's wire format assumes a little-endian host")


def header_nbytes(p: Packed) -> int:
    """Bytes of header + checksum (everything but the payload) for ``p``."""
    return 8 + len(str(p.spec)) + 8 * len(p.shape) + 8 + 4


def _section_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def to_bytes(p: Packed) -> bytes:
    """Serialize ``p`` (tensors on any device) to bytes."""
    spec = str(p.spec).encode("ascii")
    if p.dtype not in DTYPE_CODES:
        raise ValueError(f"cannot serialize original dtype {p.dtype}")
    if len(p.shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dims on the wire, got {len(p.shape)}")
    payload = [_section_bytes(t) for t in p.sections()]
    plen = sum(len(b) for b in payload)
    expected = p.spec.payload_nbytes(p.numel)
    if plen != expected:
        raise ValueError(f"Packed sections hold {plen} bytes; {p.spec} x {p.numel} elements needs {expected}")
    header = struct.pack("<4sBBBB", MAGIC, VERSION, DTYPE_CODES[p.dtype], len(p.shape), len(spec)) + spec
    header += struct.pack(f"<{len(p.shape)}Q", *p.shape) + struct.pack("<Q", plen)
    body = b"".join([header, *payload])
    return body + struct.pack("<I", zlib.crc32(body))


def from_bytes(
    data: bytes | bytearray | memoryview, *, max_numel: int | None = None, device: torch.device | str = "cpu"
) -> Packed:
    """Parse and validate bytes made by :func:`to_bytes`. Raises :class:`PayloadError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")
    limit = DEFAULT_MAX_NUMEL if max_numel is None else int(max_numel)
    total = len(data)
    if total < 8 + 1 + 8 + 4:
        raise PayloadError(f"payload too short ({total} bytes)")
    magic, version, dtype_code, ndim, slen = struct.unpack_from("<4sBBBB", data, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r} (not a noloco.quant payload)")
    if version != VERSION:
        raise PayloadError(f"unsupported wire version {version} (this build reads {VERSION})")
    (crc,) = struct.unpack_from("<I", data, total - 4)
    if zlib.crc32(data[: total - 4]) != crc:
        raise PayloadError("checksum mismatch (corrupted or truncated payload)")
    if dtype_code not in CODE_DTYPES:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if not 1 <= slen <= 64:
        raise PayloadError(f"bad spec length {slen}")
    head = 8 + slen + 8 * ndim + 8
    if total < head + 4:
        raise PayloadError("payload truncated inside the header")
    try:
        spec_text = bytes(data[8 : 8 + slen]).decode("ascii")
        spec = QuantSpec.parse(spec_text)
    except (UnicodeDecodeError, ValueError) as err:
        raise PayloadError(f"bad spec in header: {err}") from None
    if str(spec) != spec_text:
        raise PayloadError(f"spec {spec_text!r} is not in canonical form ({str(spec)!r})")
    shape = struct.unpack_from(f"<{ndim}Q", data, 8 + slen)
    if any(d >= MAX_DIM for d in shape):
        raise PayloadError(f"dimension too large in shape {shape}")
    numel = math.prod(shape)
    if numel > limit:
        raise PayloadError(f"payload declares {numel} elements, more than the allowed {limit}")
    (plen,) = struct.unpack_from("<Q", data, 8 + slen + 8 * ndim)
    expected = spec.payload_nbytes(numel)
    if plen != expected:
        raise PayloadError(f"declared payload length {plen} != {expected} implied by {spec} x {numel}")
    if total != head + plen + 4:
        raise PayloadError(f"payload is {total} bytes, header implies {head + plen + 4}")

    sections: dict[str, torch.Tensor] = {}
    offset = head
    for name, dt, count in spec.layout(numel):
        size = count * torch.empty(0, dtype=dt).element_size()
        raw = (
            torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        sections[name] = raw.view(dt)
        offset += size
    validate_values(spec, numel, sections)
    packed = Packed(spec, tuple(int(d) for d in shape), CODE_DTYPES[dtype_code], **sections)
    return packed.to(device) if str(device) != "cpu" else packed


def validate_values(spec: QuantSpec, numel: int, s: dict[str, torch.Tensor],
                    extra: tuple[tuple[torch.Tensor, str], ...] = ()) -> None:  # fmt: skip
    """Reject values a genuine encoder never writes and that could decode to non-finite numbers.

    ``s`` maps section names (``codes``, ``scales``, ``zero_points`` / ``mins``) to the tensors of one
    payload of ``numel`` values in ``spec``, on any device; ``extra`` adds the caller's own checks as
    ``(bad, reason)`` pairs (0-d bool tensors on the same device). Every check is computed where the payload
    lives and read back in one host transfer (one wait on CUDA). Used by :func:`from_bytes` and by the
    collectives' message bodies. Raises :class:`PayloadError` with the reason of the first failing check.
    """
    checks = [*_value_checks(spec, numel, s), *extra]
    if not checks:
        return
    bad = torch.stack([flag.reshape(()) for flag, _ in checks]).tolist()
    for failed, (_, reason) in zip(bad, checks):
        if failed:
            raise PayloadError(reason)


def _value_checks(spec: QuantSpec, numel: int, s: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, str]]:
    """The checks of :func:`validate_values`: ``(bad, reason)`` with ``bad`` a 0-d bool tensor, not yet read."""
    n = spec.padded_numel(numel)
    codes = s["codes"]
    checks: list[tuple[torch.Tensor, str]] = []
    if spec.kind == "topk":
        k = spec.selected(numel)
        pad = padding_bits_bad(s["indices"], k, spec.bits)
        if pad is not None:
            checks.append((pad, "non-zero padding bits after the last top-k index"))
        bad = indices_bad(s["indices"], spec, numel)
        if bad is not None:
            checks.append((bad, "top-k indices out of their chunk's range, duplicated or not ascending"))
        return checks + _value_checks(spec.value, k, {key: t for key, t in s.items() if key != "indices"})
    if spec.kind == "sign":
        pad = padding_bits_bad(codes, n, 1)
        if pad is not None:
            checks.append((pad, "non-zero padding bits after the last sign bit"))
        if s["scales"].numel():
            bits = s["scales"].to(torch.int32)
            checks.append((((bits < 0) | (bits >= BF16_INF_BITS)).any(), "sign scale negative or not finite"))
        return checks
    if spec.kind == "float":
        vals = codes.view(FLOAT_DTYPES[spec.name])
        if vals.numel():
            checks.append((~torch.isfinite(vals).all(), "float payload holds NaN or Inf"))
        return checks
    if spec.bits == 4 and n % 2:
        checks.append(((codes[-1] >> 4) != 0, "non-zero padding nibble"))
    if spec.kind == "int" and spec.bits in (2, 3):
        pad = padding_bits_bad(codes, n, spec.bits)
        if pad is not None:
            checks.append((pad, "non-zero padding bits after the last code"))
    if spec.kind == "int":
        bits = s["scales"].to(torch.int32)
        # positive, >= 2**-126 (bf16 0x0080), and s * L finite (s <= fp32 max / L)
        max_bits = max_scale_bits16(spec.levels)
        if bits.numel():
            checks.append((((bits < 0x0080) | (bits > max_bits)).any(),
                           "scale out of range (non-positive, subnormal, too large, or non-finite)"))  # fmt: skip
        if "zero_points" in s and s["zero_points"].numel():
            checks.append((s["zero_points"].max() > spec.levels, "zero point exceeds the code range"))
        if "mins" in s and s["mins"].numel():
            mins = (s["mins"].to(torch.int32) << 16).view(torch.float32)
            top = mins.abs() + (bits << 16).view(torch.float32) * spec.levels
            checks.append((~torch.isfinite(top).all(), "naive minimum is not finite or its range overflows"))
        return checks
    p = element_params(spec.name)
    if s["scales"].numel():
        checks.append((s["scales"].max() > 254 - p["emax"], "E8M0 scale out of range (NaN code or overflowing)"))
    if spec.bits == 8 and codes.numel():
        checks.append((((codes & 0x7F) == 0x7F).any(), "E4M3 NaN code in payload"))
    if spec.bits == 6 and n % 4:
        tail = codes[-3:].to(torch.int32)
        word = tail[0] | tail[1] << 8 | tail[2] << 16
        checks.append(((word >> (6 * (n % 4))) != 0, "non-zero padding in the last 6-bit word"))
    return checks
