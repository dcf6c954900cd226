"""The swarm's DHT: start a ``hivemind.DHT`` (and its p2pd daemon) that never outlives this process.

A peer of the hivemind backend finds the others through hivemind's Kademlia DHT, whose daemon
process owns the libp2p daemon (p2pd) that :class:`~noloco.swarm.endpoint.SwarmEndpoint` also uses.
:func:`start_dht` makes sure a SIGKILLed peer leaves no daemons behind; :func:`start_peer_dht`
retries a start that a busy bootstrap peer made fail.
"""

from __future__ import annotations

import contextlib
import os
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
