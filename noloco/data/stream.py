"""``data.streaming=true``: a ``datasets`` dataset streamed, each worker its own shard.

Nothing is tokenized ahead: the first ``data.stream_sample`` documents of the stream are read at start-up and split
by document as usual (held-out split; the BPE tokenizer is trained on the rest;
:func:`noloco.data.corpus.prepare_corpus` returns a :class:`StreamingCorpus`); then each worker streams its own shard
of the dataset
(``datasets.distributed.split_dataset_by_node``, by rank) through a :class:`StreamSampler`, skipping the held-out
documents, and packs the tokens into consecutive windows. Its position is ``StreamSampler.state_dict()``: a checkpoint
that stores it resumes the stream exactly. :func:`stream_summary` is what ``summary.json`` says of the streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from noloco.data.documents import DataError, text_chunks, utf8
from noloco.data.hf import check_text, check_text_field, dataset_label, open_dataset
from noloco.data.sampler import to_device
from noloco.data.tokens import TokenizedCorpus

STREAM_FORMAT = 1


def text_digest(text: str) -> str:
    """The BLAKE2b-128 hex digest of a document's text: how a stream knows a held-out document again."""
    return hashlib.blake2b(utf8(text), digest_size=16).hexdigest()


@dataclass
class StreamingCorpus(TokenizedCorpus):
    """A ``data.streaming`` corpus: ``train``/``val`` are the tokens of the start-up sample (the held-out
    split evaluates; the training part only gives the unigram baseline); workers stream through
    :meth:`sampler`."""

    stream: dict = field(default_factory=dict)
    eot_id: int = 0
    held_out: frozenset = frozenset()

    def sampler(self, rank: int, world: int, seq_len: int, batch_size: int) -> StreamSampler:
        return StreamSampler(self.stream, rank, world, seq_len, batch_size, self.tokenizer_path, self.eot_id,
                             self.held_out)  # fmt: skip

    def check_shards(self, ranks, world: int) -> None:
        """DataError naming the first of ``ranks`` whose shard (``rank % world``, as :class:`StreamSampler` cuts
        it) holds no training document: it could neither train nor start over. Opens the stream once and reads
        each shard up to its first training document (at start-up, before the run folder exists)."""
        from datasets.distributed import split_dataset_by_node

        opts = {**self.stream, "streaming": True}
        ds, _ = open_dataset(opts, streaming=True)
        name = check_text_field(ds, opts)
        ds = ds.select_columns([name])
        for rank in ranks:
            shard = split_dataset_by_node(ds, rank=rank % world, world_size=world)
            where = f"{dataset_label(opts)} (worker {rank}'s shard)"
            if not any(text_digest(check_text(row[name], where, name)) not in self.held_out for row in shard):
                raise DataError(f"{dataset_label(opts)}: worker {rank}'s shard (of {world}) holds no training "
                                "documents (an empty file, fewer rows than shards, or all of it held out): use fewer "
                                "workers or more data")  # fmt: skip


