"""How a run ends when a worker's streamed dataset runs out before ``steps`` (``data.stream_end``).

``restart``: the worker starts its shard again and trains on to ``steps``; ``summary.json`` says whose shard
ended and when (:func:`noloco.data.stream.stream_summary`). ``stop`` (the default): the run ends at the end
of that outer round, the first step after the end that is a multiple of ``outer.every`` (every step for
DDP, which has no rounds), every worker at the same step, so the last checkpoint is complete. Until then the
exhausted worker starts its shard again for those few steps (recorded as a restart would be). At each round
boundary :class:`StreamEnd` asks the backend (:meth:`~noloco.train.backends.base.Backend.agree_stop`): one
tiny all-reduce per round, only in a streamed run with ``stop``. ``summary.json`` then holds
:func:`stopped_record` under ``stopped``. A checkpoint at such a stop cannot be resumed with ``stop`` (it would
end at once): :func:`check_resume` refuses it with one line that says to pass ``data.stream_end=restart``.
See docs/your-model-and-data.md, "When a shard ends".
"""

from __future__ import annotations

from dataclasses import dataclass

from noloco.data.documents import DataError

MODES = ("stop", "restart")
REASON = "data stream exhausted"


@dataclass(frozen=True)
class StreamEndConfig:
    """What the stream end reads of a run's config: whether it stops, where rounds end, how ranks form workers."""

    stop: bool  # a streamed corpus (data.streaming) with data.stream_end=stop
    round_length: int  # steps between the boundaries a run may stop at: outer.every (H), or 1 for DDP (no rounds)
    processes: int  # inner.processes: ranks per worker
    steps: int  # the run's steps

    @classmethod
    def of(cls, cfg) -> StreamEndConfig:
        """From a run's config (``data.streaming``, ``data.stream_end``, ``outer.algo``, ``outer.every``,
        ``inner.processes``, ``steps``), already validated."""
        return cls(
            stop=bool(cfg.data.get("streaming")) and cfg.data.get("stream_end", "stop") == "stop",
            round_length=1 if cfg.outer.algo == "ddp" else int(cfg.outer.every),
            processes=int(cfg.inner.get("processes", 1) or 1),
            steps=int(cfg.steps),
        )


def stopped_record(end: StreamEndConfig, rank: int, exhausted_at: int, ended_at: int) -> dict:
    """``summary.json``'s ``stopped``: why and where the run ended before ``steps``. ``rank`` is the process's
    rank; with ``inner.processes > 1`` its worker is ``rank // processes`` and the rank is kept too."""
    record = {"reason": REASON, "worker": rank // end.processes, "exhausted_at_step": int(exhausted_at),
              "ended_at_step": int(ended_at), "steps": end.steps}  # fmt: skip
    if end.processes > 1:
        record["rank"] = rank
    return record


def describe(record: dict) -> str:
    """The record as one sentence (the run's printed line, the summary table)."""
    return (f"worker {record['worker']}'s data stream ran out at step {record['exhausted_at_step']}: the run "
            f"stopped at the end of that round, step {record['ended_at_step']} of steps={record['steps']} "
            "(data.stream_end=stop)")  # fmt: skip


class StreamEnd:
    """One worker's side of ``data.stream_end=stop``: at each round boundary, the run's agreement on whether a
    worker's stream has run out; ``stopped`` holds the :func:`stopped_record` once it has (the same on every
    worker). The worker that marks checkpoints complete announces it and ends the progress bar there."""

    def __init__(self, end: StreamEndConfig, sampler, backend, progress=None):
        self.end, self.sampler, self.backend, self.progress = end, sampler, backend, progress
        self.every = end.round_length
        self.stopped: dict | None = None

    @classmethod
    def of(cls, cfg, sampler, backend, progress=None) -> StreamEnd | None:
        """None unless the run (its config ``cfg``, :meth:`StreamEndConfig.of`) stops when a stream runs out:
        other runs pay nothing."""
        end = StreamEndConfig.of(cfg)
        return cls(end, sampler, backend, progress) if end.stop and hasattr(sampler, "ends") else None

    def ends_here(self, step: int) -> bool:
        """Whether the run ends at ``step`` (called once per step, after its batch was drawn)."""
        if step % self.every:
            return False
        ends = self.sampler.ends  # the steps whose batch reached the end of this worker's shard
        agreed = self.backend.agree_stop(step, ends[0] if ends else None)
        if agreed is None:
            return False
        self.stopped = stopped_record(self.end, agreed[0], agreed[1], step)
        if self.progress is not None and self.backend.marks_complete():
            self.progress.end_at(step, f"noloco: {describe(self.stopped)}")
        return True


def check_resume(cfg, where, step: int, ends_by_rank: dict[int, list[int]]) -> None:
    """DataError when resuming the checkpoint of ``step`` with the run config ``cfg`` would end at once: ``stop``
    with a worker's stream already run out by a round boundary (the stop of an earlier run, whose position the
    checkpoint holds)."""
    end = StreamEndConfig.of(cfg)
    if not end.stop or step % end.round_length:
        return
    exhausted = sorted((ends[0], rank) for rank, ends in ends_by_rank.items() if ends and ends[0] <= step)
    if exhausted:
        at, rank = exhausted[0]
        record = stopped_record(end, rank, at, step)
        raise DataError(f"resume={where}: worker {record['worker']}'s data stream ran out at step {at}, and step "
                        f"{step} ends a round: with data.stream_end=stop the run ends there; pass "
                        "data.stream_end=restart to train on (its shard starts over)")  # fmt: skip
