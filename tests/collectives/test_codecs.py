import pytest
import torch

from noloco.collectives import (
    HEADER_BYTES,
    SMALL_MESSAGE_NUMEL,
    Fp32Codec,
    PayloadMismatch,
    QuantCodec,
    allreduce,
    get_codec,
    known_codecs,
)
from noloco.collectives.message import message_gaps
from noloco.comm import LocalFabric
from noloco.quant import PayloadError, QuantSpec

from .helpers import gaussian_inputs


def test_known_codecs_lists_the_bases_and_accepts_variants():
    names = known_codecs()
    for base in ("fp32", "bf16", "fp16", "int8", "int4", "mxfp4", "mxfp6", "mxfp8"):
        assert base in names and base in list(names)
    assert "int4:g64" in names and "mxfp8+hadamard" in names and "int8:sym:stochastic" in names
    assert "int5" not in names and "nonsense" not in names and 4 not in names


@pytest.mark.parametrize(
    "name", ["bf16", "fp16", "int8", "int4", "mxfp4", "mxfp6", "mxfp8", "int4:g64:sym", "int8:naive", "int4+hadamard"]
)
def test_every_quant_spec_is_a_codec_that_round_trips(name):
    codec = get_codec(name)
    assert isinstance(codec, QuantCodec) and codec.spec == QuantSpec.parse(name)
    x = torch.randn(1000)
    payload, value = codec.encode_with_value(x)
    decoded = codec.decode(payload, 1000)
    assert torch.equal(decoded, value)
    assert float((decoded - x).norm() / x.norm()) < 0.2


def test_fp32_names_give_the_exact_codec_and_unknown_names_fail():
    assert isinstance(get_codec("fp32"), Fp32Codec) and get_codec("fp32").exact
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int5")


def test_quant_decode_rejects_wrong_size_spec_padding_and_values():
    codec = get_codec("int8")
    values = torch.randn(300, generator=torch.Generator().manual_seed(0))
    values[299] = values.abs().max() + 1  # the largest of its group: code 255, never a zero that passes as padding
    payload = codec.encode(values)
    assert len(payload) == codec.nbytes(300) == 304 + 16 + 16  # codes, bf16 scales, zero points; 16-byte aligned
    with pytest.raises(PayloadMismatch, match="non-zero alignment padding"):
        codec.decode(payload, 299)  # same length, but code 299 sits where 299 values have padding
    with pytest.raises(PayloadMismatch, match="bytes"):
        codec.decode(payload, 301 + 16)  # a longer message than the payload
    with pytest.raises(PayloadMismatch, match="int4"):
        get_codec("int4").decode(payload, 300)
    with pytest.raises(PayloadError):
        codec.decode(payload[:-7], 300)
    padding = bytearray(payload)
    padding[302] = 1  # alignment padding after the 300 codes
    with pytest.raises(PayloadMismatch, match="padding"):
        codec.decode(bytes(padding), 300)
    scale = bytearray(payload)
    scale[304:306] = (0x7F80).to_bytes(2, "little")  # bf16 +Inf as a group scale
    with pytest.raises(PayloadMismatch, match="scale"):
        codec.decode(bytes(scale), 300)
    assert issubclass(PayloadMismatch, ValueError)


def test_message_bodies_have_zero_padding_whatever_the_buffer_held():
    codec, spec = get_codec("int4"), QuantSpec.parse("int4")
    gaps = message_gaps(spec, 301)
    assert gaps  # 151 code bytes and 3 scales / zero points leave padding after every section
    for _ in range(3):  # freed host memory is reused for the next message: its old bytes must not be sent
        stale = torch.full((4096,), 0xAB, dtype=torch.uint8)
        del stale
        payload = codec.encode(torch.randn(301))
        for start, end in gaps:
            assert not any(payload[start:end])


def test_small_messages_go_uncompressed_and_large_ones_compressed():
    world = 2
    for numel, compressed in ((2 * (SMALL_MESSAGE_NUMEL - 1), False), (2 * SMALL_MESSAGE_NUMEL, True)):
        fabric = LocalFabric(world)
        xs = gaussian_inputs(world, numel)
        outs = fabric.run(lambda t, xs=xs: allreduce(xs[t.rank], t, codec="int8"))
        fp32_bytes = 2 * (numel // 2 * 4 + HEADER_BYTES)
        sent = fabric.transports[0].counter.bytes_sent
        if compressed:
            assert sent < fp32_bytes / 3.5
        else:
            assert sent == fp32_bytes
            exact = (xs[0] + xs[1]) / 2
            assert torch.allclose(outs[0], exact, atol=1e-6)


def test_two_phase_bytes_per_member_match_theory_for_int4():
    world, numel = 4, 4 * 4096
    fabric = LocalFabric(world)
    xs = gaussian_inputs(world, numel)
    fabric.run(lambda t: allreduce(xs[t.rank], t, codec="int4", min_compress_numel=0))
    segment = numel // world
    message = HEADER_BYTES + len(get_codec("int4").encode(torch.randn(segment)))
    for t in fabric.transports:
        assert t.counter.bytes_sent == 2 * (world - 1) * message
    # 4 bits + bf16 scale and u8 zero point per 128 values (4.19 bits), plus the headers
    assert message < segment * 4.19 / 8 + 100
