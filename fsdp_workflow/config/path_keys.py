"""Path keys are made absolute at planning, against the directory the command runs in.

A relative path in ``config.yaml`` means another file wherever it is read next: the
prepare job on a node (its working directory is not the planner's), ``status`` or
``replan`` from another directory, a resume. So before anything is checked or written
(:func:`fsdp_workflow.plan.checks.check`), :func:`make_paths_absolute` turns each
path key into an absolute path (``~`` expanded):

- always, for the keys that only hold paths: ``run_dir``, ``data.path``, ``data.eval_path``,
  ``data.sources[i].path``, ``data.cache_dir``, ``consolidate.output_dir``,
  ``cluster.log_dir``, ``cluster.env_script``;
- where the value is a path rather than a name (it exists here, or is spelled with
  ``/``, ``.`` or ``~``): ``model.tokenizer`` (else a hub id), ``checkpoint.resume``
  (else ``auto``/``none``), ``container.image`` (else an image reference or a
  Charliecloud storage name) and the source of each ``container.binds`` entry.
  ``model.name_or_path`` is resolved by :mod:`.model_dir`.

:func:`path_problem` refuses a path that cannot work, naming the key: longer than the
filesystem allows, below a file, or (for a directory the run writes: ``run_dir``,
``consolidate.output_dir``, ``data.cache_dir``, ``cluster.log_dir``) on a read-only
filesystem or not writable. The planner would otherwise fail with an ``OSError``
traceback, or the job after the queue.
"""

from __future__ import annotations

import errno
import os
import re
from typing import List, Optional

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig

_NAMES_NOT_PATHS = ("auto", "none")  # checkpoint.resume's words
# A scheme then "://": what a data path given as a URL starts with. The data rules refuse it by name
# (fsdp_workflow/data/rules_path.py): made absolute, it was a local path that did not exist.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def absolute(path: str) -> str:
    """``path`` with ``~`` expanded, made absolute against the working directory (not normalised further)."""
    return os.path.abspath(os.path.expanduser(path))


def is_url(value: str) -> bool:
    """A value spelled as a URL (``hf://``, ``https://``, ``s3://``...): never a local path, never made one."""
    return bool(_URL.match(value.strip()))


