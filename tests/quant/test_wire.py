"""The wire format: round trips, and every malformed payload raises PayloadError (fuzzed)."""

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noloco.quant import Packed, PayloadError, dequantize, quantize

from .helpers import ALL_SPECS

_SAMPLES = {
    spec: quantize(torch.randn(n, generator=torch.Generator().manual_seed(n)), spec).to_bytes()
    for spec, n in zip(ALL_SPECS, [3, 129, 70, 33, 65, 17, 40, 31, 61, 37, 45, 5, 9, 2, 130, 1, 33, 7])
}


def _reseal(body: bytes) -> bytes:
    """Recompute the checksum: what a forger (not a noisy link) would do."""
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_round_trip_preserves_everything(spec):
    b = _SAMPLES[spec]
    p = Packed.from_bytes(b)
    assert str(p.spec) == spec and p.to_bytes() == b and p.nbytes == len(b)


def test_header_layout_is_as_documented():
    p = quantize(torch.randn(2, 3), "int4")
    b = p.to_bytes()
    assert b[:4] == b"NLQT" and b[4] == 1 and b[5] == 0 and b[6] == 2 and b[7] == 4
    assert b[8:12] == b"int4"
    assert struct.unpack_from("<2Q", b, 12) == (2, 3)
    assert struct.unpack_from("<Q", b, 28)[0] == 3 + 2 + 1  # 6 codes -> 3 bytes, 1 scale, 1 zero point
    assert len(b) == 36 + 6 + 4


def test_truncated_payloads_are_rejected():
    b = _SAMPLES["int8"]
    for cut in range(len(b)):
        with pytest.raises(PayloadError):
            Packed.from_bytes(b[:cut])


def test_every_single_bit_flip_is_rejected():
    b = bytearray(_SAMPLES["mxfp4"])
    for i in range(len(b)):
        for bit in range(8):
            c = bytearray(b)
            c[i] ^= 1 << bit
            with pytest.raises(PayloadError):
                Packed.from_bytes(bytes(c))


def test_forged_huge_shape_is_rejected_before_allocating():
    b = _SAMPLES["int4"]  # spec "int4", shape (3,)
    body = bytearray(b[:-4])
    struct.pack_into("<Q", body, 12, 1 << 40)
    with pytest.raises(PayloadError, match="more than|length"):
        Packed.from_bytes(_reseal(bytes(body)))
    with pytest.raises(PayloadError, match="more than"):
        Packed.from_bytes(_SAMPLES["int8"], max_numel=100)
    assert Packed.from_bytes(_SAMPLES["int8"], max_numel=129).numel == 129


@pytest.mark.parametrize(
    "offset,value,match",
    [
        (0, 0x58, "magic"),
        (4, 2, "version"),
        (5, 9, "dtype"),
        (6, 9, "ndim"),
        (7, 0, "spec length"),
    ],
)
def test_forged_header_fields_are_rejected(offset, value, match):
    body = bytearray(_SAMPLES["int8"][:-4])
    body[offset] = value
    with pytest.raises(PayloadError, match=match):
        Packed.from_bytes(_reseal(bytes(body)))


def _forge_section(section: str, index, value):
    def forge(p):
        getattr(p, section)[index] = value

    return forge


@pytest.mark.parametrize(
    "spec, numel, forge, reason",
    [
        ("int8", 64, _forge_section("scales", 0, 0x7F80), "scale"),  # bf16 +inf
        ("mxfp8", 64, _forge_section("scales", 1, 255), "E8M0"),
        ("mxfp8", 64, _forge_section("codes", 3, 0x7F), "NaN"),
        ("fp32", 8, _forge_section("codes", slice(0, 4), torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)), "NaN"),
        ("int4", 64, _forge_section("zero_points", 0, 200), "zero point"),
    ],
    ids=["int8-inf-scale", "mx-nan-scale", "e4m3-nan-code", "fp32-nan", "int4-zero-point"],
)
def test_forged_values_that_would_decode_to_non_finite_are_rejected(spec, numel, forge, reason):
    p = quantize(torch.randn(numel), spec)
    forge(p)
    with pytest.raises(PayloadError, match=reason):
        Packed.from_bytes(p.to_bytes())


def test_non_canonical_spec_is_rejected():
    b = quantize(torch.randn(4), "int4:g128").to_bytes()
    assert b[8:12] == b"int4"
    body = bytearray(b[:-4])
    body[8:12] = b"INT4"
    with pytest.raises(PayloadError, match="canonical"):
        Packed.from_bytes(_reseal(bytes(body)))


def test_non_bytes_input_is_rejected():
    with pytest.raises(PayloadError):
        Packed.from_bytes("int4")  # type: ignore[arg-type]


def _check_decodes_or_rejects(data: bytes) -> None:
    try:
        p = Packed.from_bytes(data, max_numel=1 << 16)
    except PayloadError:
        return
    try:  # a rotated payload whose inverse rotation would overflow is refused at decode
        y = dequantize(p)
    except PayloadError:
        return
    assert y.shape == p.shape and torch.isfinite(y).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(ALL_SPECS), data=st.data())
def test_fuzzed_payloads_decode_cleanly_or_raise_payload_error(spec, data):
    b = bytearray(_SAMPLES[spec])
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "forge"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif op == "insert":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    elif op == "overwrite":
        i = data.draw(st.integers(0, len(b) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=12))
        b[i : i + len(chunk)] = chunk
    else:  # forge: change header or payload bytes, then fix the checksum
        body = b[:-4]
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
        b = bytearray(_reseal(bytes(body)))
    _check_decodes_or_rejects(bytes(b))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(blob):
    _check_decodes_or_rejects(blob)
    _check_decodes_or_rejects(b"NLQT\x01" + blob)
