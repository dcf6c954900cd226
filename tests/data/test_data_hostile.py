"""Data that is not text: every malformed ``data.source=files`` input is refused with one line
naming the file (and line or row) and the reason, never a traceback or silent garbage."""

import json

import pytest

from noloco.data.corpus import load_documents, prepare_corpus
from noloco.data.documents import DataError

PROSE = "The quick brown fox jumps over the lazy dog.\n" * 20


def refused(path, match):
    with pytest.raises(DataError, match=match) as info:
        load_documents("files", str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def write_jsonl(path, *lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else line.encode() + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ('"just a string"', r"a JSON str where an object with a 'text' field was expected"),
        ("[1, 2, 3]", "a JSON list where an object"),
        ("42", "a JSON int where an object"),
        ('{"body": "x"}', r"no 'text' field \(data\.text_field; fields: body\)"),
        ('{"text": null}', "'text' is null"),
        ('{"text": 0}', "'text' is a JSON int, not a string"),
        ('{"text": ["a", "b"]}', "'text' is a JSON list, not a string"),
        ('{"text": {"en": "hi"}}', "'text' is a JSON dict, not a string"),
        ('{"text": "bad \\ud800 surrogate"}', "unpaired UTF-16 surrogate"),
        ('{"text": "nul \\u0000 inside"}', "NUL character"),
    ],
)
def test_bad_json_lines_are_refused_with_their_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "c.jsonl", json.dumps({"text": PROSE}), "", line)
    message = refused(path, reason)
    assert f"{path}:3:" in message


def test_invalid_utf8_in_jsonl_names_line_and_column(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", json.dumps({"text": PROSE}), b'{"text": "caf\xe9"}\n')
    assert f"{path}:2: not UTF-8 text: byte 0xe9 at column 14" in refused(path, "not UTF-8")


def test_good_jsonl_still_loads_and_tolerates_a_bom_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", "\ufeff" + json.dumps({"text": "first"}), "", json.dumps({"text": ""}))
    docs = load_documents("files", str(path))
    assert [(d.name, d.text) for d in docs] == [(f"{path}#0", "first"), (f"{path}#2", "")]


def test_text_files_must_be_strict_utf8(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(PROSE.encode() + "Café au lait\n".encode("latin-1"))
    message = refused(latin1, "not UTF-8 text")
    assert f"{latin1}:21:" in message and "byte 0xe9" in message and "iconv" in message


def test_binary_files_are_not_text(tmp_path):
    with_nul = tmp_path / "image.md"
    with_nul.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert "NUL byte" in refused(with_nul, "binary data, not text")
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(range(128, 256)) * 40)
    refused(noise, "binary data, not text")
    controls = tmp_path / "controls.txt"
    controls.write_bytes(b"\x01\x02\x03\x04 abc " * 100)
    refused(controls, "control characters")


def test_a_multibyte_character_split_across_reads_is_fine(tmp_path, monkeypatch):
    from noloco.data import documents as data

    monkeypatch.setattr(data, "READ_BYTES", 7)
    path = tmp_path / "u.txt"
    text = "naïve café — 日本語 😀 " * 50
    path.write_text(text, encoding="utf-8")
    assert load_documents("files", str(path))[0].text == text
    cut = tmp_path / "truncated.txt"
    cut.write_bytes(text.encode()[:-3] + "😀".encode()[:2])
    refused(cut, "not UTF-8 text")


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty.parquet", "empty.md"])
def test_empty_files_are_refused(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    refused(tmp_path / name, "empty file")


def test_a_jsonl_of_blank_lines_is_an_empty_file(tmp_path):
    path = write_jsonl(tmp_path / "blank.jsonl", "", "  ")
    refused(path, "no JSON lines")


def test_whitespace_only_corpus_contains_no_text(tmp_path):
    (tmp_path / "a.txt").write_text("   \n\n")
    with pytest.raises(DataError, match="contains no text"):
        load_documents("files", str(tmp_path))


def test_bad_file_in_a_directory_is_named_and_fails_prepare(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(PROSE)
    (folder / "bad.txt").write_bytes(b"ok\n\xff\xfe garbage")
    with pytest.raises(DataError, match=r"bad\.txt:2: not UTF-8 text"):
        prepare_corpus("files", str(folder), vocab_size=300, cache_dir=tmp_path / "cache")


class TestParquet:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def write(self, path, table):
        self.pq.write_table(table, path)
        return path

    def test_good_parquet_loads_every_string_kind(self, tmp_path):
        pa = self.pa
        plain = pa.array(["alpha", "beta"], pa.string())
        for i, array in enumerate([plain, plain.cast(pa.large_string()), plain.dictionary_encode()]):
            path = self.write(tmp_path / f"t{i}.parquet", pa.table({"id": [1, 2], "text": array}))
            docs = load_documents("files", str(path))
            assert [(d.name, d.text) for d in docs] == [(f"{path}#0", "alpha"), (f"{path}#1", "beta")]

    def test_parquet_without_text_column(self, tmp_path):
        path = self.write(tmp_path / "t.parquet", self.pa.table({"body": ["a"], "id": [1]}))
        refused(path, r"no 'text' column \(columns: body, id\)")

    def test_column_less_parquet(self, tmp_path):
        path = self.write(tmp_path / "t.parquet", self.pa.table({}))
        refused(path, r"no 'text' column \(columns: none\)")

    def test_parquet_with_no_rows(self, tmp_path):
        path = self.write(tmp_path / "t.parquet", self.pa.table({"text": self.pa.array([], self.pa.string())}))
        refused(path, "no rows")

    @pytest.mark.parametrize("values, kind", [([1, 2], "int64"), ([b"a", b"b"], "binary"), ([1.5, 2.0], "double")])
    def test_text_column_that_is_not_strings(self, tmp_path, values, kind):
        path = self.write(tmp_path / "t.parquet", self.pa.table({"text": values}))
        refused(path, f"column 'text' holds {kind}, not strings")

    def test_null_text_names_the_row(self, tmp_path):
        path = self.write(tmp_path / "t.parquet", self.pa.table({"text": ["a", "b", None, "d"]}))
        refused(path, "row 2: 'text' is null")

    def test_nul_in_parquet_text(self, tmp_path):
        path = self.write(tmp_path / "t.parquet", self.pa.table({"text": ["fine", "bi\x00nary"]}))
        refused(path, "row 1: 'text' has a NUL character")

    def test_not_a_parquet_file(self, tmp_path):
        path = tmp_path / "t.parquet"
        path.write_text("this is no parquet file\n")
        refused(path, "not a readable parquet file")


def test_jsonl_files_take_their_text_from_data_text_field_and_a_missing_one_names_the_key(tmp_path):
    from noloco.data.corpus import corpus_options
    from noloco.train.config import load_config

    path = tmp_path / "a.jsonl"
    path.write_text('{"body": "first document"}\n{"body": "second one"}\n')
    cfg = load_config(["data.source=files", f"data.path={path}", "data.text_field=body"])
    options = corpus_options(cfg.data)
    assert [d.text for d in load_documents("files", str(path), options["hf"])] == ["first document", "second one"]
    with pytest.raises(DataError, match=r"no 'text' field \(data\.text_field; fields: body\)"):
        load_documents("files", str(path))
