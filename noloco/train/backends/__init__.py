"""Backends: how a run's workers are placed and reach each other (docs/architecture.md).

``local`` (threads of one process over the in-process fabric, the default), ``torch`` (a process per
worker over torch.distributed) and ``hivemind`` (one peer of an open swarm per process). Each module
has a ``launch(cfg, run_dir=None, resume_from=None, resume_step=0, quiet=False)`` that drives one
:class:`~noloco.train.run.Run` (the lifecycle every backend shares) and a
:class:`~noloco.train.backends.base.Backend` (what one worker asks of its backend). :data:`BACKENDS` is the one
list of backends: a module and the few facts about its placement that the config and the run need, so that
no module outside this package asks for a backend by name. Modules are imported only when used, so a local
run loads no libp2p code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from noloco.train.backends.base import Backend, WorkersReported


@dataclass(frozen=True)
class BackendSpec:
    """What the rest of the harness knows of a backend, without importing its module.

    ``module``: the module holding its ``launch``. ``workers_share_a_process``: all the run's workers are
    threads of one process (their models share its memory and cores). ``fixed_world``: the run's workers are
    ``workers`` ranks known from the start (an open swarm's are whoever is live). ``processes_per_worker``: a
    worker may be several processes (``inner.processes``). ``late_imports``: what its module imports only once a
    run starts (a supervisor, ``run.restarts``, imports them before it forks the run).
    """

    module: str
    workers_share_a_process: bool = False
    fixed_world: bool = True
    processes_per_worker: bool = False
    late_imports: tuple[str, ...] = ()


#: backend name → its spec (the one line a new backend adds)
BACKENDS: dict[str, BackendSpec] = {
    "local": BackendSpec("noloco.train.backends.local", workers_share_a_process=True),
    "torch": BackendSpec("noloco.train.backends.distributed", processes_per_worker=True),
    "hivemind": BackendSpec("noloco.train.backends.hivemind", fixed_world=False, late_imports=("hivemind",)),
}


def spec(cfg) -> BackendSpec:
    """The spec of the backend ``cfg.backend`` names (``local`` for a config without the key)."""
    return BACKENDS[cfg.get("backend", "local") if hasattr(cfg, "get") else cfg.backend]


def launch(cfg, **kwargs):
    """Run ``cfg`` on the backend ``cfg.backend`` names; returns its summary (None where a rank has none)."""
    return importlib.import_module(spec(cfg).module).launch(cfg, **kwargs)


__all__ = ["BACKENDS", "Backend", "BackendSpec", "WorkersReported", "launch", "spec"]
