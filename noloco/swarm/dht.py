"""The swarm's DHT: start a ``hivemind.DHT`` (and its p2pd daemon) that never outlives this process.

A peer of the hivemind backend finds the others through hivemind's Kademlia DHT, whose daemon
process owns the libp2p daemon (p2pd) that :class:`~noloco.swarm.endpoint.SwarmEndpoint` also uses.
:func:`start_dht` makes sure a SIGKILLed peer leaves no daemons behind; :func:`start_peer_dht`
retries a start that a busy bootstrap peer made fail, and :class:`PeerDHTStart` is that start in two halves (the
process forked now, waited for later).

:class:`RunRecordValidator` makes the run's DHT records verifiable twice over, appended by the DHT itself
(hivemind's ``RecordValidatorBase.sign_value``) to every record a peer stores: an HMAC under the run
key over (run, DHT key, subkey, value, expiration), which only key holders can make, and an Ed25519
signature of the same bytes by the peer whose libp2p id *is the subkey*
(:class:`~noloco.swarm.identity.PeerIdentity`; the public key is read from the id itself), which only
that peer can make. Every node that runs it refuses, at store time, a record without a valid MAC
(``dht_unauthenticated``), one whose subkey names a peer that did not sign it (``dht_forged``: a key
holder writing under another peer's registry entry or announcement), and one with an expiration further
ahead than ``max_ttl`` (``dht_expiry``). So junk from a process without the key can neither be stored
on an honest node nor displace an honest record (the DHT keeps the latest expiration per subkey), and a
key holder can write under its own subkeys only. A reader's node applies the same checks to every record
another node returns (hivemind drops a node's whole dictionary if one of its entries fails), so a node
that does not validate (a plain ``hivemind-dht``, a malicious node) cannot feed it junk or forgeries
either. (hivemind's own ``RSASignatureValidator`` puts an RSA key into the subkey instead; a subkey that
*is* the libp2p id ties a record to the identity libp2p authenticates on every stream, so the peer a
record names and the peer a reader then talks to are one.) Refusals are counted in shared memory (the
DHT runs in a forked child) and read with :meth:`RunRecordValidator.counts`.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import multiprocessing
import os
import struct
import threading
import time

from noloco.swarm.identity import SIGNATURE_BYTES, PeerIdentity, verify


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

    ``get``, ``store`` and ``run_coroutine`` may be called from several threads (with ``outer.overlap`` the
    exchange thread matches while the training thread publishes liveness): hivemind writes each request to one
    pipe without a lock, so a request of one thread could interleave with another's; here the writes take
    turns (the waits for the results do not).
    """
    import hivemind

    parent = os.getpid()

    class _DHT(hivemind.DHT):
        _requests = threading.RLock()  # one request written to the DHT process's pipe at a time

        def run(self) -> None:  # runs in the forked DHT process
            threading.Thread(target=_exit_with_parent, args=(parent, poll), daemon=True).start()
            super().run()

        def get(self, key, latest: bool = False, return_future: bool = False, **options):
            with self._requests:
                future = super().get(key, latest=latest, return_future=True, **options)
            return future if return_future else future.result()

        def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **options):
            with self._requests:
                future = super().store(key, value, expiration_time, subkey=subkey, return_future=True, **options)
            return future if return_future else future.result()

        def run_coroutine(self, coro, return_future: bool = False):
            with self._requests:
                future = super().run_coroutine(coro, return_future=True)
            return future if return_future else future.result()

    return _DHT(**kwargs)