def _is_path(value: str) -> bool:
    """A value that names a local path rather than a hub id, an image reference or a keyword."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or \
        _exists(os.path.expanduser(value))


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except (OSError, ValueError):  # missing, too long, a NUL byte
        return False
    return True


def _bind_absolute(entry: str) -> str:
    """``src[:dst[:opts]]`` with ``src`` absolute when it is a local path (else left for the bind check)."""
    src, sep, rest = entry.partition(":")
    return (absolute(src) + sep + rest) if src and _is_path(src) else entry


def make_paths_absolute(cfg: WorkflowConfig) -> None:
    """Make every path key of ``cfg`` absolute, in place (the module's rule); empty values are left to the rules."""
    if cfg.run_dir.strip():
        cfg.run_dir = absolute(cfg.run_dir)
    d = cfg.data
    if d.path and not is_url(d.path):
        d.path = absolute(d.path)
    if d.eval_path and not is_url(d.eval_path):
        d.eval_path = absolute(d.eval_path)
    for source in d.sources:
        if source.path and not is_url(source.path):
            source.path = absolute(source.path)
    if d.cache_dir:
        d.cache_dir = absolute(d.cache_dir)
    if cfg.consolidate.output_dir:
        cfg.consolidate.output_dir = absolute(cfg.consolidate.output_dir)
    if cfg.cluster.log_dir:
        cfg.cluster.log_dir = absolute(cfg.cluster.log_dir)
    if cfg.cluster.env_script:
        cfg.cluster.env_script = absolute(cfg.cluster.env_script)
    if cfg.model.tokenizer and _is_path(cfg.model.tokenizer):
        cfg.model.tokenizer = absolute(cfg.model.tokenizer)
    resume = (cfg.checkpoint.resume or "").strip()
    if resume and resume.lower() not in _NAMES_NOT_PATHS and _is_path(resume):
        cfg.checkpoint.resume = absolute(resume)
    ct = cfg.container
    if ct.image and _is_path(ct.image):
        ct.image = absolute(ct.image)
    ct.binds = [_bind_absolute(b) for b in ct.binds]


def _too_long(path: str) -> Optional[str]:
    """Why ``path`` is longer than its filesystem allows (a name past NAME_MAX, the whole past PATH_MAX)."""
    where = _nearest_existing(path)
    try:
        name_max = os.pathconf(where, "PC_NAME_MAX")
        path_max = os.pathconf(where, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long_names = [n for n in path.split(os.sep) if len(os.fsencode(n)) > name_max]
    if long_names:
        name = long_names[0]
        return (f"[Errno {errno.ENAMETOOLONG}] a name in it is {len(os.fsencode(name))} bytes long "
                f"({name[:24]}...): the filesystem allows {name_max}")
    if len(os.fsencode(path)) >= path_max:
        return f"[Errno {errno.ENAMETOOLONG}] it is {len(os.fsencode(path))} bytes long: the system allows {path_max - 1}"
    return None


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (``/`` at worst)."""
    current = path
    while not _exists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    return current


def path_problem(key: str, value: str, writes: bool, fix: Optional[str] = None) -> Optional[Issue]:
    """Why the path in ``key`` cannot work, as an issue naming the key; None when it can.

    Args:
        key: the config key (``run_dir``, ``data.cache_dir``...).
        value: its value as given (``~`` and relative paths allowed).
        writes: the run creates and writes this directory: it must be creatable and writable.
        fix: the fix to give instead of the generic one (a key with its own rule: ``run_dir``).

    Returns:
        The issue: a name or the whole path too long, a file on the way, or (``writes``)
        a read-only filesystem or a directory this user may not write.
    """
    if not str(value).strip():
        return None
    path = absolute(str(value))
    why = _too_long(path)
    if why:
        return Issue(key, value, why, fix or f"{key}=PATH naming a shorter path")
    where = _nearest_existing(path)
    if where != path and not os.path.isdir(where):
        return Issue(key, value, f"lies below {where}, which is a file, not a directory",
                     fix or f"{key}=PATH naming a path below a directory")
    if not writes:
        return None
    if where == path and not os.path.isdir(path):
        return Issue(key, value, "is a file, not a directory: the run writes a directory here",
                     fix or f"{key}=DIR naming a directory (it is created)")
    # Nothing of the path exists here but "/": it may be the cluster's filesystem, planned from elsewhere.
    if where != os.path.dirname(where) and not os.access(where, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        what = (f"{where} is on a read-only file system" if read_only else
                f"{where} is not writable by this user (mode {oct(os.stat(where).st_mode & 0o777)})")
        return Issue(key, value, f"{what}: the run writes into {path}",
                     f"{key}=DIR on a writable file system (mount it read-write, or write elsewhere)")
    return None


def path_issues(cfg: WorkflowConfig) -> List[Issue]:
    """:func:`path_problem` for every path key but ``run_dir`` (the planner's own rule checks it)."""
    d = cfg.data
    written = {"data.cache_dir": d.cache_dir, "consolidate.output_dir": cfg.consolidate.output_dir,
               "cluster.log_dir": cfg.cluster.log_dir}
    tokenizer = cfg.model.tokenizer if cfg.model.tokenizer and os.path.isabs(cfg.model.tokenizer) else None
    read = {"data.path": d.path, "data.eval_path": d.eval_path, "model.tokenizer": tokenizer,
            "cluster.env_script": cfg.cluster.env_script,
            **{f"data.sources[{i}].path": s.path for i, s in enumerate(d.sources)}}
    issues = [path_problem(key, value, writes=True) for key, value in written.items() if value]
    issues += [path_problem(key, value, writes=False) for key, value in read.items() if value and not is_url(value)]
    return [i for i in issues if i is not None]
