"""Which host paths a containerised step sees, and how each runtime spells them.

Every path the config names (run directory, model, tokenizer, data, resume
checkpoint, NVMe offload, consolidated output, logs, cache variables set in
``container.env``) is bound at the same path inside the image, so the argv
and the resolved ``config.yaml`` mean the same thing on both sides. Inputs
are bound read-only (where the runtime can). One list, :func:`bind_list`, feeds
every runtime (Apptainer's ``--bind``, pyxis's ``--container-mounts``, Charliecloud's
``-b``; each spells a :class:`Bind` itself); the isolation test builds its
bubblewrap namespace from the same list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import List, Optional, Tuple

from fsdp_workflow.config.schema import OffloadDevice, WorkflowConfig, run_layout

# Variables that name a cache directory: when container.env sets one, its directory is bound.
CACHE_ENV_VARS = (
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
    "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME", "TMPDIR",
)
BIND_OPTIONS = ("rw", "ro")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Bind:
    """One host path made visible inside the image.

    Attributes:
        src: absolute host path.
        dst: absolute path inside the image (the same as ``src`` for derived binds).
        read_only: bind read-only (``ro``); inputs are, outputs are not.
        key: the config key it came from, for error messages.
    """

    src: str
    dst: str
    read_only: bool
    key: str


def _absolute(path: str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _glob_root(path: str) -> str:
    """A glob binds the directory above its first wildcard: that is what the step lists."""
    parts = PurePosixPath(path).parts
    for i, part in enumerate(parts):
        if any(c in part for c in _GLOB_CHARS):
            return str(PurePosixPath(*parts[:i])) if i else "/"
    return path


def parse_bind(spec: str, key: str = "container.binds") -> Bind:
    """Parse a ``container.binds`` entry, ``src[:dst[:ro|rw]]`` (Apptainer's syntax).

    Raises:
        ValueError: not absolute, an unknown option, or too many fields; the message names the fix.
    """
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"{key}: {spec!r} is not src[:dst[:ro|rw]]; paths holding ':' or ',' cannot be bound, "
                         "bind a parent directory (or a symlink without them) instead")
    src = parts[0]
    dst = parts[1] if len(parts) > 1 and parts[1] else src
    opt = parts[2] if len(parts) > 2 else "rw"
    if not src.startswith("/") or not dst.startswith("/"):
        raise ValueError(f"{key}: {spec!r} must use absolute paths (the job's working directory differs), "
                         f"e.g. {_absolute(src)}")
    if opt not in BIND_OPTIONS:
        raise ValueError(f"{key}: {spec!r} has option {opt!r}; allowed: {', '.join(BIND_OPTIONS)}")
    return Bind(os.path.normpath(src), os.path.normpath(dst), opt == "ro", key)


def derived_paths(cfg: WorkflowConfig) -> List[Tuple[str, str, bool]]:
    """``(key, absolute host path, read_only)`` for every path the config makes a step touch."""
    m, d, s, ck = cfg.model, cfg.data, cfg.strategy, cfg.checkpoint
    found: List[Tuple[str, Optional[str], bool]] = [
        ("run_dir", cfg.run_dir, False),
        ("model.name_or_path", m.name_or_path, True),
        ("model.tokenizer", m.tokenizer, True),
        ("data.path", _glob_root(d.path) if d.path else None, True),
        ("data.eval_path", _glob_root(d.eval_path) if d.eval_path else None, True),
        ("checkpoint.resume", ck.resume if ck.resume not in ("auto", "none") else None, True),
        ("cluster.log_dir", cfg.cluster.log_dir, False),
    ]
    if OffloadDevice.nvme in (s.offload_optimizer_device, s.offload_param_device):
        found.append(("strategy.offload_nvme_path", s.offload_nvme_path, False))
    if cfg.consolidate.output_dir:
        # the step creates the output directory, so its parent must already be visible
        found.append(("consolidate.output_dir", str(run_layout(cfg).hf_model.parent), False))
    for name in CACHE_ENV_VARS:
        value = cfg.container.env.get(name)
        if value and value.startswith("/"):
            found.append((f"container.env.{name}", value, False))
    return [(key, _absolute(path), ro) for key, path, ro in found if path]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def collect_binds(cfg: WorkflowConfig) -> Tuple[List[Bind], List[Tuple[str, str, str]]]:
    """Every bind before de-duplication (derived from the config, then ``container.binds``).

    Returns:
        The binds, and ``(key, entry, why)`` for each ``container.binds`` entry that
        cannot be parsed (validation reports them; :func:`bind_list` refuses them).
    """
    binds = [Bind(path, path, ro, key) for key, path, ro in derived_paths(cfg)]
    bad: List[Tuple[str, str, str]] = []
    for i, spec in enumerate(cfg.container.binds):
        key = f"container.binds[{i}]"
        try:
            binds.append(parse_bind(spec, key))
        except ValueError as err:
            bad.append((key, spec, str(err).split(": ", 1)[1]))
    return binds, bad


def bind_list(cfg: WorkflowConfig) -> List[Bind]:
    """Every bind a step gets, in mount order.

    A path inside an already-bound directory of the same mode is dropped; the
    rest are ordered parent first, so a writable run directory inside a
    read-only data tree still works (both runtimes mount in order).

    Raises:
        ValueError: a ``container.binds`` entry that cannot be parsed.
    """
    binds, bad = collect_binds(cfg)
    if bad:
        key, _, why = bad[0]
        raise ValueError(f"{key}: {why}")
    kept: List[Bind] = []
    for b in sorted(binds, key=lambda b: (b.dst.count("/"), b.dst, b.read_only)):
        covered = any(_under(b.dst, k.dst) and _under(b.src, k.src) and b.src[len(k.src):] == b.dst[len(k.dst):]
                      and k.read_only == b.read_only for k in kept)
        if not covered:
            kept.append(b)
    return kept


def bind_paths(cfg: WorkflowConfig) -> List[str]:
    """The host paths of :func:`bind_list`, in mount order."""
    return [b.src for b in bind_list(cfg)]
