"""Reductions inside a group over any transport (DESIGN §3.4)."""

from noloco.collectives.base import ALGORITHMS, allreduce
from noloco.collectives.codec import Codec, Fp32Codec, PayloadMismatch, get_codec, known_codecs
from noloco.collectives.two_phase import segment_bounds

__all__ = [
    "ALGORITHMS",
    "Codec",
    "Fp32Codec",
    "PayloadMismatch",
    "allreduce",
    "get_codec",
    "known_codecs",
    "segment_bounds",
]