class PeerDHTStart:
    """:func:`start_peer_dht` in two halves: the DHT process (and its p2pd) is forked when this is made and starts
    while the caller does other work (a resumed peer checks its checkpoint); :meth:`result` waits for it, retrying
    a start that failed, and :meth:`cancel` stops it where the caller no longer needs it.

    The fork happens in the calling thread, before the caller starts threads of its own work."""

    def __init__(self, initial_peers: list[str] | None, host_maddrs: list[str],
                 announce_maddrs: list[str] | None = None, startup_timeout: float = 120.0, attempts: int = 3,
                 identity: PeerIdentity | None = None, **kwargs):  # fmt: skip
        self.initial_peers, self.attempts, self.identity = list(initial_peers or []) or None, attempts, identity
        self.options = dict(host_maddrs=list(host_maddrs), start=True, await_ready=False,
                            startup_timeout=startup_timeout, **kwargs)  # fmt: skip
        if announce_maddrs:
            self.options["announce_maddrs"] = list(announce_maddrs)
        self._files = contextlib.ExitStack()  # the identity's key file exists until the daemon has started
        try:
            if identity is not None:  # hivemind's check that an identity is free reads RSA keys only: ours is new
                path = self._files.enter_context(identity.identity_file())
                self.options.update(identity_path=path, check_if_identity_free=False)
            self._dht = start_dht(initial_peers=self.initial_peers, **self.options)
        except BaseException:
            self._files.close()
            raise

    def result(self):
        """The started DHT; hivemind's ``P2PDaemonError`` when every attempt failed."""
        from hivemind.p2p import P2PDaemonError

        try:
            for attempt in range(self.attempts):
                try:
                    self._dht.wait_until_ready()
                except P2PDaemonError:
                    if attempt == self.attempts - 1:
                        raise
                    time.sleep(2.0)
                    self._dht = start_dht(initial_peers=self.initial_peers, **self.options)
                    continue
                dht, self._dht = self._dht, None
                if self.identity is not None and dht.peer_id.to_base58() != self.identity.peer_id:
                    dht.shutdown()
                    raise RuntimeError("the DHT's daemon did not take this peer's identity")
                return dht
        finally:
            self._files.close()

    def cancel(self) -> None:
        """Stop the DHT process (after its start, so that its p2pd goes with it) where :meth:`result` was not taken."""
        dht, self._dht = self._dht, None
        try:
            if dht is not None:
                with contextlib.suppress(Exception):  # a start that failed has nothing left to stop
                    dht.wait_until_ready()
                    dht.shutdown()
        finally:
            self._files.close()


def start_peer_dht(initial_peers: list[str] | None, host_maddrs: list[str], announce_maddrs: list[str] | None = None,
                   startup_timeout: float = 120.0, attempts: int = 3, identity: PeerIdentity | None = None,
                   **kwargs):  # fmt: skip
    """:func:`start_dht` for a swarm peer; p2pd sometimes fails to reach a busy bootstrap peer, so retry.

    ``identity``: the peer's :class:`~noloco.swarm.identity.PeerIdentity`; its daemon then runs under that
    libp2p id (the key file exists only until the daemon has started). :class:`PeerDHTStart` is the same start
    in two halves.
    """
    return PeerDHTStart(initial_peers, host_maddrs, announce_maddrs, startup_timeout, attempts, identity,
                        **kwargs).result()  # fmt: skip


@functools.lru_cache(maxsize=16384)
def _signed_record(owner: str, signed: bytes, signature: bytes) -> bool:
    """Whether ``owner`` signed the record ``signed`` (cached: a DHT search returns the same record from each of the
    ~20 nodes it visits, and the same records again at every read until they change; an Ed25519 check costs
    ~80 us, so a read of the registry of N peers cost N x 20 of them, and one wave of reads N x N x 20)."""
    return verify(owner, b"noloco-dht-sig/2" + signed, signature)


_TRAILER = b"NLV2"
_SIGNED = len(_TRAILER) + SIGNATURE_BYTES + 32  # trailer ‖ Ed25519 signature ‖ HMAC
_REFUSALS = ("dht_unauthenticated", "dht_expiry", "dht_forged")


def _validator_base():
    from hivemind.dht.validation import RecordValidatorBase

    return RecordValidatorBase


