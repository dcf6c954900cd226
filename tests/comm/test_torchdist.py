"""TorchDistTransport over real processes (gloo on loopback), running the same allreduce code path."""

import os
import time

import pytest
import torch

from noloco.collectives import PayloadMismatch, allreduce
from noloco.comm import CommError, CommTimeout
from noloco.comm.base import Transport
from noloco.comm.torchdist import launch_local


def _inputs(world, numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(world)]


def _reductions(t):
    """Several reductions over one set of processes: exactness, codecs, algorithms, tags, bytes."""
    world = t.world_size
    out = {}
    # raw transport: out-of-order tags, variable sizes incl. empty payloads
    peer = (t.rank + 1) % world
    t.send(peer, "b", bytes([t.rank]) * 3)
    t.send(peer, "a", b"")
    src = (t.rank - 1) % world
    out["raw"] = (t.recv(src, "a", 10.0), t.recv(src, "b", 10.0))
    xs = _inputs(world, 5000, seed=world)
    out["fp32"] = allreduce(xs[t.rank], t, codec="fp32", op="sum")
    for algorithm in ("two_phase", "ring", "naive_ring"):
        out[algorithm] = allreduce(xs[t.rank], t, codec="int4", algorithm=algorithm, min_compress_numel=0)
    for codec in ("fp32", "int8", "mxfp4"):  # every announced receive was used: none is left posted
        allreduce(xs[t.rank], t, codec=codec, reduction="ring", min_compress_numel=0, max_norm_ratio=4.0)
    out["posted_ahead_left"] = sum(t._ahead_count.values())
    out["early"] = t.early_receives
    start = time.monotonic()
    try:
        t.recv(src, "never", timeout=0.3)
    except CommTimeout:
        out["timeout_s"] = time.monotonic() - start
    # disagreement: the last rank reduces a shorter vector
    x = xs[t.rank][:4000] if t.rank == world - 1 else xs[t.rank]
    try:
        allreduce(x, t, codec="int8", min_compress_numel=0, timeout=30, tag="mismatch")
    except PayloadMismatch as exc:
        out["mismatch"] = str(exc)
    out["counter"] = t.counter.state_dict()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_over_gloo_processes(world):
    results = launch_local(_reductions, world, timeout=240)
    xs = _inputs(world, 5000, seed=world)
    exact_sum = torch.stack([x.double() for x in xs]).sum(0)
    for rank, res in enumerate(results):
        assert res["raw"] == (b"", bytes([(rank - 1) % world]) * 3)
        assert torch.allclose(res["fp32"].double(), exact_sum, atol=1e-4)
        assert torch.equal(res["fp32"], results[0]["fp32"])
        for algorithm in ("two_phase", "ring", "naive_ring"):
            assert torch.equal(res[algorithm], results[0][algorithm])  # bit-identical across processes
            err = (res[algorithm].double() - exact_sum / world).norm() / (exact_sum / world).norm()
            assert err < 0.3
        assert res["timeout_s"] > 0.25  # it waited its timeout (how much longer depends on the machine's load)
        assert "numel" in res["mismatch"]
        assert res["counter"]["bytes_sent"] > 0 and res["counter"]["messages_received"] > 0
        assert res["posted_ahead_left"] == 0 and res["early"] > 0
    # same algorithm, same inputs, same code path as the in-process fabric: identical bits
    from noloco.comm import LocalFabric

    local = LocalFabric(world).run(
        lambda t: (
            t.send((t.rank + 1) % world, "b", b"x" * 3),
            t.send((t.rank + 1) % world, "a", b""),
            t.recv((t.rank - 1) % world, "a", 5),
            t.recv((t.rank - 1) % world, "b", 5),
            allreduce(xs[t.rank], t, codec="fp32", op="sum"),
            allreduce(xs[t.rank], t, codec="int4", reduction="two_phase", min_compress_numel=0),
        )[-1]
    )
    assert torch.equal(local[0], results[0]["two_phase"])


class _DiesAfterOneSend(Transport):
    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.counter = inner, inner.rank, inner.world_size, inner.counter
        self.sent = 0

    def send(self, dst, tag, payload):
        if self.sent >= 1:
            os._exit(3)  # the process dies mid-reduction: no error marker, sockets close
        self.sent += 1
        self.inner.send(dst, tag, payload)

    def recv(self, src, tag, timeout):
        return self.inner.recv(src, tag, timeout)


def _dead_member(t, timeout):
    x = torch.randn(3000)
    if t.rank == 1:
        allreduce(x, _DiesAfterOneSend(t), codec="int8", min_compress_numel=0, timeout=timeout)
    start = time.monotonic()
    try:
        allreduce(x, t, codec="int8", min_compress_numel=0, timeout=timeout)
    except CommError as exc:  # CommTimeout on recv, or CommError when a send finds the link already gone
        return (type(exc).__name__, time.monotonic() - start, str(exc))
    return ("finished", time.monotonic() - start, "")


def test_dead_process_makes_survivors_raise_comm_timeout_within_timeout():
    timeout = 5.0
    results = launch_local(_dead_member, 3, timeout, timeout=240, missing_ok=True)
    assert results[1] is None
    for rank in (0, 2):
        kind, elapsed, _ = results[rank]
        assert kind in ("CommTimeout", "CommError")  # raised, not hung and not finished


