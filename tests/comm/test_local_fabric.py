import pytest
import torch

from noloco.comm import CommError, CommTimeout, LocalFabric


def test_messages_arrive_by_tag_and_bytes_are_counted():
    fabric = LocalFabric(2)

    def fn(t):
        peer = 1 - t.rank
        t.send(peer, "b", bytes([t.rank]) * 3)
        t.send(peer, "a", bytes([t.rank]) * 5)
        return t.recv(peer, "a", 5.0), t.recv(peer, "b", 5.0)

    (a0, b0), (a1, b1) = fabric.run(fn)
    assert a0 == b"\x01" * 5 and b0 == b"\x01" * 3 and a1 == b"\x00" * 5
    for t in fabric.transports:
        assert t.counter.bytes_sent == 8 and t.counter.bytes_received == 8
        assert t.counter.messages_sent == 2
    assert fabric.pending() == 0


def test_recv_from_silent_peer_times_out():
    fabric = LocalFabric(2)
    with pytest.raises(CommTimeout):  # raised, not hung (the wait itself is not timed: a loaded machine stretches it)
        fabric.transports[0].recv(1, "never", timeout=0.2)


def test_a_failing_rank_aborts_the_others_quickly():
    fabric = LocalFabric(3)

    def fn(t):
        if t.rank == 2:
            raise RuntimeError("boom")
        return t.recv(2, "x", timeout=3600.0)  # only the abort can end this wait within the test's time limit

    with pytest.raises(RuntimeError, match="boom"):
        fabric.run(fn)


def test_bad_addresses_are_rejected():
    t = LocalFabric(2).transports[0]
    with pytest.raises(CommError):
        t.send(0, "self", b"")
    with pytest.raises(CommError):
        t.send(5, "x", b"")


def test_payload_is_handed_over_without_a_copy_and_counted():
    fabric = LocalFabric(2)
    message = torch.arange(64, dtype=torch.uint8)  # a collective's message buffer
    fabric.transports[0].send(1, "t", memoryview(message.numpy()))
    got = fabric.transports[1].recv(0, "t", 1.0)
    assert bytes(got) == bytes(range(64))
    assert torch.frombuffer(got, dtype=torch.uint8).data_ptr() == message.data_ptr()  # the same memory
    assert fabric.transports[0].counter.bytes_sent == fabric.transports[1].counter.bytes_received == 64
    fabric.transports[0].send(1, "u", b"abc")
    assert fabric.transports[1].recv(0, "u", 1.0) == b"abc"
