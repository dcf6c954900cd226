"""Backends: how a run's workers are started and reach each other (docs/architecture.md).

``local`` (threads of one process over the in-process fabric, the default), ``torch`` (a process per
worker over torch.distributed) and ``hivemind`` (one peer of an open swarm per process). Each module
has a ``launch(cfg, run_dir=None, resume_from=None, resume_step=0, quiet=False)`` and a
:class:`~noloco.train.backends.base.Backend`; :func:`launch` picks one by ``cfg.backend``. Modules are
imported only when used, so a local run loads no libp2p code.
"""

from __future__ import annotations

import importlib

from noloco.train.backends.base import Backend

#: backend name → module holding its ``launch`` (the one line a new backend adds)
LAUNCHERS = {
    "local": "noloco.train.backends.local",
    "torch": "noloco.train.backends.distributed",
    "hivemind": "noloco.train.backends.hivemind",
}


def launch(cfg, **kwargs):
    """Run ``cfg`` on the backend ``cfg.backend`` names; returns its summary (None where a rank has none)."""
    return importlib.import_module(LAUNCHERS[cfg.backend]).launch(cfg, **kwargs)


__all__ = ["LAUNCHERS", "Backend", "launch"]
