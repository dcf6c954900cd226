"""Shared pieces of the decoder fuzz tests: mutations of valid payloads, example budgets, case counts.

Every fuzz test starts from a valid encoding and draws one mutation (hypothesis, derandomized so CI is
reproducible): bit flips, byte replacements, truncation at a structural boundary or anywhere, extension
(appended or inserted bytes), region deletion/duplication, and forgery of a header field with the
checksum or MAC recomputed so that the decoder's deeper validation is reached. Each executed case is
counted in :data:`COUNTS` (printed at the end of the session, and written as JSON to
``$NOLOCO_FUZZ_REPORT`` if set) so docs/reliability.md can cite what actually ran.

``NOLOCO_FUZZ_SCALE`` multiplies every budget (e.g. ``NOLOCO_FUZZ_SCALE=20`` for a long run).
"""

from __future__ import annotations

import os
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: Cases executed per fuzz target in this session (target name → count), and how many of them the decoder
#: accepted (the mutation left a valid payload, e.g. a flipped bit in an fp32 value): the rest were rejected.
COUNTS: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()


def record(target: str, accepted: bool) -> None:
    COUNTS[target] += 1
    if accepted:
        ACCEPTED[target] += 1


SCALE = float(os.environ.get("NOLOCO_FUZZ_SCALE", "1"))


def budget(examples: int) -> int:
    """``examples`` scaled by ``NOLOCO_FUZZ_SCALE`` (at least 1)."""
    return max(1, round(examples * SCALE))


def fuzz_settings(examples: int) -> settings:
    """Reproducible hypothesis settings: a fixed example count, no deadline, derandomized, no database."""
    return settings(
        max_examples=budget(examples),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# A forgeable field: (offset, size in bytes, byteorder). Values are drawn from boundary cases and at random.
Field = tuple[int, int, str]

OPS = ("flip", "replace", "overwrite", "truncate_boundary", "truncate_any", "append", "insert", "delete",
       "duplicate", "forge")  # fmt: skip


def _boundary_value(data: st.DataObject, size: int) -> int:
    top = (1 << (8 * size)) - 1
    edges = [v & top for v in (0, 1, 2, 3, 7, 255, 256, 65535, 65536, top - 1, top >> 1, 1 << (8 * size - 1))]
    return data.draw(st.one_of(st.sampled_from(sorted(set(edges)) + [top]), st.integers(0, top)))


def mutate(
    data: st.DataObject,
    payload: bytes,
    boundaries: Sequence[int] = (),
    fields: Sequence[Field] = (),
    reseal: Callable[[bytes], bytes] | None = None,
    ops: Sequence[str] = OPS,
) -> tuple[str, bytes]:
    """One mutation of ``payload`` drawn from ``data``: returns (operation, mutated bytes).

    ``boundaries``: offsets where the format changes section (cuts there and one byte either side are
    favoured). ``fields``: header fields to forge. ``reseal``: recomputes the integrity check (CRC or MAC)
    of a forged payload, so a forger's bytes reach the structural checks behind it.
    """
    b = bytearray(payload)
    op = data.draw(st.sampled_from([o for o in ops if o != "forge" or fields]))
    n = len(b)
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, n - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "replace":
        i = data.draw(st.integers(0, n - 1))
        b[i] = data.draw(st.integers(0, 255).filter(lambda v, old=b[i]: v != old))
    elif op == "overwrite":
        i = data.draw(st.integers(0, n - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=24))
        b[i : i + len(chunk)] = chunk
    elif op == "truncate_boundary":
        cuts = sorted({c + d for c in (0, *boundaries, n) for d in (-1, 0, 1) if 0 <= c + d < n})
        b = b[: data.draw(st.sampled_from(cuts))]
    elif op == "truncate_any":
        b = b[: data.draw(st.integers(0, n - 1))]
    elif op == "append":
        b += data.draw(st.binary(min_size=1, max_size=64))
    elif op == "insert":
        i = data.draw(st.integers(0, n))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=32))
    elif op == "delete":
        i = data.draw(st.integers(0, n - 1))
        del b[i : i + data.draw(st.integers(1, 32))]
    elif op == "duplicate":
        i = data.draw(st.integers(0, n - 1))
        j = data.draw(st.integers(i + 1, min(n, i + 64)))
        b[j:j] = b[i:j]
    else:  # forge one or two header fields, then recompute the integrity check
        for _ in range(data.draw(st.integers(1, 2))):
            offset, size, order = data.draw(st.sampled_from(list(fields)))
            if offset + size <= len(b):
                b[offset : offset + size] = _boundary_value(data, size).to_bytes(size, order)
        if reseal is not None:
            b = bytearray(reseal(bytes(b)))
    return op, bytes(b)


def plan_mutation(data: st.DataObject, fields: Sequence[Field] = (), boundaries: Sequence[int] = (),
                  reseal: Callable[[bytes], bytes] | None = None) -> tuple[str, Callable[[bytes], bytes]]:  # fmt: skip
    """Draw a mutation now and return it as a function, for payloads only known later (another thread).

    Positions are drawn as fractions of the payload's length; ``boundaries`` and ``fields`` are absolute
    offsets (e.g. of a fixed-size header), ``reseal`` recomputes an integrity check after a forgery.
    """
    op = data.draw(st.sampled_from([o for o in OPS if o != "forge" or fields]))
    where = data.draw(st.floats(0, 1, exclude_max=True))
    bit = data.draw(st.integers(0, 7))
    chunk = data.draw(st.binary(min_size=1, max_size=32))
    cut = data.draw(st.sampled_from(sorted({max(0, c + d) for c in boundaries for d in (-1, 0, 1)}) or [0]))
    forged = (data.draw(st.sampled_from(list(fields))), data.draw(st.integers(0, 1 << 64))) if fields else None

    def apply(payload: bytes) -> bytes:
        b = bytearray(payload)
        i = min(int(where * len(b)), max(len(b) - 1, 0))
        if not b:
            return bytes(chunk)
        if op == "flip":
            b[i] ^= 1 << bit
        elif op == "replace":
            b[i] = (b[i] + 1 + chunk[0] % 255) % 256
        elif op == "overwrite":
            b[i : i + len(chunk)] = chunk
        elif op == "truncate_boundary":
            b = b[: min(cut, len(b) - 1)]
        elif op == "truncate_any":
            b = b[:i]
        elif op == "append":
            b += chunk
        elif op == "insert":
            b[i:i] = chunk
        elif op == "delete":
            del b[i : i + len(chunk)]
        elif op == "duplicate":
            b[i:i] = b[i : i + len(chunk)]
        else:
            (offset, size, order), value = forged
            if offset + size <= len(b):
                b[offset : offset + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, order)
            if reseal is not None:
                b = bytearray(reseal(bytes(b)))
        return bytes(b)

    return op, apply


@contextmanager
def peak_python_allocation():
    """Measures the peak of Python-heap allocations inside the block (``result[0]``, bytes).

    Used to check that a decoder never allocates more than its bound from what a peer declares
    (bytearrays, zlib output, JSON); torch's own allocator is not traced (numel bounds cover it).
    Tracing is on only inside the block (tracing hypothesis itself would make the fuzz 5x slower).
    """
    result = [0]
    tracemalloc.start()
    try:
        yield result
    finally:
        result[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