def _expect_after_peer_died(t):
    if t.rank == 1:
        t.send(0, "hello", b"x")
        time.sleep(0.5)
        os._exit(3)  # the link closes before rank 0 posts its receive ahead
    assert t.recv(1, "hello", 30.0) == b"x"
    with t._cond:  # the receiving thread, held off the lock, cannot note the loss before the post below sees it
        time.sleep(3.0)
        t.expect(1, "never", 100)  # gloo finds the pair closed while posting: the link is lost, nothing raised
    start = time.monotonic()
    try:
        t.recv(1, "never", 20.0)
    except CommError as exc:
        return type(exc).__name__, time.monotonic() - start
    return "received", time.monotonic() - start


def test_a_receive_posted_ahead_on_a_closed_link_marks_it_lost_instead_of_raising():
    results = launch_local(_expect_after_peer_died, 2, timeout=120, missing_ok=True)
    kind, elapsed = results[0]
    assert kind in ("CommTimeout", "CommError") and elapsed < 15.0, results[0]


def _ping_pong(t, rounds: int):
    """Rank 0 sends, rank 1 answers; returns rank 0's round-trip times and the order rank 1 saw."""
    rtts, order = [], []
    for i in range(rounds):
        if t.rank == 0:
            start = time.monotonic()
            t.send(1, f"ping{i}", bytes(1000))
            t.recv(1, f"pong{i}", 30.0)
            rtts.append(time.monotonic() - start)
        else:
            t.send(0, f"pong{i}", t.recv(0, f"ping{i}", 30.0))
    if t.rank == 1:  # three messages sent back to back arrive in the order they were sent
        order = [t.recv(0, f"burst{j}", 30.0) for j in range(3)]
    else:
        for j in range(3):
            t.send(1, f"burst{j}", bytes([j]))
    t.close()
    return rtts, order, t.latency


def test_link_latency_delays_every_message_by_its_one_way_latency_and_keeps_order():
    os.environ["NOLOCO_LINK_LATENCY"] = "0.15"  # inherited by the spawned ranks, as noloco-fleet sets it
    try:
        results = launch_local(_ping_pong, 2, 3, timeout=120)
    finally:
        del os.environ["NOLOCO_LINK_LATENCY"]
    rtts, _, latency = results[0]
    assert latency == 0.15
    assert all(0.3 <= rtt < 1.5 for rtt in rtts), rtts  # two one-way latencies per round trip
    assert results[1][1] == [b"\x00", b"\x01", b"\x02"]


def _posted_ahead(t):
    """Receives posted ahead (expect): used when announced first, skipped when the message came first, and a
    message of another size than announced still arrives; a reduction announces all it receives."""
    out = {}
    if t.rank == 0:
        t.recv(1, "ready", 30.0)  # rank 1 announced "x" and "z"
        t.send(1, "x", bytes(range(250)) * 4)
        t.send(1, "y", b"\x07" * 1000)
        t.send(1, "z", b"\x05" * 800)  # announced as 500 bytes
    else:
        t.expect(0, "x", 1000)
        t.expect(0, "z", 500)
        t.send(0, "ready", b"")
        out["x"] = bytes(t.recv(0, "x", 30.0))
        out["early_after_x"] = t.early_receives
        deadline = time.monotonic() + 30
        while (0, "y") not in t._mail and time.monotonic() < deadline:  # "y" has arrived, unannounced
            time.sleep(0.01)
        t.expect(0, "y", 1000)  # too late: nothing is posted for it
        out["ahead_after_y"] = t._ahead_count[0]
        out["y"] = bytes(t.recv(0, "y", 30.0))
        out["z"] = bytes(t.recv(0, "z", 30.0))
        out["ahead_left"] = t._ahead_count[0]  # the receive announced for a 500-byte "z", never used
    before = t.early_receives
    xs = _inputs(t.world_size, 3001, seed=5)
    out["reduced"] = allreduce(xs[t.rank], t, codec="int4", reduction="two_phase", min_compress_numel=0)
    out["early_in_reduction"] = t.early_receives - before
    before = t.early_receives
    out["ring"] = allreduce(xs[t.rank], t, codec="int4", reduction="ring", min_compress_numel=0, max_norm_ratio=4.0)
    out["early_in_ring"] = t.early_receives - before
    return out


def test_receives_posted_ahead_are_used_only_for_the_message_announced():
    results = launch_local(_posted_ahead, 2, timeout=120)
    one = results[1]
    assert one["x"] == bytes(range(250)) * 4 and one["early_after_x"] == 1
    assert one["ahead_after_y"] == 1 and one["y"] == b"\x07" * 1000  # only "z"'s announcement is pending
    assert one["z"] == b"\x05" * 800 and one["ahead_left"] == 1  # arrived the ordinary way
    assert torch.equal(results[0]["reduced"], results[1]["reduced"])
    from noloco.comm import LocalFabric

    xs = _inputs(2, 3001, seed=5)
    local = LocalFabric(2).run(lambda t: allreduce(xs[t.rank], t, codec="int4", reduction="two_phase",
                                                   min_compress_numel=0))  # fmt: skip
    assert torch.equal(local[0], results[0]["reduced"])
    # each member receives one phase-1 and one phase-2 message; whichever frame came after its announcement
    # (at least the phase-2 one, which the partner sends only after receiving this member's phase-1 message)
    # landed in the receive posted ahead
    assert all(1 <= r["early_in_reduction"] <= 2 for r in results)
    # the ring (here with a norm bound: every reduce-scatter message carries its count of inputs) too
    assert torch.equal(results[0]["ring"], results[1]["ring"]) and all(r["early_in_ring"] >= 1 for r in results)
