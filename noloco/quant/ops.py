"""quantize / dequantize: the entry points, and the choice between the torch reference and Triton.

``backend=None`` ("auto") uses the fused Triton kernels for CUDA tensors when Triton is importable and
has a kernel for the format (int4/int8 in every mode, MXFP4, MXFP8), and the plain-torch reference
otherwise (CPU tensors, MXFP6, float casts). ``backend="torch"`` or ``"triton"`` forces one; forcing
Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported (that is how the tests
check kernel/reference agreement without a GPU). ``+hadamard`` rotation runs in torch around either.
"""

from __future__ import annotations

import math

import torch

from . import floatq, hadamard, intq, mx
from .base import Packed, QuantSpec

_SECTION_NAMES = ("codes", "scales", "zero_points", "mins")


def _triton():
    try:
        from . import triton_kernels
    except Exception:  # pragma: no cover - triton missing or broken
        return None
    return triton_kernels


def pick_backend(backend: str | None, device: torch.device, spec: QuantSpec) -> str:
    """Resolve ``backend`` ("torch", "triton", None/"auto") for a tensor on ``device``."""
    if backend in (None, "auto"):
        if device.type == "cuda" and spec.kind != "float":
            tk = _triton()
            if tk is not None and tk.supports(spec):
                return "triton"
        return "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        tk = _triton()
        if tk is None:
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not tk.supports(spec):
            raise ValueError(f"no Triton kernel for {spec}; use backend='torch'")
        return "triton"
    raise ValueError(f"backend must be 'torch', 'triton' or None, got {backend!r}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"quantize expects a float tensor (fp32/bf16/fp16/fp64), got {x.dtype}")


def quantize_flat(v: torch.Tensor, spec: QuantSpec, be: str, generator: torch.Generator | None = None
                  ) -> dict[str, torch.Tensor]:
    """Payload sections for flat ``v`` (already rotated if the spec says so)."""
    if be == "triton":
        if v.dtype == torch.float64:
            v = v.float()
        return _triton().quantize(v.contiguous(), spec, generator)[0]
    v = v.float()
    if spec.kind == "int":
        return intq.quantize_int(v, spec, generator)
    if spec.kind == "mx":
        return mx.quantize_mx(v, spec)
    return floatq.quantize_float(v, spec)


def quantize(x: torch.Tensor, spec: QuantSpec | str, *, generator: torch.Generator | None = None,
             backend: str | None = None) -> Packed:
    """Encode ``x`` (any float tensor, any shape, any numel, CPU or GPU) in format ``spec``.

    Args:
        x: fp32/bf16/fp16/fp64 tensor; not modified.
        spec: a :class:`QuantSpec` or its string (``"int4"``, ``"mxfp8+hadamard"``, ...).
        generator: seeds stochastic rounding (``:stochastic`` specs); ignored otherwise.
        backend: ``"torch"``, ``"triton"`` or None (auto: Triton for CUDA tensors).

    Returns:
        A :class:`Packed` on ``x``'s device remembering ``x.shape`` and ``x.dtype``.

    Raises:
        ValueError: ``x`` holds NaN or ±Inf (or values the format cannot represent).
    """
    spec = QuantSpec.parse(spec)
    _check_input(x)
    be = pick_backend(backend, x.device, spec)
    flat = x.detach().reshape(-1)
    if spec.hadamard:
        intq.check_finite(flat)
        flat = hadamard.rotate(flat.float(), spec)
    sections = quantize_flat(flat, spec, be, generator)
    return Packed(spec, tuple(x.shape), x.dtype, **sections)


def sections_of(p: Packed) -> dict[str, torch.Tensor]:
    return {k: getattr(p, k) for k in _SECTION_NAMES if getattr(p, k) is not None}


def dequantize_flat(p: Packed, be: str) -> torch.Tensor:
    """Flat fp32 decode of ``p``'s payload (still rotated; padded length if rotated)."""
    n = p.spec.padded_numel(p.numel)
    if be == "triton":
        out = torch.empty(n, dtype=torch.float32, device=p.device)
        return _triton().dequantize_accumulate(out, [p], accumulate=False)
    s = sections_of(p)
    if p.spec.kind == "int":
        return intq.dequantize_int(s, p.spec, n)
    if p.spec.kind == "mx":
        return mx.dequantize_mx(s, p.spec, n)
    return floatq.dequantize_float(s, p.spec, n)


def dequantize(p: Packed, *, backend: str | None = None) -> torch.Tensor:
    """Decode ``p`` to a float32 tensor of the original shape, on ``p``'s device (a new tensor)."""
    be = pick_backend(backend, p.device, p.spec)
    y = dequantize_flat(p, be)
    if p.spec.hadamard:
        y = hadamard.unrotate(y, p.spec, p.numel)
    return y.view(p.shape) if math.prod(p.shape) == y.numel() else y[: p.numel].view(p.shape)