def record_owner(subkey: bytes) -> str | None:
    """The peer id a record's (msgpack-serialized) subkey names, or ``None`` (no subkey, not a string)."""
    from hivemind.utils.serializer import MSGPackSerializer

    try:
        owner = MSGPackSerializer.loads(bytes(subkey))
    except Exception:  # noqa: BLE001 - whatever another node sent
        return None
    return owner if isinstance(owner, str) else None


class RunRecordValidator:
    """A hivemind record validator: run-key HMAC and the subkey owner's signature (see the module docstring).

    Built with :meth:`create` (hivemind imported lazily). ``max_ttl``: the furthest ahead, in seconds of
    this node's DHT clock, an accepted expiration may be. ``identity``: this peer's
    :class:`~noloco.swarm.identity.PeerIdentity`, which signs the records stored under its own peer id
    (without one, or under another subkey, the signature is left empty and every node refuses the
    record). Counts (``dht_unauthenticated``, ``dht_forged``, ``dht_expiry``) are shared with the forked
    DHT process; a record a reader's node refuses is counted each time it is returned.
    """

    @staticmethod
    def create(key, run_id: str, max_ttl: float, identity: PeerIdentity | None = None):
        base = _validator_base()

        class _Validator(RunRecordValidator, base):
            pass

        return _Validator(key, run_id, max_ttl, identity)

    def __init__(self, key, run_id: str, max_ttl: float, identity: PeerIdentity | None = None):
        self._key, self.run_id, self.max_ttl, self.identity = key, run_id, float(max_ttl), identity
        self._counts = multiprocessing.get_context("fork").Array("q", len(_REFUSALS))

    def _signed_bytes(self, record) -> bytes:
        parts = [self.run_id.encode(), bytes(record.key), bytes(record.subkey), bytes(record.value)]
        return b"".join(struct.pack("!I", len(p)) + p for p in parts) + struct.pack("!d", float(record.expiration_time))

    def _count(self, reason: str) -> bool:
        with self._counts.get_lock():
            self._counts[_REFUSALS.index(reason)] += 1
        return False

    def sign_value(self, record) -> bytes:
        signed = self._signed_bytes(record)
        owner = record_owner(record.subkey)
        mine = self.identity is not None and owner == self.identity.peer_id
        signature = self.identity.sign(b"noloco-dht-sig/2" + signed) if mine else bytes(SIGNATURE_BYTES)
        return bytes(record.value) + _TRAILER + signature + self._key.mac(b"noloco-dht/2", signed)

    def validate(self, record) -> bool:
        from dataclasses import replace

        from hivemind.utils.timed_storage import get_dht_time

        value = bytes(record.value)
        if len(value) < _SIGNED or value[-_SIGNED : -_SIGNED + len(_TRAILER)] != _TRAILER:
            return self._count("dht_unauthenticated")
        signed = self._signed_bytes(replace(record, value=value[:-_SIGNED]))
        if not hmac.compare_digest(self._key.mac(b"noloco-dht/2", signed), value[-32:]):
            return self._count("dht_unauthenticated")
        owner = record_owner(record.subkey)
        if owner is None or not _signed_record(owner, signed, value[-SIGNATURE_BYTES - 32 : -32]):
            return self._count("dht_forged")
        if record.expiration_time > get_dht_time() + self.max_ttl:
            return self._count("dht_expiry")
        return True

    def strip_value(self, record) -> bytes:
        return bytes(record.value)[:-_SIGNED]

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other) -> bool:
        return False

    def counts(self) -> dict[str, int]:
        """Records refused so far by this peer's DHT node (stores and reads together), by reason."""
        with self._counts.get_lock():
            return {reason: int(self._counts[i]) for i, reason in enumerate(_REFUSALS)}

    def __reduce__(self):  # holds the run key: never pickled
        raise TypeError("RunRecordValidator cannot be pickled")
