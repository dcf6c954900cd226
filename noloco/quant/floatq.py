"""Plain float formats (bf16, fp16, fp32): the uncompressed baselines, encoded as a cast.

The payload is the cast tensor's bytes, little-endian. Non-finite input, or a finite value that
overflows the target (fp16 above 65504), raises ``ValueError``.
"""

from __future__ import annotations

import torch

from .base import FLOAT_DTYPES, QuantSpec
from .intq import check_finite


def quantize_float(v: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Cast flat ``v`` to the spec's dtype; returns ``codes`` = its bytes (uint8)."""
    check_finite(v)
    cast = v.to(FLOAT_DTYPES[spec.name]).contiguous()
    if spec.name == "fp16" and v.numel() and not bool(torch.isfinite(cast).all()):
        raise ValueError("cannot encode as fp16: a value exceeds fp16's range (|x| > 65504)")
    return {"codes": cast.view(torch.uint8).reshape(-1)}


def dequantize_float(sections: dict[str, torch.Tensor], spec: QuantSpec, n: int) -> torch.Tensor:
    """Decode the cast bytes back to a flat fp32 tensor of ``n`` elements."""
    return sections["codes"].view(FLOAT_DTYPES[spec.name]).float()[:n]
