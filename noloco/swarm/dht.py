"""The swarm's DHT: start a ``hivemind.DHT`` (and its p2pd daemon) that never outlives this process.

A peer of the hivemind backend finds the others through hivemind's Kademlia DHT, whose daemon
process owns the libp2p daemon (p2pd) that :class:`~noloco.swarm.endpoint.SwarmEndpoint` also uses.
:func:`start_dht` makes sure a SIGKILLed peer leaves no daemons behind; :func:`start_peer_dht`
retries a start that a busy bootstrap peer made fail.

:class:`RunRecordValidator` makes the run's DHT records verifiable: every record a peer stores carries
an HMAC under the run key over (DHT key, subkey, value, expiration), appended by the DHT itself
(hivemind's ``RecordValidatorBase.sign_value``). Every node that runs it refuses, at store time, a
record without a valid MAC or with an expiration further ahead than ``max_ttl``, so junk from a
process without the key can neither be stored on an honest node nor displace an honest record (the
DHT keeps the latest expiration per subkey); a reader's node applies the same check to every record
another node returns (hivemind drops a node's whole dictionary if one of its entries fails), so a
node that does not validate (a plain ``hivemind-dht``, a malicious node) cannot feed it junk either.
Refusals are counted in shared memory (the DHT runs in a forked child) and read with :meth:`counts`.
"""

from __future__ import annotations

import contextlib
import hmac
import multiprocessing
import os
import struct
import threading
import time


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return out


def _exit_with_parent(parent: int, poll: float) -> None:
    """In the DHT's child process: once ``parent`` is gone (SIGKILL), stop p2pd and exit."""
    import signal

    while os.getppid() == parent:
        time.sleep(poll)
    for child in _children(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGTERM)
    os._exit(0)


def start_dht(poll: float = 1.0, **kwargs):
    """A started ``hivemind.DHT`` whose background process (and its p2pd) exits when this process dies.

    hivemind runs the DHT in a forked daemon process that owns the p2pd daemon. Python stops daemon
    children on a normal exit, but a peer killed with SIGKILL (a crash, the OOM killer) left both
    running forever; here a thread in the DHT process notices the parent is gone within ``poll``
    seconds, terminates p2pd and exits.
    """
    import hivemind

    parent = os.getpid()

    class _DHT(hivemind.DHT):
        def run(self) -> None:  # runs in the forked DHT process
            threading.Thread(target=_exit_with_parent, args=(parent, poll), daemon=True).start()
            super().run()

    return _DHT(**kwargs)


def start_peer_dht(initial_peers: list[str] | None, host_maddrs: list[str], announce_maddrs: list[str] | None = None,
                   startup_timeout: float = 60.0, attempts: int = 3, **kwargs):
    """:func:`start_dht` for a swarm peer; p2pd sometimes fails to reach a busy bootstrap peer, so retry."""
    from hivemind.p2p import P2PDaemonError

    options = dict(host_maddrs=list(host_maddrs), start=True, startup_timeout=startup_timeout, **kwargs)
    if announce_maddrs:
        options["announce_maddrs"] = list(announce_maddrs)
    for attempt in range(attempts):
        try:
            return start_dht(initial_peers=list(initial_peers or []) or None, **options)
        except P2PDaemonError:
            if attempt == attempts - 1:
                raise
            time.sleep(2.0)


_TRAILER = b"NLV1"
_SIGNED = len(_TRAILER) + 32


def _validator_base():
    from hivemind.dht.validation import RecordValidatorBase

    return RecordValidatorBase


class RunRecordValidator:
    """A hivemind record validator keyed on the run key (see the module docstring).

    Built with :meth:`create` (hivemind imported lazily). ``max_ttl``: the furthest ahead, in seconds of
    this node's DHT clock, an accepted expiration may be. Counts (``dht_unauthenticated``,
    ``dht_expiry``) are shared with the forked DHT process; a record a reader's node refuses is
    counted each time it is returned.
    """

    @staticmethod
    def create(key, run_id: str, max_ttl: float):
        base = _validator_base()

        class _Validator(RunRecordValidator, base):
            pass

        return _Validator(key, run_id, max_ttl)

    def __init__(self, key, run_id: str, max_ttl: float):
        self._key, self.run_id, self.max_ttl = key, run_id, float(max_ttl)
        self._counts = multiprocessing.get_context("fork").Array("q", 2)  # unauthenticated, expiry

    def _mac(self, record) -> bytes:
        parts = [self.run_id.encode(), bytes(record.key), bytes(record.subkey), bytes(record.value)]
        framed = b"".join(struct.pack("!I", len(p)) + p for p in parts)
        return self._key.mac(b"noloco-dht/1", framed, struct.pack("!d", float(record.expiration_time)))

    def _count(self, index: int) -> bool:
        with self._counts.get_lock():
            self._counts[index] += 1
        return False

    def sign_value(self, record) -> bytes:
        return bytes(record.value) + _TRAILER + self._mac(record)

    def validate(self, record) -> bool:
        from dataclasses import replace

        from hivemind.utils.timed_storage import get_dht_time

        value = bytes(record.value)
        if len(value) < _SIGNED or value[-_SIGNED:-32] != _TRAILER:
            return self._count(0)
        if not hmac.compare_digest(self._mac(replace(record, value=value[:-_SIGNED])), value[-32:]):
            return self._count(0)
        if record.expiration_time > get_dht_time() + self.max_ttl:
            return self._count(1)
        return True

    def strip_value(self, record) -> bytes:
        return bytes(record.value)[:-_SIGNED]

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other) -> bool:
        return False

    def counts(self) -> dict[str, int]:
        """Records refused so far by this peer's DHT node (stores and reads together)."""
        with self._counts.get_lock():
            unauthenticated, expiry = self._counts[0], self._counts[1]
        return {"dht_unauthenticated": int(unauthenticated), "dht_expiry": int(expiry)}

    def __reduce__(self):  # holds the run key: never pickled
        raise TypeError("RunRecordValidator cannot be pickled")
