"""Fault injection for tests and experiments: crash or freeze a worker at a chosen point.

Set ``NOLOCO_FAULTS`` to a comma-separated list of ``point@step[/rank]=action``, e.g.::

    NOLOCO_FAULTS="checkpoint.mid@10=kill"          # SIGKILL while step 10's checkpoint is half written
    NOLOCO_FAULTS="outer.exchange@40/2=stop"        # rank 2 freezes (SIGSTOP) right before round 2's exchange

Points: ``checkpoint.mid`` (tensors written, metadata not yet), ``outer.exchange`` (before an outer
step's first message). Actions: ``kill`` (SIGKILL this process), ``stop`` (SIGSTOP this process),
``raise`` (RuntimeError in the calling thread). Unset, :func:`fire` costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

_ACTIONS = ("kill", "stop", "raise")


class FaultSpecError(ValueError):
    """``NOLOCO_FAULTS`` does not parse."""


def parse(spec: str) -> dict[tuple[str, int, int | None], str]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            where, action = item.split("=")
            point, at = where.split("@")
            step, _, rank = at.partition("/")
            key = (point, int(step), int(rank) if rank else None)
        except ValueError:
            raise FaultSpecError(f"NOLOCO_FAULTS: cannot parse {item!r} (want point@step[/rank]=action)") from None
        if action not in _ACTIONS:
            raise FaultSpecError(f"NOLOCO_FAULTS: unknown action {action!r} in {item!r}; use {_ACTIONS}")
        faults[key] = action
    return faults


def fire(point: str, step: int, rank: int | None = None) -> None:
    """Carry out the fault configured for (point, step, rank), if any."""
    spec = os.environ.get("NOLOCO_FAULTS")
    if not spec:
        return
    faults = parse(spec)
    action = faults.get((point, step, rank)) or faults.get((point, step, None))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "raise":
        raise RuntimeError(f"injected fault at {point}@{step} (rank {rank})")
