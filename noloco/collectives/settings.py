"""The codec and reduction keys of the ``comm`` config section, checked by the package that uses them.

``comm.codec`` and ``comm.slow_codec`` must parse (:func:`~noloco.collectives.codec.get_codec`), ``comm.reduction``
must be a known reduction, a coset code is for ``comm.slow_codec`` only, and a reduction that re-quantizes partial
sums hop by hop (``ring``, ``naive_ring``) cannot carry a sparse (top-k) payload. The timeouts and bounds of
``comm`` are the outer algorithm's to check.
"""

from __future__ import annotations

from collections.abc import Mapping

from noloco.collectives.base import REDUCTIONS
from noloco.collectives.codec import get_codec

#: reductions that sum partial results hop by hop, each hop re-encoding them: dense codecs only
HOP_BY_HOP = ("ring", "naive_ring")


def check_reduction_settings(comm: Mapping) -> None:
    """ValueError, naming the key, for a codec that does not parse or a reduction that cannot carry it."""
    reduction = comm["reduction"]
    for key in ("codec", "slow_codec"):
        value = comm[key]
        if value is None:  # slow_codec: null is the same as codec
            continue
        try:
            if not isinstance(value, str):
                raise ValueError(f"a codec is a name such as int4, got a {type(value).__name__}")
            codec = get_codec(value)
        except ValueError as err:
            raise ValueError(f"comm.{key}={value!r} is not a codec: {err}") from None
        if key == "codec" and codec.side_information:
            raise ValueError(f"comm.codec={value!r}: a coset code decodes against the receiver's own values, so it "
                             "carries only NoLoCo's slow-weight term (comm.slow_codec)")  # fmt: skip
        if reduction in HOP_BY_HOP and codec.name.startswith("topk"):
            raise ValueError(f"comm.reduction={reduction} cannot carry the top-k codec comm.{key}={value!r}; use "
                             "two_phase or allgather")  # fmt: skip
    if reduction not in REDUCTIONS:
        raise ValueError(f"comm.reduction={reduction!r} is not one of {REDUCTIONS}")
