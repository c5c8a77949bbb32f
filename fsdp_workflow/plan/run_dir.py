"""Write a run directory: resolved config, launch.env, job scripts, provenance.

Every run directory records what was (or would be) submitted, so a failed
job can be understood, and rerun with ``bash RUN_DIR/submit.sh``, without
the machine that planned it.

A run directory is never reused by accident:

- ``run_dir`` must be a new directory, an empty one, or a run of this tool
  (:func:`run_dir_problem`). A run of this tool is recognised by the two
  files the planner writes into every run directory, ``config.yaml`` and
  ``provenance.json`` (the lock file ``.lock`` alone does not make a directory
  non-empty). Anything else (``/``, a home directory, a file) is refused before
  anything is written, so the planner never scatters its files among a user's.
- planning into a run whose ``config.yaml`` records a different run is refused
  (:func:`check_run_dir_reuse`), since the trainer would otherwise resume
  (``checkpoint.resume=auto``) from that run's checkpoints under the new config.
  Slurm requeues rerun the written ``train.sbatch`` and never plan again, so they
  are not affected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_workflow.config.accelerate_env import accelerate_env
from fsdp_workflow.config.errors import ConfigError, Issue, show_value
from fsdp_workflow.config.load import PROJECT_ROOT, load_run_config, to_yaml
from fsdp_workflow.config.record import open_run
from fsdp_workflow.config.schema import WorkflowConfig, run_layout
from fsdp_workflow.core.rundir import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    RUN_LOCK_FILE,
    STEP_PREFIX,
    atomic_write_json,
    atomic_write_text,
)
from fsdp_workflow.plan.jobs import LaunchPlan
from fsdp_workflow.plan.render import render_all, render_launch_env
from fsdp_workflow.plan.snapshot import write_snapshot
from fsdp_workflow.plan.spec import build_plan


def git_revision() -> str:
    """The project's git revision (with ``-dirty``), or ``unknown`` outside a checkout.

    Only the checkout's own ``.git`` counts: an installed package sits in site-packages,
    and a venv inside some other repository must not record that repository's revision.
    """
    if not (PROJECT_ROOT / ".git").exists():
        return "unknown"
    try:
        rev = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        return rev or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Keys a resubmission of the same run may change. dry_run: plan first, then run.
# checkpoint.resume: how to continue, not what. run_dir: its spelling (relative or
# absolute); the directory is the same one. The Slurm keys only say where and when
# the job is scheduled (another partition or a longer limit after a timeout), never
# what it computes.
REUSE_IGNORED_KEYS = frozenset({
    "dry_run", "checkpoint.resume", "run_dir",
    "cluster.partition", "cluster.account", "cluster.qos", "cluster.time_min", "cluster.mem_gb",
    "cluster.constraint", "cluster.exclusive", "cluster.consolidate_partition",
    "cluster.consolidate_time_min", "cluster.consolidate_mem_gb", "cluster.consolidate_cpus",
})
_DIFFS_SHOWN = 5


class _Note(str):
    """A marker shown as is in a difference, never as a config value."""


_ABSENT = _Note("<absent>")
_NO_RESUME = ("", "none", "false", "no", "auto")


def _flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    """Dotted key -> leaf value (lists are leaves)."""
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _as_flat(yaml_text: str) -> Dict[str, Any]:
    container = OmegaConf.to_container(OmegaConf.create(yaml_text), resolve=False)
    if not isinstance(container, dict):
        raise ValueError("not a mapping")
    return _flatten(container)


def config_differences(old_config_file: Path, cfg: WorkflowConfig) -> List[Tuple[str, Any, Any]]:
    """``(key, old, new)`` for every key, not in :data:`REUSE_IGNORED_KEYS`, that differs.

    The old file goes through the schema first, so a key added to the schema
    since it was written compares as its default rather than as a difference.
    A file that cannot be read at all is one difference, on ``config.yaml``.
    """
    new = _as_flat(to_yaml(cfg))
    try:
        old = _as_flat(to_yaml(load_run_config(old_config_file)))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError):  # another version's keys, or hand-edited
        try:
            old = _as_flat(old_config_file.read_text())
        except (OmegaConfBaseException, yaml.YAMLError, ValueError, OSError) as err:
            return [(CONFIG_FILE, _Note(f"<unreadable: {err}>"), _Note("<this config>"))]
    keys = [k for k in new if k not in REUSE_IGNORED_KEYS] + \
        [k for k in old if k not in new and k not in REUSE_IGNORED_KEYS]
    return [(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys if old.get(k, _ABSENT) != new.get(k, _ABSENT)]


def _resumes_inside(resume: str, run_dir: Path) -> bool:
    """``checkpoint.resume`` names ``run_dir`` or a path under it (a deliberate continuation)."""
    if (resume or "").strip().lower() in _NO_RESUME:
        return False
    target, root = Path(resume.strip()).resolve(), run_dir.resolve()
    return target == root or root in target.parents


def _show(value: Any) -> str:
    return value if isinstance(value, _Note) else show_value(value)


def check_run_dir_reuse(cfg: WorkflowConfig) -> None:
    """Refuse to plan into a run directory that holds a run with a different config.

    Allowed: a directory without ``config.yaml`` (a new run), the same config again
    (resubmitting or continuing that run), and ``checkpoint.resume`` naming a path
    inside the directory (continuing that run under a new config on purpose).

    Raises:
        ConfigError: on key ``run_dir``, listing the first differing keys and the fix.
    """
    layout = run_layout(cfg)
    run_dir, old_file = layout.root, layout.config
    if not old_file.is_file() or _resumes_inside(cfg.checkpoint.resume, run_dir):
        return
    diffs = config_differences(old_file, cfg)
    if not diffs:
        return
    shown = "; ".join(f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in diffs[:_DIFFS_SHOWN])
    more = f" (and {len(diffs) - _DIFFS_SHOWN} more)" if len(diffs) > _DIFFS_SHOWN else ""
    raise ConfigError([Issue(
        "run_dir", cfg.run_dir,
        f"it holds a run with a different config ({old_file}): {shown}{more}; planning here would "
        "overwrite that run's record and resume from its checkpoints under the new config",
        f"a new run_dir=DIR for a new run, or checkpoint.resume={layout.checkpoints}/{STEP_PREFIX}N "
        "to continue that run under the new config on purpose",
    )])


def run_dir_problem(run_dir: str) -> Optional[Issue]:
    """None when ``run_dir`` may be planned into: a new directory, an empty one, or a run of this tool.

    Args:
        run_dir: the configured ``run_dir`` (``~`` expanded; relative to the working directory).

    Returns:
        None, or the issue (on key ``run_dir``) saying why the path is refused. An empty
        ``run_dir`` is the schema rule's to refuse (it would name the working directory here).
    """
    if not str(run_dir).strip():
        return None
    path = Path(os.path.expanduser(str(run_dir)))
    fix = "run_dir=DIR naming a new directory (it is created), an empty one, or an earlier run of this tool"
    for parent in [path, *path.parents]:  # a file on the way makes every write fail
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == path else f"lies below {parent}, which is a file"
            return Issue("run_dir", str(run_dir), f"{what}, not a directory", fix)
        if parent.exists():
            break
    if not path.is_dir():
        return None
    try:
        entries = [p.name for p in path.iterdir() if p.name != RUN_LOCK_FILE]
    except OSError as err:
        return Issue("run_dir", str(run_dir), f"cannot be listed ({err.strerror})", fix)
    if not entries or is_run_of_this_tool(path):
        return None
    shown = ", ".join(sorted(entries)[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    return Issue("run_dir", str(run_dir),
                 f"is a non-empty directory that holds no run of this tool (it has {shown}; a run has "
                 f"{CONFIG_FILE} and {PROVENANCE_FILE}): the planner would write its config, scripts, "
                 "code/ and logs/ among these files", fix)


def is_run_of_this_tool(path: Path) -> bool:
    """A directory the planner wrote: it holds both ``config.yaml`` and ``provenance.json``."""
    return (path / CONFIG_FILE).is_file() and (path / PROVENANCE_FILE).is_file()


def written_names(plan: LaunchPlan) -> List[str]:
    """What :func:`write_run_dir` wrote for ``plan``, from its provenance record, in order.

    The "wrote" line of a dry run lists these, never files that were there before.
    """
    layout = plan.layout
    files = (open_run(layout.root).provenance or {}).get("files")  # the run record's reading of provenance.json
    files = [str(f) for f in files] if isinstance(files, list) else []
    names = sorted({*files, layout.provenance.name})
    if plan.code_dir is not None:
        names.append(f"{layout.code.name}/")
    return names


def write_run_dir(cfg: WorkflowConfig, command: Optional[Sequence[str]] = None) -> LaunchPlan:
    """Create ``cfg.run_dir`` and write everything a launch needs into it.

    Args:
        cfg: the validated config.
        command: the planning command for ``provenance.json`` (resume commands are built
            from it); default ``sys.argv``, the CLI's. The Python API passes the command
            line that plans the same run.

    Returns:
        The plan the scripts were rendered from.

    The CLI asks :func:`run_dir_problem` first (with the config's other problems, before
    it takes the run's lock); this function, also used by tests to rewrite a run's
    scripts, checks only the reuse rule.

    Raises:
        ConfigError: ``cfg.run_dir`` holds a different run (:func:`check_run_dir_reuse`);
            nothing is written.
    """
    check_run_dir_reuse(cfg)
    plan = build_plan(cfg)
    launch_env = render_launch_env(accelerate_env(cfg))  # may refuse a value: before anything is written
    scripts: Dict[str, str] = render_all(plan)
    layout = plan.layout
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.logs.mkdir(parents=True, exist_ok=True)  # sbatch does not create --output's directory
    # The snapshot before the scripts that put it on PYTHONPATH.
    snapshot = write_snapshot(layout.code) if plan.code_dir is not None else None
    atomic_write_text(layout.config, to_yaml(cfg))
    atomic_write_text(layout.launch_env, launch_env)
    for name, text in scripts.items():
        atomic_write_text(layout.script(name), text, 0o755)
    revision = git_revision()
    atomic_write_json(layout.provenance, {
        "git_revision": revision,
        "git_dirty": None if revision == "unknown" else revision.endswith("-dirty"),
        "code_snapshot": snapshot,
        "config_sha256": plan.config_sha256,  # what every job checks config.yaml against (core.config_hash)
        "command": list(sys.argv if command is None else command),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.executable,
        "files": sorted([layout.config.name, layout.launch_env.name, *scripts]),
    })
    return plan
