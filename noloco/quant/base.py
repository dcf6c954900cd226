"""The interface of the quantization layer: what a format is (:class:`QuantSpec`), what an encoded
tensor is (:class:`Packed`) and how a malformed one fails (:class:`PayloadError`).

Formats (docs/design.md §3.3; MX formats from the OCP Microscaling Formats (MX) v1.0 specification):

- ``int2`` / ``int3`` / ``int4`` / ``int8``: group-wise (g = 128 by default) zero-aware asymmetric integer
  quantization.
  Options after ``:`` -- ``g64`` (group size, a power of two in 16..4096), ``sym`` (symmetric),
  ``naive`` (min/max asymmetric, zero not on the grid), ``stochastic`` (unbiased stochastic rounding).
- ``mxfp4`` (E2M1), ``mxfp6`` (E3M2), ``mxfp8`` (E4M3): blocks of 32 sharing one E8M0 scale. Option ``ceil``:
  the block scale is the smallest power of two that does not clip the block's largest value, instead of the OCP
  reference ``floor`` (default); decoding is the same (docs/quant.md has the error comparison).
- ``bf16``, ``fp16``, ``fp32``: plain casts (the uncompressed baselines).
- ``sign`` (option ``gN``): one bit per value (its sign) and one bf16 scale per group, the mean |x| of the
  group (the L2-optimal scale for a sign code); zero is sent as positive.
- ``topk:K/C+VALUE`` (or ``topk:K/C+dct+VALUE``): per chunk of C values (a power of two) keep the K largest
  magnitudes (ties: the lower index wins), optionally of the chunk's orthonormal DCT-II (DeMo, arXiv
  2411.19870), their in-chunk indices in ceil(log2 C) bits and their values in any other non-rotated spec VALUE.
- any of them + ``+hadamard`` (optionally ``+hadamard:b64:s7`` for block size and seed): a randomized
  block Hadamard rotation before quantizing, undone after decoding.

A spec's canonical string (``str(spec)``) round-trips through :meth:`QuantSpec.parse` and is what the
wire header carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PayloadError", "QuantSpec", "Packed", "MX_ELEMENTS", "FLOAT_DTYPES"]


class PayloadError(ValueError):
    """A byte string is not a well-formed :class:`Packed` payload (truncated, corrupted, forged,
    or larger than the caller allows). Nothing is allocated beyond the declared, bounded size."""


#: element formats of the MX family: name -> (exponent bits, mantissa bits)
MX_ELEMENTS: dict[str, tuple[int, int]] = {"mxfp4": (2, 1), "mxfp6": (3, 2), "mxfp8": (4, 3)}
#: plain cast formats: name -> torch dtype
FLOAT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_MODES = ("zero", "sym", "naive")
INT_NAMES = ("int2", "int3", "int4", "int8")
#: largest chunk of a top-k spec (indices fit 16 bits)
MAX_TOPK_CHUNK = 1 << 16


def _bits_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits packed as one little-endian bit stream."""
    return -(-count * bits // 8)


@dataclass(frozen=True)
class QuantSpec:
    """One encoding format. Build it with :meth:`parse`; ``str(spec)`` gives the canonical name.

    Attributes:
        kind: ``"int"``, ``"mx"``, ``"float"``, ``"sign"`` or ``"topk"``.
        name: the base name, e.g. ``"int4"``, ``"mxfp8"``, ``"bf16"``, ``"sign"``, ``"topk"``.
        bits: bits per element code (2/3/4/8 for int, 4/6/8 for MX, 16/32 for float, 1 for sign; top-k: bits per
            index, ceil(log2 C)).
        group: elements sharing one scale (int, sign: 128 by default; MX: 32; float: 0; top-k: the chunk C).
        mode: int only -- ``"zero"`` (zero-aware, default), ``"sym"`` or ``"naive"``.
        stochastic: int only -- unbiased stochastic rounding instead of round-half-to-even.
        hadamard: rotate blocks of ``hadamard_block`` elements with a randomized Hadamard transform.
        hadamard_block: rotation block size, a power of two (default 128).
        hadamard_seed: seed of the random signs; both ends must use the same one (it travels in the spec).
        mx_scale: MX only -- ``"floor"`` (OCP v1.0: ``X = floor(log2 amax) - emax``, may clip the block max to
            the element format's max) or ``"ceil"`` (``X = ceil(log2(amax / max))``, never clips).
        topk: top-k only -- values kept per chunk of ``group`` values.
        dct: top-k only -- select among the chunk's orthonormal DCT-II coefficients instead of its values.
        value: top-k only -- the spec of the kept values.
    """

    kind: str
    name: str
    bits: int
    group: int = 0
    mode: str = "zero"
    stochastic: bool = False
    hadamard: bool = False
    hadamard_block: int = 128
    hadamard_seed: int = 0
    mx_scale: str = "floor"
    topk: int = 0
    dct: bool = False
    value: QuantSpec | None = None
    _canonical: str = field(default="", compare=False, repr=False)

    @staticmethod
    def parse(text: str | QuantSpec) -> QuantSpec:
        """Parse a spec string such as ``"int4"``, ``"int8:g64:sym"``, ``"mxfp4+hadamard"``.

        Raises:
            ValueError: unknown name or option, or an out-of-range group/block size.
        """
        if isinstance(text, QuantSpec):
            return text
        if not isinstance(text, str) or not text or len(text) > 64:
            raise ValueError(f"a quantization spec is a non-empty string of at most 64 chars, got {text!r}")
        if text.strip().lower().startswith("topk"):
            return _parse_topk(text)
        base, plus, rot = text.strip().lower().partition("+")
        hadamard, hblock, hseed = False, 128, 0
        if plus:
            parts = rot.split(":")
            if parts[0] != "hadamard":
                raise ValueError(f"unknown spec suffix '+{parts[0]}' in {text!r} (only '+hadamard')")
            hadamard = True
            for opt in parts[1:]:
                if opt.startswith("b") and opt[1:].isdigit():
                    hblock = int(opt[1:])
                elif opt.startswith("s") and opt[1:].isdigit():
                    hseed = int(opt[1:])
                else:
                    raise ValueError(f"unknown hadamard option {opt!r} in {text!r} (use bN or sN)")
            if not (2 <= hblock <= 4096 and hblock & (hblock - 1) == 0):
                raise ValueError(f"hadamard block must be a power of two in 2..4096, got {hblock}")
            if hseed >= 2**31:
                raise ValueError(f"hadamard seed must be < 2**31, got {hseed}")
        name, *opts = base.split(":")
        if name in INT_NAMES:
            bits, group, mode, stochastic = int(name[3:]), 128, "zero", False
            for opt in opts:
                if opt.startswith("g") and opt[1:].isdigit():
                    group = int(opt[1:])
                elif opt in _MODES:
                    mode = opt
                elif opt == "stochastic":
                    stochastic = True
                elif opt == "nearest":
                    stochastic = False
                else:
                    raise ValueError(f"unknown int option {opt!r} in {text!r}")
            if not (16 <= group <= 4096 and group & (group - 1) == 0):
                raise ValueError(f"group size must be a power of two in 16..4096, got {group}")
            spec = QuantSpec("int", name, bits, group, mode, stochastic, hadamard, hblock, hseed)
        elif name in MX_ELEMENTS:
            mx_scale = "floor"
            for opt in opts:
                if opt not in ("floor", "ceil"):
                    raise ValueError(f"unknown MX option {opt!r} in {text!r} (only 'floor' or 'ceil')")
                mx_scale = opt
            e, m = MX_ELEMENTS[name]
            spec = QuantSpec("mx", name, 1 + e + m, 32, "zero", False, hadamard, hblock, hseed, mx_scale)
        elif name == "sign":
            group = 128
            for opt in opts:
                if not (opt.startswith("g") and opt[1:].isdigit()):
                    raise ValueError(f"unknown sign option {opt!r} in {text!r} (only gN)")
                group = int(opt[1:])
            if not (16 <= group <= 4096 and group & (group - 1) == 0):
                raise ValueError(f"group size must be a power of two in 16..4096, got {group}")
            spec = QuantSpec("sign", "sign", 1, group, "zero", False, hadamard, hblock, hseed)
        elif name in FLOAT_DTYPES:
            if opts:
                raise ValueError(f"float formats take no options, got {text!r}")
            bits = torch.finfo(FLOAT_DTYPES[name]).bits
            spec = QuantSpec("float", name, bits, 0, "zero", False, hadamard, hblock, hseed)
        else:
            raise ValueError(
                f"unknown quantization spec {text!r}; expected int2, int3, int4, int8, sign, mxfp4, mxfp6, mxfp8, "
                "bf16, fp16, fp32 (optionally with :options and +hadamard) or topk:K/C[+dct]+VALUE"
            )
        return spec

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk:{self.topk}/{self.group}" + ("+dct" if self.dct else "") + f"+{self.value}"
        s = self.name
        if self.kind == "sign" and self.group != 128:
            s += f":g{self.group}"
        if self.kind == "int":
            if self.group != 128:
                s += f":g{self.group}"
            if self.mode != "zero":
                s += f":{self.mode}"
            if self.stochastic:
                s += ":stochastic"
        elif self.kind == "mx" and self.mx_scale != "floor":
            s += f":{self.mx_scale}"
        if self.hadamard:
            s += "+hadamard"
            if self.hadamard_block != 128:
                s += f":b{self.hadamard_block}"
            if self.hadamard_seed:
                s += f":s{self.hadamard_seed}"
        return s

    @property
    def levels(self) -> int:
        """Largest integer code, 2**bits - 1 (int formats)."""
        return (1 << self.bits) - 1

    @property
    def sparse(self) -> bool:
        """True for top-k specs: a payload names the positions it carries."""
        return self.kind == "topk"

    def selected(self, numel: int) -> int:
        """Top-k: how many values a payload of ``numel`` carries (K per full chunk, min(K, tail) for the tail)."""
        full, tail = divmod(numel, self.group)
        return full * self.topk + min(self.topk, tail)

    def padded_numel(self, numel: int) -> int:
        """Number of elements actually encoded: ``numel`` rounded up to the Hadamard block if rotated."""
        if self.hadamard and numel:
            return -(-numel // self.hadamard_block) * self.hadamard_block
        return numel

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        """The payload sections for ``numel`` elements: ``[(name, dtype, count), ...]`` in wire order.

        Sections: ``codes`` (uint8, packed codes), ``scales`` (int, sign: bf16 bit patterns as int16;
        MX: E8M0 uint8), ``zero_points`` (int zero-aware: uint8) or ``mins`` (int naive: bf16 as int16).
        Top-k: ``indices`` (uint8, ceil(log2 C)-bit in-chunk indices packed) then the value spec's sections
        for :meth:`selected` values.
        """
        if self.kind == "topk":
            k = self.selected(numel)
            return [("indices", torch.uint8, _bits_bytes(k, self.bits)), *self.value.layout(k)]
        n = self.padded_numel(numel)
        if self.kind == "float":
            return [("codes", torch.uint8, n * self.bits // 8)]
        groups = -(-n // self.group)
        if self.kind == "sign":
            return [("codes", torch.uint8, _bits_bytes(n, 1)), ("scales", torch.int16, groups)]
        if self.kind == "mx":
            code_bytes = {4: -(-n // 2), 6: -(-n // 4) * 3, 8: n}[self.bits]
            return [("codes", torch.uint8, code_bytes), ("scales", torch.uint8, groups)]
        code_bytes = n if self.bits == 8 else _bits_bytes(n, self.bits)
        out = [("codes", torch.uint8, code_bytes), ("scales", torch.int16, groups)]
        if self.mode == "zero":
            out.append(("zero_points", torch.uint8, groups))
        elif self.mode == "naive":
            out.append(("mins", torch.int16, groups))
        return out

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of the payload sections (header and checksum excluded) for ``numel`` elements."""
        return sum(count * torch.empty(0, dtype=dt).element_size() for _, dt, count in self.layout(numel))

    def bits_per_element(self, numel: int = 1 << 20) -> float:
        """Payload bits per input element for a tensor of ``numel`` elements (no header)."""
        return 8.0 * self.payload_nbytes(numel) / max(numel, 1)


@dataclass
class Packed:
    """An encoded tensor: the spec, the original shape and dtype, and the payload sections.

    ``codes`` is always uint8 (packed as documented in docs/quant.md: int4/mxfp4 put element 2i in the
    low nibble and 2i+1 in the high nibble of byte i; mxfp6 packs 4 elements little-endian into 3 bytes).
    ``scales`` holds bf16 bit patterns (int16) for int formats, E8M0 bytes (uint8) for MX, and is
    ``None`` for float formats. ``zero_points`` (uint8) exists for zero-aware int, ``mins`` (bf16 bits
    as int16) for naive int. All tensors live on the device of the input.

    A payload made on CUDA by a checked quantizing call may carry a *pending* non-finite check (the kernel's
    verdict, not read yet so that the call needs no host sync; docs/quant.md, "Error handling"). :meth:`check`
    reads it and raises ``ValueError`` if the input held NaN/±Inf; :meth:`to_bytes`, :meth:`to`,
    :meth:`sections`, ``dequantize`` and the fused ops call it first. Reading the section attributes
    (``codes``, ``scales``, ...) does not: code that hands them to a collective itself calls :meth:`check` first.
    The pending check is private state: not compared, not shown, not serialized.
    """

    spec: QuantSpec
    shape: tuple[int, ...]
    dtype: torch.dtype
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    zero_points: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    _pending: Any = field(default=None, init=False, compare=False, repr=False)

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes this tensor takes on the wire, header and checksum included."""
        from .wire import header_nbytes

        return header_nbytes(self) + self.spec.payload_nbytes(self.numel)

    def check(self) -> None:
        """Raise if the input this payload was encoded from held NaN/±Inf; a no-op when nothing is pending.

        Only a payload made on CUDA by a checked call (``quantize``, ``ErrorFeedback.quantize``,
        ``dequantize_accumulate_requantize``) can have a check pending; elsewhere the call itself raised. Reading
        the verdict waits for the encoding kernel if it has not finished (usually it has). A clean verdict is
        dropped (later calls cost nothing); a bad one is kept, so every later use raises again.

        Raises:
            ValueError: the encoded input held NaN/±Inf (or a group range that overflows), with the message the
                call would have raised; the payload's bad groups are marked (bf16 NaN scale / E8M0 255) either way.
        """
        pending = self._pending
        if pending is not None:
            pending.raise_if_bad()
            self._pending = None

    def sections(self) -> list[torch.Tensor]:
        """Payload tensors in wire order (matching :meth:`QuantSpec.layout`), after :meth:`check`: what is sent."""
        self.check()
        return [getattr(self, name) for name, _, _ in self.spec.layout(self.numel)]

    def to(self, device: torch.device | str) -> Packed:
        """A copy with every payload tensor on ``device`` (after :meth:`check`)."""
        self.check()
        move = lambda t: None if t is None else t.to(device)
        return Packed(
            self.spec,
            self.shape,
            self.dtype,
            move(self.codes),
            move(self.scales),
            move(self.zero_points),
            move(self.mins),
            move(self.indices),
        )

    def to_bytes(self) -> bytes:
        """Serialize to the versioned wire format (docs/quant.md), after :meth:`check`.

        Raises:
            ValueError: a pending check finds non-finite input (:meth:`check`).
        """
        from .wire import to_bytes

        self.check()
        return to_bytes(self)

    @staticmethod
    def from_bytes(
        data: bytes | bytearray | memoryview, *, max_numel: int | None = None, device: torch.device | str = "cpu"
    ) -> Packed:
        """Parse and validate a payload made by :meth:`to_bytes`.

        Args:
            data: the bytes received.
            max_numel: reject payloads that declare more elements than this (default: 2**36).
            device: where to put the decoded tensors.

        Raises:
            PayloadError: truncated, corrupted (checksum), forged/inconsistent, or too large.
        """
        from .wire import from_bytes

        return from_bytes(data, max_numel=max_numel, device=device)


def _parse_topk(text: str) -> QuantSpec:
    """Parse ``topk:K/C[+dct]+VALUE`` (see :class:`QuantSpec`); one-line ``ValueError`` on a bad spelling."""
    head, *rest = text.strip().lower().split("+")
    dct = bool(rest) and rest[0] == "dct"
    value_text = "+".join(rest[1:] if dct else rest)
    name, _, size = head.partition(":")
    k_text, slash, c_text = size.partition("/")
    if name != "topk" or not slash or not k_text.isdigit() or not c_text.isdigit():
        raise ValueError(f"top-k spec {text!r} must read topk:K/C+VALUE (e.g. topk:64/4096+int2)")
    k, chunk = int(k_text), int(c_text)
    if not (2 <= chunk <= MAX_TOPK_CHUNK and chunk & (chunk - 1) == 0):
        raise ValueError(f"top-k chunk C must be a power of two in 2..{MAX_TOPK_CHUNK}, got {chunk} in {text!r}")
    if not 1 <= k <= chunk:
        raise ValueError(f"top-k K must be in 1..C={chunk}, got {k} in {text!r}")
    if not value_text:
        raise ValueError(f"top-k spec {text!r} names no value codec (e.g. topk:{k}/{chunk}+int2)")
    try:
        value = QuantSpec.parse(value_text)
    except ValueError as err:
        raise ValueError(f"bad value codec {value_text!r} in top-k spec {text!r}: {err}") from None
    if value.kind == "topk" or value.hadamard:
        raise ValueError(f"a top-k value codec cannot be top-k or rotated, got {value_text!r} in {text!r}")
    return QuantSpec("topk", "topk", max(1, (chunk - 1).bit_length()), chunk, topk=k, dct=dct, value=value)
