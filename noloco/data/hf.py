"""``data.source=hf``: a ``datasets`` dataset as documents.

``datasets.load_dataset(data.hf_path, data.hf_name, data_files=data.hf_files, split=data.hf_split)``, the text in
``data.text_field``. Local files are read shard by shard, one shard a file, and a row is named ``<file>#<row>`` as
``data.source=files`` names it, so the same ``.jsonl`` or ``.parquet`` files give the same split, tokens and
batches either way. Every value is checked to be text before it is used (:func:`check_text`). Streaming the
dataset is :mod:`noloco.data.stream`. See docs/your-model-and-data.md.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from noloco.data.documents import READ_BYTES, DataError, Document, control_reason, first_line


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("data.source=hf needs datasets: pip install 'noloco[hf]'") from None
    datasets.utils.logging.disable_progress_bar()
    return datasets


def resolve_files(spec) -> list[str]:
    """Local data files of ``data.hf_files`` (a file, folder, glob or list of them), as ``data.source=files``
    orders and names them."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for one in specs:
        root = Path(os.path.expanduser(str(one)))
        if root.is_dir():
            paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif root.is_file():
            paths = [root]
        else:
            matches = glob.glob(os.path.expanduser(str(one)), recursive=True)
            paths = sorted(Path(p) for p in matches if Path(p).is_file())
        if not paths:
            raise DataError(f"data.hf_files={one!r} matches no file")
        out += [str(p) for p in paths]
    return out


def dataset_label(opts: dict) -> str:
    """How an error names the dataset of the ``data.hf_*`` options ``opts``."""
    return f"data.hf_path={opts.get('path')!r}" + (f" data.hf_name={opts['name']!r}" if opts.get("name") else "")


def open_dataset(opts: dict, streaming: bool):
    """(dataset, local files or None) of the ``data.hf_*`` options; DataError (one line) if it cannot load."""
    datasets = _datasets()
    if not opts.get("path"):
        raise DataError("data.source=hf needs data.hf_path (a builder such as json or parquet with data.hf_files, "
                        "a local dataset folder, or a hub name)")  # fmt: skip
    files = resolve_files(opts["files"]) if opts.get("files") else None
    try:
        ds = datasets.load_dataset(opts["path"], opts.get("name"), data_files=files, split=opts.get("split") or "train",
                                   streaming=streaming)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (missing builder, offline, bad split, ...)
        raise DataError(f"{dataset_label(opts)}: cannot load the dataset ({first_line(exc)})") from None
    if isinstance(ds, dict):  # no split given and several
        raise DataError(f"{dataset_label(opts)}: pick a split with data.hf_split ({', '.join(ds)})")
    return ds, files


def check_text_field(ds, opts: dict) -> str:
    """The text field; DataError naming the dataset's fields when it has no such field."""
    name = opts.get("text_field") or "text"
    names = list(ds.features) if ds.features is not None else None
    if names is None:  # a stream whose features are unknown until read
        first = next(iter(ds.take(1)), None)
        if first is None:
            raise DataError(f"{dataset_label(opts)}: the dataset has no rows")
        names = list(first)
    if name not in names:
        raise DataError(f"{dataset_label(opts)}: no {name!r} field (fields: {', '.join(map(str, names)) or 'none'}); "
                        "set data.text_field")  # fmt: skip
    return name


def check_text(value, where: str, name: str) -> str:
    """``value`` (the field ``name`` of a row, at ``where``) if it is text; DataError (one line) if not."""
    if value is None:
        raise DataError(f"{where}: {name!r} is null")
    if not isinstance(value, str):
        raise DataError(f"{where}: {name!r} is a {type(value).__name__}, not a string")
    reason = control_reason(value[: 4 * READ_BYTES]) or ("a NUL character" if "\x00" in value else None)
    if reason is not None:
        raise DataError(f"{where}: {name!r} has {reason}")
    return value


def dataset_rows(ds, name: str, where: str) -> Iterator[tuple[int, str]]:
    """(row, text) of a dataset's text column, read a batch at a time."""
    row = 0
    for batch in ds.select_columns([name]).iter(batch_size=512):
        for value in batch[name]:
            yield row, check_text(value, f"{where}: row {row}", name)
            row += 1


def hf_documents(opts: dict) -> list[Document]:
    """``data.source=hf``: the documents of the dataset (for ``data.streaming``: the first ``sample`` ones).

    Local files go shard by shard (a shard is a file) and rows are named ``<file>#<row>``, as
    ``data.source=files`` names the rows of a ``.jsonl`` or ``.parquet`` file.
    """
    if not opts:
        raise DataError("data.source=hf: prepare_corpus got none of the data.hf_* settings (its caller must pass "
                        "**noloco.data.corpus.corpus_options(cfg.data))")  # fmt: skip
    streaming = bool(opts.get("streaming"))
    ds, files = open_dataset(opts, streaming=streaming or bool(opts.get("files")))  # local files: read, not copied
    name = check_text_field(ds, opts)
    limit = int(opts.get("sample") or 10000) if streaming else None
    docs: list[Document] = []
    if files and not streaming and getattr(ds, "num_shards", None) == len(files):
        for i, path in enumerate(files):
            shard = ds.shard(num_shards=len(files), index=i)
            docs += [Document(f"{path}#{row}", text) for row, text in dataset_rows(shard, name, path)]
    else:
        label = f"{opts['path']}{'/' + opts['name'] if opts.get('name') else ''}:{opts.get('split') or 'train'}"
        rows = islice(dataset_rows(ds, name, dataset_label(opts)), limit)
        docs = [Document(f"{label}#{row}", text) for row, text in rows]
    if not any(doc.text and not doc.text.isspace() for doc in docs):
        raise DataError(f"{dataset_label(opts)}: no text in {name!r}")
    return docs
