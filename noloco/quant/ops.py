"""quantize / dequantize: the entry points, and the choice between the torch reference and Triton.

``backend=None`` ("auto") uses the fused Triton kernels for CUDA tensors when Triton is importable and
has a kernel for the format (int4/int8 in every mode, MXFP4, MXFP8), and the plain-torch reference
otherwise (CPU tensors, MXFP6, float casts). ``backend="torch"`` or ``"triton"`` forces one; forcing
Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported (that is how the tests
check kernel/reference agreement without a GPU). ``+hadamard`` rotation runs in torch around either.

The Triton path is the hot path of every exchange, so its host work per call is kept minimal: spec strings are
parsed once (:func:`parse_spec`), a contiguous input is passed to the kernel without copies, and the kernel
module caches launch plans (docs/quant.md, "Host path"). On CUDA a checked ``quantize`` does not wait for its
NaN/Inf verdict: the payload carries it and raises when first used (:meth:`Packed.check`, docs/quant.md "Error
handling"). ``check_finite=False`` lets trusted callers skip the check altogether.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch

from . import floatq, hadamard, intq, mx, signq, topk
from .base import Packed, PayloadError, QuantSpec

_SECTION_NAMES = ("codes", "scales", "zero_points", "mins", "indices")


@functools.cache
def _kernels(module: str):
    """The kernel module ``noloco.quant.<module>``, or None if Triton is missing or broken (imported once)."""
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except Exception:  # pragma: no cover - triton missing or broken
        return None


def _triton():
    """The ``triton_kernels`` module (int4/int8, MX), or None if Triton is missing or broken."""
    return _kernels("triton_kernels")


def _lowbit():
    """The ``lowbit_kernels`` module (int2, int3, sign), or None if Triton is missing or broken."""
    return _kernels("lowbit_kernels")


def fused_kernels(spec: QuantSpec) -> bool:
    """Whether the fused kernels of ``triton_kernels`` serve ``spec`` (int4/int8, MXFP4/8): the formats of the
    fused ops and of the deferred non-finite check. int2/int3/sign have their own kernels (``lowbit_kernels``)."""
    tk = _triton()
    return tk is not None and tk.supports(spec)


def _has_kernel(spec: QuantSpec) -> bool:
    if spec.kind == "topk":
        return _has_kernel(spec.value)
    if fused_kernels(spec):
        return True
    lb = _lowbit()
    return lb is not None and lb.supports(spec)


@functools.lru_cache(maxsize=1024)
def _parse_text(text: str) -> QuantSpec:
    return QuantSpec.parse(text)


def parse_spec(spec: QuantSpec | str) -> QuantSpec:
    """:meth:`QuantSpec.parse`, cached for strings (a call site passing ``"int4"`` parses it once per process)."""
    if isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        return _parse_text(spec)
    return QuantSpec.parse(spec)  # raises the ValueError for a non-string


def pick_backend(backend: str | None, device: torch.device, spec: QuantSpec) -> str:
    """Resolve ``backend`` ("torch", "triton", None/"auto") for a tensor on ``device``."""
    if backend is None or backend == "auto":
        if device.type == "cuda" and spec.kind != "float" and _has_kernel(spec):
            return "triton"
        return "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if _triton() is None:
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not _has_kernel(spec):
            raise ValueError(f"no Triton kernel for {spec}; use backend='torch'")
        return "triton"
    raise ValueError(f"backend must be 'torch', 'triton' or None, got {backend!r}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"quantize expects a float tensor (fp32/bf16/fp16/fp64), got {x.dtype}")


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """Flat, contiguous fp32/bf16/fp16 view of ``x`` for the kernels: no copy when ``x`` is already contiguous
    (fp64 is converted, a non-contiguous tensor copied once)."""
    if x.requires_grad:
        x = x.detach()
    v = x if x.dim() == 1 else x.reshape(-1)
    if v.dtype == torch.float64:
        return v.float()
    return v if v.is_contiguous() else v.contiguous()


def quantize_flat(
    v: torch.Tensor, spec: QuantSpec, be: str, generator: torch.Generator | None = None, check_finite: bool = True
) -> dict[str, torch.Tensor]:
    """Payload sections for flat ``v`` (already rotated if the spec says so). Non-finite input raises here, on
    every backend (the rotated and unfused paths that use this read their verdict at once). Top-k: the selection
    runs in torch (``torch.sort`` on the tensor's device), the kept values go through ``be``'s kernels."""
    if spec.kind == "topk":
        indices, values = topk.select(v, spec)
        return {"indices": indices, **quantize_flat(values, spec.value, be, generator, check_finite)}
    if be == "triton":
        if fused_kernels(spec):
            return _triton().quantize(_kernel_input(v), spec, generator, check=check_finite)[0]
        return _lowbit().quantize(_kernel_input(v), spec)
    v = v.float()
    if spec.kind == "int":
        return intq.quantize_int(v, spec, generator)
    if spec.kind == "mx":
        return mx.quantize_mx(v, spec)
    if spec.kind == "sign":
        return signq.quantize_sign(v, spec)
    return floatq.quantize_float(v, spec)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    generator: torch.Generator | None = None,
    backend: str | None = None,
    check_finite: bool = True,
) -> Packed:
    """Encode ``x`` (any float tensor, any shape, any numel, CPU or GPU) in format ``spec``.

    Args:
        x: fp32/bf16/fp16/fp64 tensor; not modified.
        spec: a :class:`QuantSpec` or its string (``"int4"``, ``"mxfp8+hadamard"``, ...).
        generator: seeds stochastic rounding (``:stochastic`` specs); ignored otherwise.
        backend: ``"torch"``, ``"triton"`` or None (auto: Triton for CUDA tensors).
        check_finite: True (default): NaN/Inf input is refused with ``ValueError``. On the CPU (and for rotated
            specs) this call raises. On CUDA's fused kernels the call does not wait for the verdict (no host sync):
            the returned payload carries it and raises the same error when first used -- :meth:`Packed.check`,
            ``to_bytes``, ``to``, ``sections``, ``dequantize``, the fused ops. False, for trusted callers: no check;
            a group holding NaN/Inf is still marked in the payload (bf16 NaN scale, E8M0 255), so decoding it gives
            NaN locally and ``Packed.from_bytes`` rejects it. The torch reference always checks.

    Returns:
        A :class:`Packed` on ``x``'s device remembering ``x.shape`` and ``x.dtype``.

    Raises:
        ValueError: ``x`` holds NaN or ±Inf (or values the format cannot represent); on CUDA's fused path raised by
            the payload's first use instead (see ``check_finite``).
    """
    spec = parse_spec(spec)
    _check_input(x)
    be = pick_backend(backend, x.device, spec)
    if be == "triton" and not spec.hadamard and fused_kernels(spec):  # the hot path: one kernel, no copies
        sections, _, pending = _triton().quantize(_kernel_input(x), spec, generator, check=check_finite, defer=True)
        packed = Packed(spec, tuple(x.shape), x.dtype, **sections)
        packed._pending = pending
        return packed
    flat = x.detach().reshape(-1)
    if spec.hadamard:
        intq.check_finite(flat)
        flat = hadamard.rotate(flat.float(), spec)
    sections = quantize_flat(flat, spec, be, generator, check_finite)
    return Packed(spec, tuple(x.shape), x.dtype, **sections)


def sections_of(p: Packed) -> dict[str, torch.Tensor]:
    return {k: getattr(p, k) for k in _SECTION_NAMES if getattr(p, k) is not None}


def dequantize_flat(p: Packed, be: str) -> torch.Tensor:
    """Flat fp32 decode of ``p``'s payload (still rotated; padded length if rotated), after ``p.check()``."""
    p.check()
    return _decode_sections(sections_of(p), p.spec, p.spec.padded_numel(p.numel), be, p.device)


def _decode_sections(
    s: dict[str, torch.Tensor], spec: QuantSpec, n: int, be: str, device: torch.device
) -> torch.Tensor:
    """Flat fp32 decode of the sections ``s`` of ``n`` values in ``spec`` (still rotated)."""
    if spec.kind == "topk":
        k = spec.selected(n)
        values = _decode_sections({key: t for key, t in s.items() if key != "indices"}, spec.value, k, be, device)
        try:
            return topk.scatter(values, s["indices"], spec, n)
        except ValueError as err:
            raise PayloadError(str(err)) from None
    if be == "triton":
        if fused_kernels(spec):
            out = torch.empty(n, dtype=torch.float32, device=device)
            return _triton().dequantize_accumulate(out, [Packed(spec, (n,), torch.float32, **s)], accumulate=False)
        return _lowbit().dequantize(s, spec, n)
    if spec.kind == "int":
        return intq.dequantize_int(s, spec, n)
    if spec.kind == "mx":
        return mx.dequantize_mx(s, spec, n)
    if spec.kind == "sign":
        return signq.dequantize_sign(s, spec, n)
    return floatq.dequantize_float(s, spec, n)


def dequantize(p: Packed, *, backend: str | None = None) -> torch.Tensor:
    """Decode ``p`` to a float32 tensor of the original shape, on ``p``'s device (a new tensor).

    Raises:
        ValueError: ``p`` carries a pending non-finite check that fails (:meth:`Packed.check`).
    """
    p.check()
    device = p.codes.device
    be = pick_backend(backend, device, p.spec)
    if be == "triton" and not p.spec.hadamard and fused_kernels(p.spec):  # the hot path: decode into the output
        out = torch.empty(p.shape, dtype=torch.float32, device=device)
        _triton().dequantize_accumulate(out.view(-1), [p], accumulate=False)
        return out
    y = dequantize_flat(p, be)
    if p.spec.hadamard:
        y = hadamard.unrotate(y, p.spec, p.numel)
    return y.view(p.shape) if math.prod(p.shape) == y.numel() else y[: p.numel].view(p.shape)
