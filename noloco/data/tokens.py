"""Token files: a corpus tokenized once into its cache folder and memory-mapped after.

``train.bin`` and ``val.bin`` in the cache folder are raw arrays of token ids (nanoGPT style), ``uint16`` while
the vocabulary fits in 16 bits, else ``uint32`` (``meta.json`` records the dtype, e.g. ``"<u2"``), each document
followed by the end-of-text token. They are written once, streamed, and opened read-only with ``np.memmap``: a run
holds only the pages it touches. The folder is keyed by the documents and settings (:func:`cache_key`), so the
second run starts in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from noloco.data.documents import CHUNK_CHARS, Document, text_chunks, utf8
from noloco.data.tokenizer import EOT, UserTokenizer

FORMAT_VERSION = 2  # 2: raw train.bin/val.bin token files (dtype in meta.json); 1: train.npy/val.npy
BATCH_CHARS = 2 << 20  # characters per encode_batch call (it takes about 100 bytes a character)


@dataclass
class TokenizedCorpus:
    """Token arrays (read-only memory maps) of the training and held-out splits, and their tokenizer."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: Path
    train_documents: int
    val_documents: int

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))

    def unigram_loss(self, targets: torch.Tensor) -> float:
        """Cross-entropy (nats/token) on ``targets`` of the add-one unigram model of the training split."""
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        step = 1 << 24
        for i in range(0, self.train.size, step):
            counts += np.bincount(self.train[i : i + step], minlength=self.vocab_size)[: self.vocab_size]
        counts = counts.astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[targets.reshape(-1).cpu().numpy()].mean())


def cache_key(docs: list[Document], vocab_size: int, eval_fraction: float) -> str:
    """The token cache folder's name: a digest of the format, the settings and every document's name and text."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"v{FORMAT_VERSION}|{vocab_size}|{eval_fraction}".encode())
    for doc in docs:
        digest.update(utf8(doc.name))
        inner = hashlib.blake2b(digest_size=16)
        for i in range(0, len(doc.text), CHUNK_CHARS):  # the digest of the whole text, a MiB at a time
            inner.update(doc.text[i : i + CHUNK_CHARS].encode())
        digest.update(inner.digest())
    return digest.hexdigest()


def atomic_save(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it to ``path`` (none left on failure)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids below ``vocab_size``: uint16 up to 65535 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _encode_to(tokenizer, docs: list[Document], eot_id: int, dtype: np.dtype, out) -> int:
    """Write the tokens of ``docs`` (each followed by ``eot_id``) to the binary file ``out``; the count.

    Each document goes in pieces of at most ``CHUNK_CHARS`` characters, pieces in batches of about
    ``BATCH_CHARS``, so memory is bounded whatever the length of a document or line."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    eot = np.asarray([eot_id], dtype=dtype).tobytes()
    written = 0
    batch: list[str] = []
    ends: list[bool] = []
    size = 0

    def flush() -> None:
        nonlocal written, size
        for enc, last in zip(encode(batch), ends):
            ids = np.asarray(enc.ids, dtype=dtype)
            out.write(ids.tobytes())
            written += ids.size
            if last:
                out.write(eot)
                written += 1
        batch.clear()
        ends.clear()
        size = 0

    for doc in docs:
        pieces = text_chunks(doc.text)
        piece = next(pieces)
        for following in pieces:
            batch.append(piece)
            ends.append(False)
            size += len(piece)
            piece = following
            if size >= BATCH_CHARS:
                flush()
        batch.append(piece)
        ends.append(True)
        size += len(piece)
        if size >= BATCH_CHARS:
            flush()
    if batch:
        flush()
    return written


def write_tokens(path: Path, tokenizer, docs: list[Document], eot_id: int, dtype: np.dtype) -> int:
    """The token file ``path`` of ``docs`` (each followed by ``eot_id``), written atomically; its token count."""
    count = 0

    def write(tmp: str) -> None:
        nonlocal count
        with open(tmp, "wb") as out:
            count = _encode_to(tokenizer, docs, eot_id, dtype, out)

    atomic_save(path, write)
    return count


def _open_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray | None:
    """The token file as a read-only memory map, or None when it is missing or not ``count`` tokens long."""
    try:
        if path.stat().st_size != count * dtype.itemsize:
            return None
    except OSError:
        return None
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def load_token_cache(folder: Path) -> TokenizedCorpus | None:
    """The corpus a cache folder holds (token files memory-mapped), or None when it is missing or incomplete."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        train = _open_tokens(folder / "train.bin", dtype, int(meta["train_tokens"]))
        val = _open_tokens(folder / "val.bin", dtype, int(meta["val_tokens"]))
        if train is None or val is None or not (folder / "tokenizer.json").is_file():
            return None
        return TokenizedCorpus(
            train=train,
            val=val,
            vocab_size=int(meta["vocab_size"]),
            tokenizer_path=folder / "tokenizer.json",
            train_documents=int(meta["train_documents"]),
            val_documents=int(meta["val_documents"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def split_meta(
    vocab: int,
    requested: int,
    dtype,
    train_docs: list[Document],
    val_docs: list[Document],
    train_tokens: int,
    val_tokens: int,
) -> dict:
    """The ``meta.json`` fields every token cache has: vocabulary, dtype, documents and tokens of each split."""
    return {
        "vocab_size": vocab,
        "requested_vocab_size": requested,
        "dtype": dtype.str,
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "held_out": [d.name for d in val_docs],
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
    }


def corpus_tokenizer(corpus: TokenizedCorpus) -> UserTokenizer:
    """The tokenizer a corpus was tokenized with, and its end-of-text id."""
    meta = corpus.tokenizer_path.parent / "meta.json"
    tokenizer = corpus.tokenizer()
    try:
        eot = int(json.loads(meta.read_text())["eot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        eot = tokenizer.token_to_id(EOT)
    return UserTokenizer(tokenizer, eot, str(corpus.tokenizer_path))
