"""noloco.quant: the formats and kernels every byte crossing a link goes through (docs/design.md §3.3, §4).

Public API::

    from noloco.quant import QuantSpec, Packed, quantize, dequantize, PayloadError, ErrorFeedback
    from noloco.quant import dequantize_accumulate, dequantize_accumulate_requantize

    spec = QuantSpec.parse("int4")        # int8, int4:g64, int4:sym, int4:naive, int4:stochastic,
                                          # mxfp4, mxfp6, mxfp8, bf16, fp16, fp32, any + "+hadamard"
    p = quantize(x, spec)                 # any float tensor, CPU (torch) or CUDA (Triton)
    y = dequantize(p)                     # float32, x's shape and device
    b = p.to_bytes(); q = Packed.from_bytes(b)   # PayloadError on anything malformed
    p.nbytes                              # bytes on the wire, header included

Formats, wire layout and error handling: docs/quant.md.
"""

from .base import Packed, PayloadError, QuantSpec
from .feedback import ErrorFeedback
from .fused import dequantize_accumulate, dequantize_accumulate_requantize
from .ops import dequantize, quantize

__all__ = [
    "QuantSpec",
    "Packed",
    "PayloadError",
    "quantize",
    "dequantize",
    "ErrorFeedback",
    "dequantize_accumulate",
    "dequantize_accumulate_requantize",
]
