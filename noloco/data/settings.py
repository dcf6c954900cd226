"""The ``data`` config section's one check: sizes, the vocabulary bound, the source and its files, streaming.

The config runs it before any work starts (a bad value is one line naming the key); nothing here reads a file
beyond asking whether a path exists.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping
from pathlib import Path

from noloco.data.stream_end import MODES as STREAM_END_MODES


def _exists(spec) -> bool:
    """Every path of ``spec`` (one, or a list; globs allowed) names something that exists."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    return bool(specs) and all(Path(str(s)).expanduser().exists() or glob.glob(str(Path(str(s)).expanduser()))
                               for s in specs)  # fmt: skip


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_data_settings(data: Mapping) -> None:
    """ValueError, naming the key, for the first value of ``data`` (the config's ``data`` section) that is refused."""

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(message)

    require(data["seq_len"] >= 2 and data["batch_size"] >= 1, "data.seq_len must be >= 2 and data.batch_size >= 1")
    bound, size = data["max_vocab_size"], data["vocab_size"]
    require(_integer(bound) and bound >= 2, f"data.max_vocab_size must be an integer >= 2, got {bound!r}")
    require(_integer(size) and 2 <= size <= bound, f"data.vocab_size={size!r} is not in [2, data.max_vocab_size="
            f"{bound}] (raise data.max_vocab_size for a larger vocabulary)")  # fmt: skip
    source = data["source"]
    if source == "files":
        require(bool(data["path"]), "data.source=files needs data.path")
        require(_exists(str(data["path"])), f"data.path={data['path']!r} does not exist")
    if source == "hf":
        require(bool(data["hf_path"]), "data.source=hf needs data.hf_path (a builder such as json or parquet with "
                "data.hf_files, a dataset folder, or a hub name)")  # fmt: skip
        files = data["hf_files"]
        require(files is None or _exists(files), f"data.hf_files={files!r} matches no file")
        require(
            isinstance(data["text_field"], str) and bool(data["text_field"]), "data.text_field must be a field name"
        )
    require(isinstance(data["streaming"], bool), f"data.streaming must be true or false, got {data['streaming']!r}")
    require(not data["streaming"] or source == "hf", "data.streaming=true needs data.source=hf")
    require(_integer(data["stream_sample"]) and data["stream_sample"] >= 1, "data.stream_sample must be >= 1")
    end = data["stream_end"]
    require(end in STREAM_END_MODES, f"data.stream_end={end!r} is not one of {', '.join(STREAM_END_MODES)}")
    tokenizer = data["tokenizer"]
    require(tokenizer is None or Path(str(tokenizer)).expanduser().exists(),
            f"data.tokenizer={tokenizer!r}: no such file or folder")  # fmt: skip
