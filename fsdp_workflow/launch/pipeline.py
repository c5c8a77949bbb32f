"""The one path from a typed config to a written run directory, for the CLI and the Python API.

``python -m fsdp_workflow`` and :func:`fsdp_workflow.submit` both go, in this order:

1. :func:`validated`: the config's rules and the run directory's (every problem in one report);
2. :func:`lock_run_dir`: ``RUN_DIR/.lock``, before the first write;
3. :func:`write_checked`: refuse while a chain of the run is queued, write the run directory, warn;
4. on Slurm, :func:`fsdp_workflow.backends.slurm.submit.submit_checked`.

A step that refuses raises :class:`Refused` with the words the CLI prints and the code it
exits with; the API raises them again as :class:`fsdp_workflow.api.SubmitError`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional, Sequence

from fsdp_workflow.config.errors import ConfigError, Issue, ValidationReport
from fsdp_workflow.config.schema import WorkflowConfig, run_layout
from fsdp_workflow.backends.base import Refused, refused
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.lock import Lock, LockHeld, LockUnsupported, acquire
from fsdp_workflow.backends.registry import backend_for, live_problem
from fsdp_workflow.plan.checks import check
from fsdp_workflow.plan.estimate import memory_warning, summary_lines
from fsdp_workflow.plan.jobs import LaunchPlan
from fsdp_workflow.plan.run_dir import InputsChanged, check_run_dir_reuse, run_dir_problem, write_run_dir

log = logging.getLogger(__name__)

NO_EXPERIMENT_HINT = ("\n  (no experiment selected: these are the base defaults; "
                      "add +experiment=smoke for the smoke run's values)")


def validated(cfg: WorkflowConfig, first: Sequence[Issue] = (), last: Sequence[Issue] = (),
              hint: str = "") -> ValidationReport:
    """Check the config and its run directory; every problem in one :class:`Refused`.

    Args:
        cfg: the typed config.
        first: problems found before typing it (unknown keys), listed first.
        last: the caller's own problems (the API's: not Slurm, a dry run), listed last.
        hint: appended to the message of a refusal (:data:`NO_EXPERIMENT_HINT`).

    Returns:
        The report, without errors: its notes and warnings are for :func:`write_checked`.

    Raises:
        Refused: at least one problem, each named by key.
    """
    report = check(cfg)
    report.errors[:0] = list(first)
    problem = run_dir_problem(cfg.run_dir)
    if problem is not None:
        report.errors.append(problem)
    elif not report.errors:
        try:
            check_run_dir_reuse(cfg)
        except ConfigError as err:
            report.errors.extend(err.issues)
    report.errors.extend(last)
    if report.errors:
        err = refused(f"{ConfigError(report.errors)}{hint}", issues=report.errors)
        err.report = report
        raise err
    return report


def lock_run_dir(cfg: WorkflowConfig, purpose: str) -> Lock:
    """Take ``RUN_DIR/.lock`` now (the caller releases it).

    Raises:
        Refused: another command holds it (naming the holder: host, pid, Slurm job), or the
            filesystem cannot lock.
    """
    layout = run_layout(cfg)
    try:
        return acquire(layout.lock, purpose, subject=f"run_dir {layout.root}")
    except LockHeld as err:
        raise refused(f"  run_dir = {cfg.run_dir!r}\n    why: {err}\n"
                      "    fix: wait for that command to end, or plan into another run_dir",
                      heading="run directory in use") from None
    except LockUnsupported as err:
        raise refused(f"  run_dir = {cfg.run_dir!r}\n    why: {err}\n"
                      "    fix: a run_dir on a filesystem with flock (a local disk, NFS with locking, "
                      "Lustre mounted -o flock)", heading="run directory cannot be locked") from None


def write_checked(cfg: WorkflowConfig, report: ValidationReport,
                  command: Optional[List[str]] = None) -> LaunchPlan:
    """Under the run's lock: log the report, refuse a live chain, write the run directory, warn.

    Args:
        cfg: a config :func:`validated` passed.
        report: its report (notes and warnings are logged here, into the run's log).
        command: the planning command for ``provenance.json`` (default: ``sys.argv``).

    Raises:
        Refused: a chain of this run directory is still queued or running; the inputs of a
            finished run changed; a value no script can carry.
    """
    for note in report.notes:
        log.info("fsdp_workflow: note: %s", note)
    for warning in report.warnings:
        log.warning("fsdp_workflow: warning: %s", warning.format())
    live = live_problem(Path(cfg.run_dir))  # before planning rewrites what a queued chain will run
    if live:
        raise Refused(f"fsdp_workflow: refused: {live}")
    try:
        plan = write_run_dir(cfg, backend_for(cfg), command=command)
    except InputsChanged as err:  # a finished run, on other data or another model directory
        raise refused(str(err), heading="the inputs of this finished run changed; nothing run") from None
    except ValueError as err:  # an unrenderable value, named by the renderer; a ConfigError's own text
        raise refused(f"  {err}" if not str(err).startswith("found ") else str(err)) from None
    log.info("%s", "\n".join("  " + line for line in summary_lines(cfg)))
    warning = memory_warning(cfg)
    if warning:
        log.warning("fsdp_workflow: warning: %s", warning)
    return plan
