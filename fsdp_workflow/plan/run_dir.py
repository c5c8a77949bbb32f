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

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_workflow.config.accelerate_env import accelerate_env
from fsdp_workflow.config.errors import ConfigError, Issue, show_value
from fsdp_workflow.config.load import PROJECT_ROOT, load_run_config, to_yaml
from fsdp_workflow.config.path_keys import make_paths_absolute, path_problem
from fsdp_workflow.config.record import open_run
from fsdp_workflow.config.schema import WorkflowConfig, run_layout
from fsdp_workflow.core.commands import hydra_value, shell
from fsdp_workflow.core.rundir import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    RUN_LOCK_FILE,
    STEP_PREFIX,
    atomic_write_json,
    atomic_write_text,
)
from fsdp_workflow.core.versions import installed
from fsdp_workflow.plan.inputs import changed_inputs, fingerprint_inputs
from fsdp_workflow.plan.jobs import LaunchPlan
from fsdp_workflow.plan.render import render_launch_env
from fsdp_workflow.plan.snapshot import write_snapshot

if TYPE_CHECKING:
    from fsdp_workflow.backends.base import Backend

log = logging.getLogger(__name__)


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
        recorded = load_run_config(old_config_file)
        make_paths_absolute(recorded)  # a run planned before paths were recorded absolute: the same command again
        old = _as_flat(to_yaml(recorded))
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


class InputsChanged(ConfigError):
    """The run in ``run_dir`` finished, but on other inputs than the config names now (nothing was run)."""


# Overrides the two commands offered for changed inputs set themselves.
_OFFERED = ("run_dir=", "checkpoint.resume=", "train.max_steps=", "hydra.run.dir=", "hydra.sweep.dir=", "dry_run=")


def _again(command: Sequence[str], *words: str) -> str:
    """The planning command again with ``words`` in place of the overrides they set, pasteable."""
    kept = [str(a) for a in list(command)[1:] if not str(a).lstrip("+").startswith(_OFFERED)]
    return shell(["python", "-m", "fsdp_workflow", *kept, *words])


def check_inputs_unchanged(cfg: WorkflowConfig, inputs: Dict[str, Any], command: Sequence[str]) -> None:
    """Refuse to call a finished run complete when its data or model directory changed since it was planned.

    A run is finished when its newest checkpoint reached ``train.max_steps``, or its model
    was written and its checkpoints removed. A ``checkpoint.resume`` inside the directory
    (a deliberate continuation) is never refused here.

    Args:
        cfg: the config about to be planned.
        inputs: :func:`~fsdp_workflow.plan.inputs.fingerprint_inputs` of ``cfg``.
        command: the planning command, for the two commands offered.

    Raises:
        InputsChanged: on the first changed key, naming every changed file and both choices:
            a new ``run_dir``, or the resume onto the new inputs.
    """
    layout = run_layout(cfg)
    if not is_run_of_this_tool(layout.root) or _resumes_inside(cfg.checkpoint.resume, layout.root):
        return
    found = layout.list_checkpoints()
    last = found[-1][0] if found else None
    finished = (last is not None and last >= cfg.train.max_steps) or \
        (last is None and cfg.consolidate.enabled and layout.hf_model.is_dir())
    changed = changed_inputs((open_run(layout.root).provenance or {}).get("inputs"), inputs) if last is not None \
        or finished else []
    if not finished:
        if changed and (cfg.checkpoint.resume or "").strip().lower() == "auto":
            shown = "; ".join(changed[:_DIFFS_SHOWN]) + (f" (and {len(changed) - _DIFFS_SHOWN} more)"
                                                         if len(changed) > _DIFFS_SHOWN else "")
            log.warning("fsdp_workflow: warning: %s", Issue(
                "checkpoint.resume", cfg.checkpoint.resume,
                f"continues the run in {layout.root} from its step {last} on other inputs than it trained on so "
                f"far: {shown}. The data position and the schedule carry on from that step over the new data",
                f"to train on the new inputs from the start, a new run_dir=DIR (e.g. run_dir={layout.root}-2); "
                "to continue onto them on purpose, nothing").format())
        return
    if not changed:
        return
    key, value = changed[0].split(": ")[:2]  # the first changed key and file
    new_dir = _again(command, f"run_dir={hydra_value(str(layout.root) + '-2')}",
                     f"train.max_steps={cfg.train.max_steps}")
    if last is None:
        resume = ("its checkpoints were removed after the consolidation, so it cannot be resumed; to start "
                  "from its model instead, add "
                  f"{shell(['model.init=pretrained', f'model.name_or_path={hydra_value(str(layout.hf_model))}'])}"
                  " to that command")
    else:
        more = last + cfg.train.max_steps
        resume = ("or continue this run onto the new inputs from its step "
                  f"{last} (train.max_steps={more}: {cfg.train.max_steps} more steps; the model is replaced "
                  "once the longer run's is verified): "
                  + _again(command, f"run_dir={hydra_value(str(layout.root))}",
                           f"checkpoint.resume={hydra_value(str(layout.step_dir(last)))}",
                           f"train.max_steps={more}"))
    shown = "; ".join(changed[:_DIFFS_SHOWN]) + (f" (and {len(changed) - _DIFFS_SHOWN} more)"
                                                 if len(changed) > _DIFFS_SHOWN else "")
    raise InputsChanged([Issue(
        key, value,
        f"the run in {layout.root} finished (step {last if last is not None else '?'} of "
        f"train.max_steps={cfg.train.max_steps}) on other inputs than these: {shown}. It is not complete on "
        "the new inputs, and nothing was run",
        f"train on the new inputs from the start in a new run directory: {new_dir}; {resume}",
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
    # too long, a file on the way, a read-only file system: every write would fail (with a traceback)
    problem = path_problem("run_dir", str(run_dir), writes=True, fix=fix)
    if problem is not None:
        return problem
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


def write_run_dir(cfg: WorkflowConfig, backend: "Backend", command: Optional[Sequence[str]] = None) -> LaunchPlan:
    """Create ``cfg.run_dir`` and write everything a launch needs into it.

    Args:
        cfg: the validated config.
        backend: the run's scheduler (:func:`fsdp_workflow.backends.registry.backend_for`): it plans
            the chain and renders its scripts. Passed in because the backends sit above this stage.
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
        InputsChanged: the run in ``cfg.run_dir`` finished on other data or another model
            directory (:func:`check_inputs_unchanged`); nothing is written.
    """
    check_run_dir_reuse(cfg)
    command = list(sys.argv if command is None else command)
    inputs = fingerprint_inputs(cfg)
    check_inputs_unchanged(cfg, inputs, command)
    plan = backend.plan(cfg, run_layout(cfg))
    launch_env = render_launch_env(accelerate_env(cfg))  # may refuse a value: before anything is written
    scripts: Dict[str, str] = backend.render(plan)
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
        "command": command,
        "inputs": inputs,  # the data files' and model directory's fingerprints (plan.inputs)
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.executable,
        "versions": installed(),  # the planning environment's libraries (the trainer's: train_exit.json)
        "files": sorted([layout.config.name, layout.launch_env.name, *scripts]),
    })
    return plan
