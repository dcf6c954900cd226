"""Reductions inside a group over any transport (docs/design.md §3.4, §3.5).

``allreduce`` (two-phase, ring, naive ring; fp32 and every :mod:`noloco.quant` codec; error feedback; an
optional norm bound on peers' contributions), the message protocol that makes disagreements and dead
peers fail fast, and a quantized DDP comm hook
(:mod:`noloco.collectives.ddp_hook`).
"""

from noloco.collectives.base import REDUCTIONS, SMALL_MESSAGE_NUMEL, allreduce, barrier
from noloco.collectives.codec import (
    Codec,
    Fp32Codec,
    PayloadMismatch,
    QuantCodec,
    get_codec,
    known_codecs,
)
from noloco.collectives.device import allreduce_device
from noloco.collectives.protocol import HEADER_BYTES, NORM_FLOOR_RMS, NormBound, NormRejections, RemoteFailure
from noloco.collectives.residuals import ReductionErrorFeedback
from noloco.collectives.ring import partial_sum_codec
from noloco.collectives.two_phase import segment_bounds

__all__ = [
    "HEADER_BYTES",
    "NORM_FLOOR_RMS",
    "REDUCTIONS",
    "SMALL_MESSAGE_NUMEL",
    "Codec",
    "Fp32Codec",
    "NormBound",
    "NormRejections",
    "PayloadMismatch",
    "QuantCodec",
    "ReductionErrorFeedback",
    "RemoteFailure",
    "allreduce",
    "barrier",
    "allreduce_device",
    "get_codec",
    "known_codecs",
    "partial_sum_codec",
    "segment_bounds",
]
