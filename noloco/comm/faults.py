"""Fault injection for tests and experiments: crash or freeze a worker, or break its links, at a chosen point.

Set ``NOLOCO_FAULTS`` to a comma-separated list of ``point@step[/rank]=action``, e.g.::

    NOLOCO_FAULTS="checkpoint.mid@10=kill"          # SIGKILL while step 10's checkpoint is half written
    NOLOCO_FAULTS="outer.exchange@40/2=stop"        # rank 2 freezes (SIGSTOP) right before its outer exchange
    NOLOCO_FAULTS="outer.send@40/1=kill"            # rank 1 dies mid-exchange, after its first message left
    NOLOCO_FAULTS="outer.exchange@20/1=drop"        # every message rank 1 sends in step 20's exchange is lost
    NOLOCO_FAULTS="outer.exchange@20/1=delay:0.5"   # ... or each one leaves 0.5 s late

Points (``step`` is the inner step, 1-based; an outer exchange happens at the step that completes a
round, e.g. 20, 40, ... for ``outer.every=20``):

- ``inner.step``: before the inner optimizer update of that step;
- ``outer.exchange``: before the outer step's first message (before matchmaking in a swarm);
- ``outer.send``: right after this worker's first message of that outer step was handed to the transport
  (partners hold part of its contribution: a crash here is a crash *mid*-exchange);
- ``checkpoint.mid``: tensors written, metadata not yet.

Actions: ``kill`` (SIGKILL this process), ``stop`` (SIGSTOP this process), ``raise`` (RuntimeError in
the calling thread: the in-process stand-in for a crash), ``sleep:<seconds>`` (the calling thread waits that
long: a slow disk at ``checkpoint.mid``, a slow step at ``inner.step``). Link actions, at ``outer.exchange`` only,
apply to every message this worker sends in that outer step (both reductions, error markers included):
``drop`` (never delivered, not counted as sent: partners wait ``comm.timeout`` and skip the round) and
``delay:<seconds>`` (each send waits that long first: shorter than ``comm.timeout`` the round completes,
longer it is skipped). The outer algorithms install them by wrapping the round's transport in a
:class:`FaultyTransport` (:func:`exchange_transport`), so they work on every backend without touching
its transport. Unset, :func:`fire` costs one dict lookup.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

from noloco.comm.base import Transport

POINTS = ("inner.step", "outer.exchange", "outer.send", "checkpoint.mid")
_PROCESS_ACTIONS = ("kill", "stop", "raise")  # and sleep:<seconds>
_LINK_ACTIONS = ("drop", "delay:<seconds>")


class FaultSpecError(ValueError):
    """``NOLOCO_FAULTS`` does not parse."""


@dataclass(frozen=True)
class LinkFault:
    """A broken link for one outer step: ``drop`` every message, or ``delay`` each by ``seconds``."""

    action: str
    seconds: float = 0.0

    @staticmethod
    def parse(action: str) -> LinkFault | None:
        """``"drop"`` / ``"delay:<seconds>"`` → LinkFault; None for a process action; FaultSpecError if bad."""
        if action in _PROCESS_ACTIONS or _timed(action, "sleep") is not None:
            return None
        if action == "drop":
            return LinkFault("drop")
        seconds = _timed(action, "delay")
        if seconds is not None:
            return LinkFault("delay", seconds)
        raise FaultSpecError(
            f"NOLOCO_FAULTS: unknown action {action!r}; use {_PROCESS_ACTIONS + ('sleep:<seconds>',) + _LINK_ACTIONS}"
        )


def _timed(action: str, kind: str) -> float | None:
    """The seconds of a ``<kind>:<seconds>`` action (``delay:0.5``, ``sleep:2``); None for an action of another
    kind; FaultSpecError unless they are a finite number >= 0."""
    name, _, value = action.partition(":")
    if name != kind:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:
        raise FaultSpecError(f"NOLOCO_FAULTS: {kind} needs seconds >= 0, as in {kind}:0.5, got {action!r}")
    return seconds


def parse(spec: str) -> dict[tuple[str, int, int | None], str]:
    """``NOLOCO_FAULTS`` → {(point, step, rank or None): action}. Raises :class:`FaultSpecError`."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            where, action = item.split("=")
            point, at = where.split("@")
            step, _, rank = at.partition("/")
            key = (point, int(step), int(rank) if rank else None)
        except ValueError:
            raise FaultSpecError(f"NOLOCO_FAULTS: cannot parse {item!r} (want point@step[/rank]=action)") from None
        if point not in POINTS:
            raise FaultSpecError(f"NOLOCO_FAULTS: unknown point {point!r} in {item!r}; use {POINTS}")
        if LinkFault.parse(action) is not None and point != "outer.exchange":
            raise FaultSpecError(f"NOLOCO_FAULTS: link faults apply at outer.exchange, not {point!r} ({item!r})")
        faults[key] = action
    return faults


def lookup(point: str, step: int, rank: int | None = None) -> str | None:
    """The action configured for (point, step, rank) — a rank-specific entry first — or None."""
    spec = os.environ.get("NOLOCO_FAULTS")
    if not spec:
        return None
    faults = parse(spec)
    return faults.get((point, step, rank)) or faults.get((point, step, None))


def fire(point: str, step: int, rank: int | None = None) -> LinkFault | None:
    """Carry out the process fault configured for (point, step, rank), or return its link fault (if any)."""
    action = lookup(point, step, rank)
    pause = None if action is None else _timed(action, "sleep")
    if pause is not None:
        time.sleep(pause)
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "raise":
        raise RuntimeError(f"injected fault at {point}@{step} (rank {rank})")
    return None if action is None else LinkFault.parse(action)


class FaultyTransport(Transport):
    """Wraps one outer step's transport: drops or delays its sends, or fires ``outer.send`` after the first.

    ``recv`` is passed through. Dropped messages are counted in :attr:`dropped`, not in ``counter``
    (they never reached the inner transport). The wrapper does not own the inner transport: ``close``
    is a no-op.
    """

    def __init__(self, inner: Transport, link: LinkFault | None, step: int, rank: int | None, send_fault: bool):
        self.inner, self.link, self.step, self.fault_rank = inner, link, step, rank
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter
        self._send_fault = send_fault
        self.dropped = 0
        self.delayed_seconds = 0.0

    def send(self, dst: int, tag: str, payload: bytes) -> None:
        if self.link is not None and self.link.action == "drop":
            self.dropped += 1
            return
        if self.link is not None and self.link.action == "delay":
            time.sleep(self.link.seconds)
            self.delayed_seconds += self.link.seconds
        self.inner.send(dst, tag, payload)
        if self._send_fault:
            self._send_fault = False
            fire("outer.send", self.step, self.fault_rank)

    def recv(self, src: int, tag: str, timeout: float) -> bytes:
        return self.inner.recv(src, tag, timeout)

    def expect(self, src: int, tag: str, nbytes: int) -> None:
        self.inner.expect(src, tag, nbytes)


def exchange_transport(transport: Transport, link: LinkFault | None, step: int, rank: int | None) -> Transport:
    """``transport`` itself, or a :class:`FaultyTransport` if a link fault or an ``outer.send`` fault is set.

    ``link`` is what :func:`fire` returned for ``outer.exchange`` at this step.
    """
    send_fault = lookup("outer.send", step, rank) is not None
    if link is None and not send_fault:
        return transport
    return FaultyTransport(transport, link, step, rank, send_fault)
