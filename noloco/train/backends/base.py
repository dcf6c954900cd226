"""The backend interface: what the worker loop needs from whatever runs it.

A backend runs a run's workers (threads over the in-process fabric, processes over
torch.distributed, peers of a hivemind swarm). :func:`~noloco.train.loop.train_worker` is the same
loop on every backend; it talks to its worker's :class:`Backend` for the six things that differ:

- :meth:`Backend.peers`: who the outer algorithm exchanges with (a fixed world's transport, whose groups the
  algorithm draws itself, or a group source such as swarm matchmaking, where failed rounds are skipped);
- :meth:`Backend.wrap`: the module the loop calls forward on (a worker of several processes wraps
  its replica in DDP with the quantized gradient hook);
- :meth:`Backend.start`: the step to start from (a swarm peer may join from a live peer's state);
- :meth:`Backend.after_step`: per-step bookkeeping (a swarm peer publishes its liveness);
- :meth:`Backend.barrier`: whether a checkpoint step is complete once this worker saved;
- :meth:`Backend.agree_stop`: whether the run ends at this round boundary because a worker's data stream
  ran out (``data.stream_end=stop``; called only then, so other runs never pay for it).

Adding a backend is one module here with a ``launch(cfg, run_dir, resume_from, resume_step, quiet)`` function
that drives a :class:`~noloco.train.run.Run` and supplies its placement, and a :class:`Backend` subclass, plus
its line in :data:`noloco.train.backends.BACKENDS` (docs/architecture.md, "A run, from train.py to the wire").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from noloco.comm.base import Transport
from noloco.gossip.base import GroupSource


class WorkersReported(Exception):
    """The workers of a run in processes of their own ended with an error each already reported on its own
    ``error:`` line (a bad file, a full disk: exit 2; a stall: exit 3): the run exits with ``code`` and prints
    nothing more, unless other workers failed without a line of their own (``others``: (rank, exit code))."""

    def __init__(self, code: int, others: list[tuple[int, int]]):
        super().__init__(f"workers failed (rank, exit code): {others}" if others else "")
        self.code, self.others = code, others


class Backend(ABC):
    """One worker's view of its run's backend. ``rank`` picks its data stream and checkpoint file."""

    name: ClassVar[str]
    #: an open swarm skips rounds whose group cannot be formed or whose exchange fails (see OuterAlgorithm)
    skip_failed_rounds: ClassVar[bool] = False

    def __init__(self, rank: int):
        self.rank = int(rank)

    @abstractmethod
    def peers(self) -> Transport | GroupSource:
        """The world's transport (fixed world) or a group source (open swarm) for the outer algorithm."""

    def wrap(self, model: torch.nn.Module, algo) -> torch.nn.Module:
        """The module the loop runs forward/backward on (default: ``model`` itself)."""
        return model

    def start(self, algo, model: torch.nn.Module) -> int:
        """Called once before the first step of a fresh (not resumed) worker; returns the step to start from."""
        return 0

    def after_step(self, step: int, algo) -> None:  # noqa: B027 - optional hook
        """Called after every inner step (after logging)."""

    def next_step(self, step: int, algo) -> int:
        """The step the worker trains next after ``step``: ``step + 1``; a swarm peer that resumed behind its
        swarm may skip ahead to the swarm's round (the loop then moves the algorithm and the LR schedule there)."""
        return step + 1

    @abstractmethod
    def barrier(self, step: int) -> bool:
        """Wait until every worker of the run saved ``step``'s checkpoint; False when some never will."""

    def agree_stop(self, step: int, exhausted_at: int | None) -> tuple[int, int] | None:
        """At the round boundary ``step`` (``data.streaming`` with ``data.stream_end=stop``): does the run end here?

        ``exhausted_at``: the step at which this worker's data stream ran out (None: it has not). Returns
        ``(rank, exhausted_at)`` of the worker whose stream ran out first (the earliest step, then the lowest
        rank), the same on every worker of the run, or None to train on. Default: a worker that is a run of its
        own (a swarm peer) decides alone.
        """
        return None if exhausted_at is None else (self.rank, int(exhausted_at))

    def marks_complete(self) -> bool:
        """Whether this worker writes the checkpoint's COMPLETE marker (one per run folder)."""
        return self.rank == 0
