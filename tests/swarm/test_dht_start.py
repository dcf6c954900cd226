"""A swarm peer's DHT start in two halves (:class:`~noloco.swarm.dht.PeerDHTStart`): the DHT process forked at
once, so that its p2pd starts while a resumed peer checks its checkpoint, waited for afterwards, and stopped with
its p2pd where the peer gives up (a refused checkpoint). Real DHT processes and p2pd daemons on loopback."""

from __future__ import annotations

import os
import time
from pathlib import Path

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _processes_with(text: str) -> list[int]:
    """Processes whose command line holds ``text``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_the_dht_is_forked_at_once_and_takes_the_peers_identity():
    from noloco.swarm import PeerDHTStart, PeerIdentity

    identity = PeerIdentity.generate()
    starting = PeerDHTStart([], LOOPBACK, identity=identity)
    key_file = starting.options["identity_path"]
    assert starting._dht.is_alive()  # running before anyone waits for it
    dht = starting.result()
    try:
        assert dht.peer_id.to_base58() == identity.peer_id
        assert not os.path.exists(key_file)  # the key file lives until the daemon has started, no longer
        assert len(_processes_with(key_file)) == 1  # its p2pd, named by the key file it read (the probe below)
        joined = PeerDHTStart([str(m) for m in dht.get_visible_maddrs()], LOOPBACK).result()
        joined.shutdown()
    finally:
        dht.shutdown()


def test_a_cancelled_start_leaves_no_dht_process_no_p2pd_and_no_key_file():
    from noloco.swarm import PeerDHTStart, PeerIdentity

    starting = PeerDHTStart([], LOOPBACK, identity=PeerIdentity.generate())
    pid, key_file = starting._dht.pid, starting.options["identity_path"]
    starting.cancel()
    deadline = time.monotonic() + 15
    while (_processes_with(key_file) or os.path.exists(f"/proc/{pid}")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the DHT process outlived the cancelled start"
    assert _processes_with(key_file) == [], "its p2pd outlived the cancelled start"
    assert not os.path.exists(key_file)
    starting.cancel()  # twice: nothing left to stop
