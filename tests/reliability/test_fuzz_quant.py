"""Fuzz of ``Packed.from_bytes`` (noloco.quant's wire format) for every spec a peer can send.

Property: a mutated or truncated payload either decodes to a valid tensor (at most ``max_numel``
elements, exactly the bytes it declares, finite values after ``dequantize``) or raises ``PayloadError``;
never another exception, and the decoder never allocates more than about the bytes it was given.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from noloco.quant import Packed, PayloadError, QuantSpec, dequantize, quantize

from .fuzzing import fuzz_settings, mutate, peak_python_allocation, record

SPECS = ["int4", "int8", "int4:g64", "int4:sym", "int4:naive", "mxfp4", "mxfp6", "mxfp8", "bf16", "fp16", "fp32",
         "int4+hadamard", "int8+hadamard", "mxfp4+hadamard", "bf16+hadamard", "int2", "int3", "sign:g16",
         "topk:8/64+int2", "topk:8/64+dct+sign", "topk:3/16+fp32"]  # fmt: skip
EXAMPLES_PER_SPEC = 270  # x 21 specs = 5,670 cases
MAX_NUMEL = 1 << 12


def _sample(spec: str) -> tuple[bytes, list[int], list[tuple[int, int, str]]]:
    """A valid payload of ``spec`` (2-D, odd sizes: tail groups, padding) with its boundaries and fields."""
    shape = (3, 43)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(spec)))
    x[1, 5] = 40.0  # an outlier
    payload = quantize(x, spec).to_bytes()
    parsed = QuantSpec.parse(spec)
    slen = len(str(parsed))
    dims = 8 + slen
    plen = dims + 8 * len(shape)
    head = plen + 8
    boundaries, fields = (
        [4, 5, 6, 7, 8, dims, plen, head, len(payload) - 4],
        [(5, 1, "little"), (6, 1, "little"), (7, 1, "little"), (plen, 8, "little")],
    )
    fields += [(dims + 8 * i, 8, "little") for i in range(len(shape))]
    offset = head
    for _, dtype, count in parsed.layout(x.numel()):
        size = count * torch.empty(0, dtype=dtype).element_size()
        fields.append((offset, min(size, 2), "little"))  # first element of every section (codes, scales, ...)
        offset += size
        boundaries.append(offset)
    return payload, boundaries, fields


SAMPLES = {spec: _sample(spec) for spec in SPECS}


def reseal(body_and_crc: bytes) -> bytes:
    body = body_and_crc[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def check_packed(data: bytes, target: str) -> None:
    with peak_python_allocation() as peak:
        try:
            packed = Packed.from_bytes(data, max_numel=MAX_NUMEL)
        except PayloadError:
            packed = None
    assert peak[0] <= 2 * len(data) + (64 << 10), f"decoder allocated {peak[0]} bytes for a {len(data)}-byte payload"
    record(target, packed is not None)
    if packed is not None:
        assert packed.numel <= MAX_NUMEL and packed.nbytes == len(data)
        try:  # a rotated payload whose inverse rotation would overflow is refused at decode
            value = dequantize(packed)
        except PayloadError:
            return
        assert value.shape == packed.shape and value.dtype == torch.float32
        assert bool(torch.isfinite(value).all())


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_of_the_fuzz_seed(spec):
    payload, _, _ = SAMPLES[spec]
    assert Packed.from_bytes(payload).to_bytes() == payload


@pytest.mark.parametrize("spec", SPECS)
def test_mutated_quantized_payloads_decode_to_valid_tensors_or_raise_payload_error(spec):
    payload, boundaries, fields = SAMPLES[spec]

    @fuzz_settings(EXAMPLES_PER_SPEC)
    @given(data=st.data())
    def run(data):
        _, mutated = mutate(data, payload, boundaries, fields, reseal)
        check_packed(mutated, f"quant Packed.from_bytes {spec}")

    run()
