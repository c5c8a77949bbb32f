"""``cluster.kind`` value -> the :class:`~fsdp_workflow.backends.base.Backend` that runs it.

The one place a backend is registered and the one place that asks which kind a run is
(:func:`is_slurm`, for the few callers that only make sense on Slurm: the Python API's
handles, ``fsdp_workflow.check``).

Nothing lists the backends: a module of this package (or a subpackage's ``backend`` module)
that defines ``BACKEND`` is one, found here with ``pkgutil``. Adding a backend is that module,
its value in ``config/schema.py``'s ``ClusterKind`` and a ``conf/cluster/<name>.yaml``: three files
(docs/contributing.md, "Architecture").
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Dict, Iterator, Optional

from fsdp_workflow.backends.base import Backend
from fsdp_workflow.config.record import open_run
from fsdp_workflow.config.schema import ClusterKind, WorkflowConfig

_PACKAGE = __name__.rsplit(".", 1)[0]


def _found() -> Iterator[Backend]:
    """Every ``BACKEND`` of this package's modules and of its subpackages' ``backend`` modules, by name."""
    here = importlib.import_module(_PACKAGE)
    for info in sorted(pkgutil.iter_modules(here.__path__), key=lambda m: m.name):
        if info.name == "registry":
            continue
        name = f"{_PACKAGE}.{info.name}" + (".backend" if info.ispkg else "")
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a subpackage without a backend module is not a backend; a broken one is an error
                raise
            continue
        backend = getattr(module, "BACKEND", None)
        if backend is not None:
            yield backend


BACKENDS: Dict[str, Backend] = {b.kind: b for b in _found()}


def register(backend: Backend) -> None:
    """Add (or replace) the backend for ``backend.kind`` (tests register a fake scheduler this way)."""
    BACKENDS[backend.kind] = backend


def backend_for(cfg: WorkflowConfig) -> Backend:
    """The backend ``cfg.cluster.kind`` names.

    Raises:
        ValueError: a kind with no backend registered (a programming error, caught by tests/backends).
    """
    kind = cfg.cluster.kind.value if isinstance(cfg.cluster.kind, ClusterKind) else str(cfg.cluster.kind)
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"cluster.kind={kind!r} has no backend; known: {', '.join(BACKENDS)}") from None


def backend_of_run(cfg: Optional[WorkflowConfig]) -> Backend:
    """The backend whose jobs a run's ``jobs.txt`` lists: only a queued backend writes it.

    The run's own when it queues; else the first queued backend registered: a local run's
    directory holds the batch scripts too, and ``bash submit.sh`` submits it later; and a run
    whose ``config.yaml`` does not load (``cfg`` None) says nothing of its kind.
    """
    own = backend_for(cfg) if cfg is not None else None
    if own is not None and own.queued:
        return own
    return next(b for b in BACKENDS.values() if b.queued)


def is_slurm(cfg: WorkflowConfig) -> bool:
    """The run goes to Slurm: only this module asks; everyone else asks the backend."""
    return backend_for(cfg).kind == ClusterKind.slurm.value


def live_problem(run_dir: Path) -> Optional[str]:
    """Why a chain recorded in ``run_dir`` still runs, asked of every backend (a local plan over a run
    whose Slurm chain is queued is refused too); None when none does."""
    layout = open_run(run_dir).layout
    for backend in BACKENDS.values():
        problem = backend.live(layout)
        if problem:
            return problem
    return None


__all__ = ["BACKENDS", "backend_for", "backend_of_run", "is_slurm", "live_problem", "register"]
