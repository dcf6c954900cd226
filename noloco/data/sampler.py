"""Deterministic batches of a tokenized corpus.

Batches are drawn without state: the windows of worker ``w`` at step ``s`` come from a generator seeded with
``(seed, w, s)`` (:func:`noloco.gossip.schedule.round_seed`), so resuming at step ``s`` reproduces the data stream
exactly. A batch converts only its own windows to int64 (``device=`` copies them through pinned memory without
blocking). Held-out batches are fixed windows evenly spaced over the held-out split.
"""

from __future__ import annotations

import numpy as np
import torch

from noloco.data.documents import DataError
from noloco.gossip.schedule import round_seed


def to_device(windows: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``windows`` on ``device``: as is for the CPU; to CUDA through pinned memory, without blocking."""
    if device is None:
        return windows
    device = torch.device(device)
    if device.type == "cpu":
        return windows
    if device.type == "cuda" and torch.cuda.is_available():
        # pin_memory() takes a block of the caching host allocator, which is not reused before the copy ends
        return windows.pin_memory().to(device, non_blocking=True)
    return windows.to(device)


def _token_array(tokens: np.ndarray, what: str, seq_len: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"the {what} split must be a 1-D token array, got shape {tokens.shape}")
    if tokens.size < seq_len + 2:
        raise DataError(f"the {what} split has {tokens.size} tokens, fewer than data.seq_len+2={seq_len + 2}")
    return tokens


def _windows(tokens: np.ndarray, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int64 (len(starts), seq_len+1) windows gathered from ``tokens`` (converting only those)."""
    index = starts.numpy()[:, None] + np.arange(seq_len + 1)
    return torch.from_numpy(tokens[index].astype(np.int64))


class BatchSampler:
    """Deterministic random windows: ``batch(worker, step)`` depends only on its arguments."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens = _token_array(tokens, "training", seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(
        self, worker: int, step: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64, on ``device`` (default: the CPU)."""
        generator = torch.Generator().manual_seed(round_seed(self.seed, step, f"data/{worker}"))
        starts = torch.randint(0, self.tokens.size - self.seq_len - 1, (self.batch_size,), generator=generator)
        windows = to_device(_windows(self.tokens, starts, self.seq_len), device)
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out windows, evenly spaced over the split (the same for every worker and run)."""
    tokens = _token_array(tokens, "held-out", seq_len)
    last = tokens.size - seq_len - 1
    starts = torch.linspace(0, last, n_batches * batch_size).long().clamp_(0, last)
    windows = to_device(_windows(tokens, starts, seq_len), device)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
