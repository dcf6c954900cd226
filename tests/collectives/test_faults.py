import pytest
import torch

from noloco.collectives import PayloadMismatch, allreduce
from noloco.collectives.protocol import CallInfo, Exchange, Header
from noloco.comm import CommTimeout, LocalFabric
from noloco.comm.base import Transport

from .helpers import run_collecting

REDUCTIONS = ["two_phase", "ring", "naive_ring"]


def _assert_all_failed(results, elapsed, kind, match, limit):
    """Every member raised ``kind`` itself: one that waited for a peer until its timeout would hold a CommTimeout
    instead (what was waited for, not how long: ``elapsed`` and ``limit`` are not compared, a loaded machine can
    stretch any run)."""
    for rank, result in enumerate(results):
        assert isinstance(result, kind), f"rank {rank} returned {result!r}"
    assert any(match in str(r) for r in results), [str(r) for r in results]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "field, differ",
    [
        ("numel", lambda x, rank: x[: 1000 - 8] if rank == 1 else x),
        ("dtype", lambda x, rank: x.to(torch.bfloat16) if rank == 1 else x),
        ("codec", None),
        ("op", None),
    ],
)
def test_members_that_disagree_fail_on_every_member_with_a_clear_error(reduction, field, differ):
    world, timeout = 3, 20.0
    xs = [torch.randn(1000) for _ in range(world)]

    def fn(t):
        x, codec, op = xs[t.rank], "int8", "mean"
        if differ is not None:
            x = differ(x, t.rank)
        elif field == "codec" and t.rank == 1:
            codec = "int4"
        elif field == "op" and t.rank == 1:
            op = "sum"
        return allreduce(
            x, t, codec=codec, op=op, reduction=reduction, timeout=timeout, min_compress_numel=0, tag="round/7"
        )

    results, elapsed = run_collecting(world, fn)
    # every member fails by itself, long before the timeout
    _assert_all_failed(results, elapsed, PayloadMismatch, field, limit=timeout / 2)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dead_member_mid_reduction_makes_every_survivor_time_out(reduction):
    world, timeout = 4, 0.5

    class Died(BaseException):
        pass

    class DyingTransport(Transport):
        """Delivers its first message, then the process 'dies': nothing more is sent, no marker."""

        def __init__(self, inner):
            self.inner, self.rank, self.world_size, self.counter = inner, inner.rank, inner.world_size, inner.counter
            self.sent = 0

        def send(self, dst, tag, payload):
            if self.sent >= 1:
                raise Died()
            self.sent += 1
            self.inner.send(dst, tag, payload)

        def recv(self, src, tag, timeout):
            return self.inner.recv(src, tag, timeout)

    xs = [torch.randn(4000) for _ in range(world)]

    def fn(t):
        if t.rank == 2:
            try:
                allreduce(
                    xs[2], DyingTransport(t), codec="int4", reduction=reduction, timeout=timeout, min_compress_numel=0
                )
            except Died:
                return "died"
        return allreduce(xs[t.rank], t, codec="int4", reduction=reduction, timeout=timeout, min_compress_numel=0)

    results, elapsed = run_collecting(world, fn)
    assert results[2] == "died"
    survivors = [r for rank, r in enumerate(results) if rank != 2]
    assert all(isinstance(r, CommTimeout) for r in survivors), survivors  # they timed out, they did not hang


def test_corrupted_payload_fails_every_member():
    world = 3

    class Corrupting(Transport):
        def __init__(self, inner):
            self.inner, self.rank, self.world_size, self.counter = inner, inner.rank, inner.world_size, inner.counter

        def send(self, dst, tag, payload):
            payload = bytearray(payload)
            payload[-10] ^= 0x55  # flips bits of the body's last alignment padding, which must be zero
            self.inner.send(dst, tag, bytes(payload))

        def recv(self, src, tag, timeout):
            return self.inner.recv(src, tag, timeout)

    xs = [torch.randn(900) for _ in range(world)]
    results, elapsed = run_collecting(
        world,
        lambda t: allreduce(
            xs[t.rank], Corrupting(t) if t.rank == 0 else t, codec="int8", timeout=20, min_compress_numel=0
        ),
    )
    _assert_all_failed(results, elapsed, PayloadMismatch, "padding", limit=10)


def test_non_finite_input_fails_every_member():
    xs = [torch.randn(600) for _ in range(3)]
    xs[1][5] = float("nan")
    results, elapsed = run_collecting(
        3, lambda t: allreduce(xs[t.rank], t, codec="int4", timeout=20, min_compress_numel=0)
    )
    _assert_all_failed(results, elapsed, ValueError, "non-finite", limit=10)


def _exchange(fabric, rank, tag="outer/r3/delta", group=(0, 1, 2)):
    info = CallInfo("two_phase", "mean", torch.float32, group, group.index(rank), 300, "int8|int8", tag)
    return Exchange(fabric.transports[rank], info, timeout=1.0)


@pytest.mark.parametrize(
    "sender, sender_tag, reason",
    [
        (2, "outer/r3/delta", "sender index"),  # member 2 forges the message member 1 owes member 0
        (1, "outer/r2/delta", "round"),  # member 1's message of another round
    ],
    ids=["from-the-wrong-member", "from-another-round"],
)
def test_payload_under_another_members_address_or_round_is_rejected(sender, sender_tag, reason):
    fabric = LocalFabric(3)
    receiver, other = _exchange(fabric, 0, tag="outer/r3/delta"), _exchange(fabric, sender, tag=sender_tag)
    header = other.info.header(0, sender=sender, segment=0).pack()
    fabric._deliver(1, 0, receiver.tag_of(0, 0, 0), header + b"x")
    with pytest.raises(PayloadMismatch, match=reason):
        receiver.recv(1, 0, 0)


def test_garbage_instead_of_a_header_is_rejected():
    fabric = LocalFabric(3)
    receiver = _exchange(fabric, 0)
    fabric._deliver(1, 0, receiver.tag_of(0, 0, 0), b"\x00" * 5)
    with pytest.raises(PayloadMismatch, match="shorter"):
        receiver.recv(1, 0, 0)
    fabric._deliver(1, 0, receiver.tag_of(0, 0, 0), b"\x00" * 64)
    with pytest.raises(PayloadMismatch, match="magic"):
        receiver.recv(1, 0, 0)
    assert Header.unpack(receiver.info.header(0, 0, 0).pack()).numel == 300


def test_error_marker_reason_reaches_peers_quickly():
    fabric = LocalFabric(2)
    results = []

    def fn(t):
        try:
            if t.rank == 0:
                allreduce(torch.full((64,), float("inf")), t, codec="int8", min_compress_numel=0, timeout=30)
            else:
                allreduce(torch.ones(64), t, codec="int8", min_compress_numel=0, timeout=30)
        except ValueError as exc:
            results.append((t.rank, str(exc)))

    fabric.run(fn)
    assert {rank for rank, _ in results} == {0, 1}  # both refused the values; neither waited out its 30 s timeout
    assert any("rank 0" in msg for rank, msg in results if rank == 1)