class StreamSampler:
    """Batches of one worker from its shard of a streamed dataset: consecutive windows of ``seq_len + 1``
    tokens of its documents (each followed by the end-of-text token), held-out documents skipped.

    Worker ``rank`` reads shard ``rank % world``. ``batch(worker, step)`` returns the next ``batch_size``
    windows (the arguments only check that it is this worker's). The position, :meth:`state_dict`
    (JSON-able: the epoch, the dataset's own ``state_dict()`` before the current document, and how many
    of its tokens were used), restores with :meth:`load_state_dict` to continue exactly: the same batches
    as if the run had not stopped. At the end of its shard a worker starts it again (the next epoch);
    ``ends`` lists the steps whose batch crossed an end, and :meth:`report` goes into ``summary.json``.
    """

    def __init__(self, opts: dict, rank: int, world: int, seq_len: int, batch_size: int, tokenizer_path,
                 eot_id: int, held_out: frozenset = frozenset()):  # fmt: skip
        from tokenizers import Tokenizer

        self.opts, self.rank, self.world = dict(opts), int(rank), int(world)
        self.shard = self.rank % self.world  # a swarm peer's rank may be any number
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.tokenizer, self.eot_id, self.held_out = Tokenizer.from_file(str(tokenizer_path)), int(eot_id), held_out
        self.epoch = 0
        self.position: dict | None = None  # the dataset's state before the current document (None: its start)
        self.offset = 0  # tokens of the current document already used
        self.ends: list[int] = []  # the steps whose batch reached the end of the shard (and started it again)
        self._step = 0
        self._dataset = None
        self._iterator: Iterator | None = None
        self._tokens = np.zeros(0, dtype=np.int64)  # the current document's tokens

    # --- the stream

    def _open(self):
        from datasets.distributed import split_dataset_by_node

        ds, _ = open_dataset({**self.opts, "streaming": True}, streaming=True)
        name = check_text_field(ds, self.opts)
        ds = split_dataset_by_node(ds.select_columns([name]), rank=self.shard, world_size=self.world)
        ds.set_epoch(self.epoch)
        return ds, name

    def _restart(self, state: dict | None) -> None:
        self._dataset, self._name = self._open()
        if state is not None:
            self._dataset.load_state_dict(state)
        self._iterator = iter(self._dataset)

    def _encode(self, text: str) -> np.ndarray:
        pieces = list(text_chunks(text))
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encode(pieces, add_special_tokens=False)]
        return np.concatenate([*ids, np.asarray([self.eot_id], dtype=np.int64)])

    def _next_document(self) -> None:
        """Make the next training document of the shard current (offset 0), wrapping to the next epoch."""
        empty_epoch = True
        while True:
            if self._iterator is None:
                self._restart(self.position)
            state = self._dataset.state_dict()
            example = next(self._iterator, None)
            if example is None:
                if empty_epoch and self.position is None:
                    raise DataError(f"{dataset_label(self.opts)}: worker {self.rank}'s shard (of {self.world}) "
                                    "holds no training documents")  # fmt: skip
                self.epoch, self.position, self._iterator, empty_epoch = self.epoch + 1, None, None, True
                self.ends.append(self._step)
                continue
            where = f"{dataset_label(self.opts)} (worker {self.rank}'s shard)"
            text = check_text(example[self._name], where, self._name)
            if text_digest(text) in self.held_out:
                continue
            self.position, self.offset, self._tokens = state, 0, self._encode(text)
            return

    # --- batches

    def batch(self, worker: int, step: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        if worker != self.rank:
            raise ValueError(f"this stream sampler is worker {self.rank}'s, not worker {worker}'s")
        self._step = int(step)
        need = self.batch_size * (self.seq_len + 1)
        parts, have = [], 0
        if self._iterator is None and self.position is not None:  # resumed: read the current document again
            self._restart(self.position)
            self._iterator_document()
        while have < need:
            if self.offset >= self._tokens.size:
                self._next_document()
            take = min(need - have, self._tokens.size - self.offset)
            parts.append(self._tokens[self.offset : self.offset + take])
            self.offset += take
            have += take
        windows = torch.from_numpy(np.concatenate(parts)).view(self.batch_size, self.seq_len + 1)
        windows = to_device(windows, device)
        return windows[:, :-1], windows[:, 1:]

    def _iterator_document(self) -> None:
        """After a restore: the current document is the first the restored dataset yields."""
        offset = self.offset
        example = next(self._iterator)
        self._tokens = self._encode(check_text(example[self._name], dataset_label(self.opts), self._name))
        self.offset = offset

    # --- position

    def state_dict(self) -> dict:
        """Where the stream is (JSON-able, for a checkpoint)."""
        return {"version": STREAM_FORMAT, "rank": self.rank, "world": self.world, "epoch": self.epoch,
                "position": self.position, "offset": self.offset, "ends": list(self.ends)}  # fmt: skip

    def report(self) -> dict:
        """What ``summary.json`` says of this worker's stream: its shard, passes begun, the steps it ended at."""
        return {"shard": self.shard, "shards": self.world, "epoch": self.epoch, "ends": list(self.ends)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STREAM_FORMAT or state.get("world") != self.world or state.get("rank") != self.rank:
            raise ValueError(
                f"stream position of worker {state.get('rank')} of {state.get('world')} "
                f"(format {state.get('version')}); this is worker {self.rank} of {self.world}"
            )
        self.epoch, self.position, self.offset = int(state["epoch"]), state["position"], int(state["offset"])
        self.ends = [int(s) for s in state.get("ends", [])]  # (absent from checkpoints written before it was kept)
        self._iterator, self._dataset, self._tokens = None, None, np.zeros(0, dtype=np.int64)


def stream_summary(steps: int, streams: list[dict | None], stopped: dict | None = None) -> dict:
    """``summary.json``'s keys for a streamed corpus (``data.streaming``), from each worker's
    ``StreamSampler.report()`` (None: not streamed): nothing for a corpus read ahead. A shard that ended before
    ``steps`` was started again; ``stream_note`` says whose, at which steps, and that its text was repeated.
    ``stopped`` (``data.stream_end=stop``, :func:`noloco.data.stream_end.stopped_record`): the run ended at the
    end of that round instead, and ``stopped`` says why and where."""
    if not any(streams):
        return {}
    out = {
        "stream_shards": [s and [s["shard"], s["shards"]] for s in streams],
        "stream_epochs_by_worker": [s and s["epoch"] + 1 for s in streams],
        "stream_ends_by_worker": [s and s["ends"] for s in streams],
    }
    ended = [(rank, s["ends"]) for rank, s in enumerate(streams) if s and s["ends"]]
    if ended:
        where = "; ".join(f"worker {rank} at step{'s' * (len(ends) > 1)} {', '.join(map(str, ends))}"
                          for rank, ends in ended)  # fmt: skip
        out["stream_note"] = (f"data.streaming: {len(ended)} of {len(streams)} workers' shards ended before "
                              f"steps={steps} and were started again ({where}): their documents were trained on "
                              "more than once")  # fmt: skip
    if stopped is not None:
        out["stopped"] = stopped
        out["stream_note"] = (
            f"data.streaming: worker {stopped['worker']}'s shard ended at step "
            f"{stopped['exhausted_at_step']}, so the run stopped at the end of that round, step "
            f"{stopped['ended_at_step']} of steps={steps} (data.stream_end=stop)"
            + (f"; until then shards that ended were started again ({where})" if ended else "")
        )
    return out
