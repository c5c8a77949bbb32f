"""The one command: compose, validate, plan, then run locally or submit to Slurm.

    python -m fsdp_workflow                              # the smoke run, on this machine
    python -m fsdp_workflow +experiment=llama8b_fft cluster.partition=gpu
    python -m fsdp_workflow +experiment=smoke dry_run=true run_dir=/tmp/plan
    python -m fsdp_workflow --help | --cfg job | -m train.micro_batch_size=1,2
    python -m fsdp_workflow --version                    # the libraries installed, and whether they are the tested ones

Exit codes: 0 success, 2 invalid config (nothing was written or submitted),
75 stopped on a signal after checkpointing, anything else a failure
(docs/reliability.md lists them). A ``-m`` sweep runs every point whatever
another point did, and exits with the worst point's code
(:func:`fsdp_workflow.core.exit_codes.worst`); a signal that stops the command
(Ctrl-C, SIGTERM) stops the sweep at the point it reached.

Every problem of a config is reported at once, unknown keys included. Hydra's
own composition errors (a YAML syntax error in an experiment file, an option a
group does not have) are one message naming the file, exit 2; the traceback
only under ``log_level=DEBUG`` or ``HYDRA_FULL_ERROR=1``. The run directory's
lock (``RUN_DIR/.lock``) is held from before the planner writes until the
chain is submitted, or until the local run ends: a second command on the same
``run_dir`` is refused at once, naming the holder.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import Any, Dict, List, Optional, Tuple

import hydra
from omegaconf import DictConfig

from fsdp_workflow.config import CONF_DIR, register_configs, register_resolvers
from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_USAGE, SWEEP_STOPPING, worst

register_configs()
register_resolvers()
# Inside the Hydra task its job logging (conf/hydra/job_logging) sends these to stderr and to
# RUN_DIR/logs/fsdp_workflow.log; before Hydra runs (unknown keys, a sweep's points) the
# messages are printed, since no logging is configured yet.
log = logging.getLogger("fsdp_workflow")

_task_started = False
_no_experiment = False  # set by main(): the hint when base defaults fail validation
_pending_issues: List[Any] = []  # unknown command-line keys, reported with the task's other problems
_existing_dirs: List[str] = []  # run_dir as it existed before Hydra ran: never removed on a refusal
_FULL_ERROR = "HYDRA_FULL_ERROR"
_user_full_error: Optional[str] = None  # the user's HYDRA_FULL_ERROR, restored for the task's children
_sweep_codes: List[int] = []  # each sweep point's exit code, in the order they ran
_sweep_dir: Optional[str] = None  # the sweep's directory, once a point recorded itself there
_num_points: Optional[int] = None  # how many points the sweep has, when main() could count them


def _fail_config(message: str, heading: str = "invalid config") -> None:
    _refuse(f"fsdp_workflow: {heading}\n{message}", EXIT_USAGE)


def _refuse(message: str, code: int) -> None:
    """Print a refusal (:class:`fsdp_workflow.launch.pipeline.Refused`'s words) and exit with its code."""
    # Printed, not logged: a refused config must not write into the log of a run it would have replaced.
    print(message, file=sys.stderr)
    try:  # Hydra made the run dir before we ran; leave nothing behind
        from hydra.core.hydra_config import HydraConfig

        out = os.path.abspath(HydraConfig.get().runtime.output_dir)
        if out not in _existing_dirs:
            os.rmdir(out)
    except (OSError, ValueError):
        pass  # not empty (an existing run) or no Hydra runtime
    raise SystemExit(code)


def _restore_full_error_env() -> None:
    """Give the task (and every child it starts) the user's own ``HYDRA_FULL_ERROR``."""
    if _user_full_error is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _user_full_error


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    _restore_full_error_env()
    if not _in_multirun():
        rc = _task(dcfg)
        if rc:
            raise SystemExit(rc)
        return
    # A sweep point: whatever it does (refused, diverged, crashed), the next point runs; returning
    # lets Hydra's loop go on, and main() exits with the worst point's code (exit_codes.worst).
    try:
        rc = _task(dcfg)
    except SystemExit as exc:  # a refusal (exit 2) printed its message
        rc = exc.code if isinstance(exc.code, int) else EXIT_FAILURE
    except Exception:  # noqa: BLE001 - one point's crash: its traceback, then the next point
        log.exception("fsdp_workflow: sweep point %s failed with an unexpected error (exit %d); "
                      "the next point runs", _point_num(), EXIT_FAILURE)
        rc = EXIT_FAILURE
    global _sweep_dir
    _sweep_dir = _record_sweep_point(dcfg, rc)
    _sweep_codes.append(rc)
    if rc in SWEEP_STOPPING:  # the user (or a scheduler) stopped the sweep's process: run no further point
        raise SystemExit(worst(_sweep_codes))


def _task(dcfg: DictConfig) -> int:
    """One job of Hydra: the submit pipeline (:mod:`fsdp_workflow.launch.pipeline`), then the launch.

    Returns the exit code; a refusal prints its message and raises SystemExit.
    """
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_workflow.config.load import to_typed_collecting
    from fsdp_workflow.launch.pipeline import NO_EXPERIMENT_HINT, Refused, lock_run_dir, validated, write_checked

    try:
        cfg, unknown = to_typed_collecting(dcfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        _fail_config(f"  {key}: {err}" if key else f"  {err}")
    from fsdp_workflow.core.logs import set_level

    set_level(cfg.log_level.value)  # the package's level for the rest of the command
    try:
        # Every problem in one report: unknown keys first, then the rules', then the run directory's.
        report = validated(cfg, first=[*_pending_issues, *unknown],
                           hint=NO_EXPERIMENT_HINT if _no_experiment else "")
    except Refused as err:
        # Printed, not logged, like the errors: nothing may reach the log of a run this refuses.
        for note in err.report.notes if err.report else []:
            print(f"fsdp_workflow: note: {note}", file=sys.stderr)
        for warning in err.report.warnings if err.report else []:
            print(f"fsdp_workflow: warning: {warning.format()}", file=sys.stderr)
        _refuse(str(err), err.exit_code)
    try:  # before the first write, and before anything is logged into the run
        lock = lock_run_dir(cfg, "planning and launching the run (python -m fsdp_workflow)")
    except Refused as err:
        _refuse(str(err), err.exit_code)
    try:
        try:
            plan = write_checked(cfg, report)
        except Refused as err:
            lock.release()
            _refuse(str(err), err.exit_code)
        return _launch(cfg, plan, lock)
    finally:
        lock.release()


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _point_num() -> int:
    from hydra.core.hydra_config import HydraConfig

    return int(HydraConfig.get().job.num)


def _record_sweep_point(dcfg: DictConfig, rc: int) -> str:
    """This sweep point's run dir, job ids and exit code go into ``SWEEP_DIR/sweep.json``; the sweep dir."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from fsdp_workflow.launch.sweep import record_point

    hc = HydraConfig.get()
    try:  # the point's run_dir (a swept run_dir=a,b, else Hydra's job dir); a refusal may have found it unusable
        run_dir = str(dcfg.run_dir)
    except Exception:  # noqa: BLE001 - an interpolation that failed: the point ran in Hydra's job dir
        run_dir = str(hc.runtime.output_dir)
    sweep_dir = Path(str(hc.sweep.dir)).absolute()
    record_point(sweep_dir, int(hc.job.num), list(hc.overrides.task),
                 Path(os.path.expanduser(run_dir)).absolute(), rc)
    return str(sweep_dir)


def _sweep_summary(codes: List[int], num_points: Optional[int]) -> str:
    """The sweep's last line: how many points ended how, the code the command exits with, where to look."""
    from collections import Counter

    from fsdp_workflow.core.exit_codes import MEANINGS

    def how(code: int) -> str:
        return "finished" if code == 0 else f"exited {code} ({MEANINGS.get(code, 'failed')})"

    ended = ", ".join(f"{n} {how(code)}" for code, n in sorted(Counter(codes).items()))
    total = num_points if num_points is not None else len(codes)
    line = f"fsdp_workflow: sweep: {len(codes)} of {total} points ran: {ended}"
    if codes and codes[-1] in SWEEP_STOPPING and len(codes) < total:
        line += (f"; stopped by a signal at point {len(codes) - 1}: points {len(codes)}-{total - 1} did not run"
                 if len(codes) < total - 1 else f"; stopped by a signal at point {len(codes) - 1}: "
                 f"point {total - 1} did not run")
    code = worst(codes)
    line += f". Exit {code}" + (" (the worst point's)" if code else "")
    if _sweep_dir is not None:
        from fsdp_workflow.core.commands import shell

        line += ". Each point's outcome: " + shell(["python", "-m", "fsdp_workflow.status", _sweep_dir])
    return line


def _launch(cfg, plan, lock) -> int:
    """Submit the written run, or run it here under ``lock`` (the caller releases it); a dry run stops here."""
    from fsdp_workflow.backends.registry import backend_for
    from fsdp_workflow.plan.run_dir import written_names

    backend = backend_for(cfg)
    if cfg.dry_run:
        print(f"dry run: wrote {plan.run_dir} ({', '.join(written_names(plan))}); nothing submitted.")
        command = backend.submit_command(plan.layout)  # the backend's own way (Slurm's and local's: submit.sh)
        if command:
            print("submit the same chain later with: " + shlex.join(command))
        for line in backend.dry_run_notes(str(plan.run_dir)):
            print(line)
        return 0
    return backend.submit(cfg, plan, lock=lock)  # a foreground run holds the lock through the run


def _with_run_dir_as_hydra_dir(argv: List[str]) -> List[str]:
    """``run_dir=X`` also becomes Hydra's own run dir, so no stray ``runs/...`` appears.

    In a sweep it becomes the sweep dir instead, and point N plans into ``X/N``.
    """
    if _is_multirun(argv):
        return _run_dir_as_sweep_dir(argv)
    idx = [i for i, a in enumerate(argv) if a.startswith("run_dir=")]
    if idx and not any(a.startswith("hydra.run.dir=") for a in argv):
        # right after it, not at the end: after a flag (--cfg job) argparse takes no more overrides
        at = idx[-1] + 1
        argv = argv[:at] + ["hydra.run.dir=" + argv[idx[-1]].split("=", 1)[1]] + argv[at:]
    return argv


def _is_multirun(argv: List[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


def _is_sweep(override: str) -> bool:
    """``a=1,2``, ``a=range(..)``, ``a=choice(..)``; an unparseable one is left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override).is_sweep_override()
    except Exception:  # Hydra reports the syntax error itself
        return True


def _run_dir_as_sweep_dir(argv: List[str]) -> List[str]:
    """``-m ... run_dir=X``: every point gets its own directory, ``X/<hydra.job.num>``.

    A single ``run_dir`` shared by all points would make point 2 resume from point
    1's checkpoints. ``run_dir`` is dropped, so it keeps its default (Hydra's job
    output dir), and ``X`` becomes the sweep dir, taking precedence over any
    ``hydra.sweep.dir``/``subdir`` given. A swept ``run_dir=a,b`` is left alone:
    each point already names its own directory.
    """
    idx = [i for i, a in enumerate(argv) if a.startswith("run_dir=")]
    if not idx or _is_sweep(argv[idx[-1]]):
        return argv
    value = argv[idx[-1]].split("=", 1)[1]
    out = [a for i, a in enumerate(argv) if i not in idx[:-1]]
    at = idx[-1] - len(idx[:-1])
    # in place, so the overrides stay together for Hydra's argument parser
    out[at:at + 1] = [f"hydra.sweep.dir={value}", "hydra.sweep.subdir=${hydra.job.num}"]
    return out


# Flags after which Hydra runs no job (help, printing the config) or composes
# another config tree: the sweep is left to Hydra as it is.
_NO_SWEEP_CHECK_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun",
                         "config_path", "config_name", "config_dir")


def _sweep_points(argv: List[str]) -> Optional[List[Tuple[List[str], Optional[str]]]]:
    """The jobs a ``-m`` sweep will run, in Hydra's order: ``(overrides, run dir or None)``.

    Expands the task overrides as Hydra's basic sweeper does (a cartesian product).
    The run dir is ``sweep.dir/N`` when the sweep dir is given (``run_dir=X`` gives
    it, see :func:`_run_dir_as_sweep_dir`) and None for Hydra's fresh, timestamped
    default. None overall: nothing to check here (no sweep, a help or ``--cfg``
    flag, another sweeper or config tree, or overrides only Hydra can explain).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # Hydra will report the bad command line
        return None
    if not args.multirun or any(getattr(args, flag, None) for flag in _NO_SWEEP_CHECK_FLAGS):
        return None
    try:
        overrides = OverridesParser.create(config_loader=_config_loader()).parse_overrides(args.overrides)
        task = [o for o in overrides if not o.is_hydra_override()]
        hydra_ov = {o.key_or_group: o for o in overrides if o.is_hydra_override()}
        if any(k.startswith(("hydra.sweeper", "hydra/sweeper")) for k in hydra_ov):
            return None  # not the basic sweeper's cartesian product
        points = BasicSweeper.split_arguments(task, None)[0] if task else [[]]
    except Exception:  # a syntax or sweep error: Hydra reports it with its own message
        return None
    sweep_dir = hydra_ov["hydra.sweep.dir"].value() if "hydra.sweep.dir" in hydra_ov else None
    subdir = hydra_ov["hydra.sweep.subdir"].value() if "hydra.sweep.subdir" in hydra_ov else "${hydra.job.num}"
    out: List[Tuple[List[str], Optional[str]]] = []
    for num, point in enumerate(points):
        sub = str(num) if subdir == "${hydra.job.num}" else (None if "${" in str(subdir) else str(subdir))
        run_dir = os.path.abspath(os.path.join(str(sweep_dir), sub)) if sweep_dir and sub is not None else None
        out.append((list(point), run_dir))
    return out


def _config_loader() -> Any:
    """Hydra's loader for ``conf/``, so a ``glob(..)`` sweep over a group can list its options."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path

        return ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
    except Exception:  # Hydra internals moved: only glob sweeps lose out
        return None


def _validate_sweep(argv: List[str]) -> None:
    """Compose and validate every point of a ``-m`` sweep before Hydra runs any.

    Each point also gets the run directory rule (a directory holding a different
    run is refused), and no two points may share a run or output directory.
    Exits with ``EXIT_USAGE`` listing every failing point; returns when all pass.
    """
    import dataclasses

    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_workflow.config.errors import ConfigError, Issue
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.plan.checks import check
    from fsdp_workflow.plan.run_dir import check_run_dir_reuse, run_dir_problem

    global _num_points
    points = _sweep_points(argv)
    if not points:
        return
    _num_points = len(points)
    failures: List[str] = []
    seen: Dict[Tuple[str, str], int] = {}  # (key, directory) -> first point writing there
    for num, (overrides, run_dir) in enumerate(points):
        where = f"sweep point {num} ({' '.join(overrides) or 'no overrides'})"
        try:
            cfg = compose(overrides)
        except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as err:  # unknown key, wrong type, no such option, YAML syntax
            from fsdp_workflow.config.hydra_errors import describe

            failures.append(f"{where}:\n" + "\n".join("  " + ln for ln in describe(err).split("\n")))
            continue
        if run_dir is not None:
            cfg = dataclasses.replace(cfg, run_dir=run_dir)
        issues = list(check(cfg).errors)
        own = [("run_dir", str(cfg.run_dir))] if run_dir is not None or any(
            o.startswith("run_dir=") for o in overrides) else []
        if cfg.consolidate.enabled and cfg.consolidate.output_dir:
            own.append(("consolidate.output_dir", cfg.consolidate.output_dir))
        for key, path in own:
            first = seen.setdefault((key, os.path.abspath(os.path.expanduser(path))), num)
            if first != num:
                issues.append(Issue(key, path, f"sweep point {first} writes to the same directory",
                                    f"give each point its own {key}, or leave {key} out"))
        problem = run_dir_problem(cfg.run_dir) if run_dir is not None else None
        if problem is not None:
            issues.append(problem)
        else:
            try:
                check_run_dir_reuse(cfg)
            except ConfigError as err:
                issues.extend(err.issues)
        if issues:
            failures.append(f"{where}:\n{ConfigError(issues)}")
    if failures:
        print(f"fsdp_workflow: invalid config in {len(failures)} of {len(points)} sweep points; "
              "no point was run\n" + "\n".join(failures), file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    parents = {os.path.dirname(run_dir) for _, run_dir in points if run_dir is not None}
    if len(parents) == 1 and all(run_dir is not None for _, run_dir in points):
        from pathlib import Path

        from fsdp_workflow.launch.sweep import record_planned

        record_planned(Path(parents.pop()), points)  # the index lists every point before the first runs


def _is_flagged(argv: List[str]) -> bool:
    """A flag (``--cfg``, ``--help``, ``-m``...): Hydra may run no task, or many."""
    return any(a.startswith("-") for a in argv)


def _wants_traceback(argv: List[str]) -> bool:
    """The user asked for tracebacks: ``log_level=DEBUG`` or ``HYDRA_FULL_ERROR=1``."""
    levels = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("log_level=")]
    return (bool(levels) and levels[-1].strip().upper() == "DEBUG") or \
        (_user_full_error or "").strip().lower() in ("1", "true", "yes")


def _refuse_unplannable_run_dir(argv: List[str]) -> None:
    """A ``run_dir=`` that is (or lies below) a file: refused before Hydra fails to create it."""
    from fsdp_workflow.config.errors import ConfigError
    from fsdp_workflow.plan.run_dir import run_dir_problem

    given = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
    if not given or _is_multirun(argv) or _is_sweep(f"run_dir={given[-1]}"):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:  # Hydra's own reading of the value: quotes and escapes as Hydra will apply them
        value = str(OverridesParser.create().parse_override(f"run_dir={given[-1]}").value())
    except Exception:  # a syntax error: Hydra reports it with its own message
        return
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.isdir(path):
        _existing_dirs.append(path)  # the user's: a refusal must not remove it, even when empty
    problem = run_dir_problem(value)
    if problem is not None and not os.path.isdir(path):
        print(f"fsdp_workflow: invalid config\n{ConfigError([problem])}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def main(argv: Optional[List[str]] = None) -> None:
    """Run the command line (``argv`` without the program name; default ``sys.argv[1:]``)."""
    from fsdp_workflow.config.load import normalize_overrides

    global _no_experiment, _pending_issues, _user_full_error, _sweep_dir, _num_points
    from fsdp_workflow.config.errors import ConfigError
    from fsdp_workflow.config.keys import override_key_issues
    from fsdp_workflow.config.load import experiment_selected

    _pending_issues = []
    _existing_dirs.clear()
    _sweep_codes.clear()
    _sweep_dir = _num_points = None
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in == ["--version"]:
        from fsdp_workflow.core.versions import report

        print(report())
        return
    normalized = normalize_overrides(args_in)
    unknown = override_key_issues(normalized)
    if unknown and _is_flagged(normalized):  # no single task to report them with: before Hydra
        print(f"fsdp_workflow: invalid config\n{ConfigError(unknown)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    if unknown:
        # Hydra would stop at the first with a message that names no valid key (and accept `+key`):
        # leave them out of the composition and report them with every other problem.
        _pending_issues = unknown
        normalized = [o for o in normalized if not override_key_issues([o])]
    _no_experiment = experiment_selected(normalized) is None
    _refuse_unplannable_run_dir(normalized)
    args = _with_run_dir_as_hydra_dir(normalized)
    _validate_sweep(args)  # every point of a -m sweep, before Hydra runs the first
    sys.argv = [sys.argv[0]] + args
    _user_full_error = os.environ.get(_FULL_ERROR)
    os.environ[_FULL_ERROR] = "1"  # Hydra raises its composition errors: reported below as one message
    from fsdp_workflow.config.hydra_mode import mode_from_flags

    try:
        with mode_from_flags(args):  # Hydra composes once, not twice (the first only read hydra.mode)
            _hydra_main()
    except SystemExit as exc:
        # Hydra reports command-line errors (argparse) itself and exits 1 before our task runs;
        # those are config errors too.
        if exc.code == 1 and not _task_started:
            raise SystemExit(EXIT_USAGE) from None
        if _sweep_codes:  # a signal stopped the sweep at its last point
            print(_sweep_summary(_sweep_codes, _num_points), file=sys.stderr)
        raise
    except Exception as err:
        if _task_started:
            raise  # the task's own failure, not a config error: its traceback is the report
        _restore_full_error_env()
        if _wants_traceback(args):
            import traceback

            traceback.print_exc()
        from fsdp_workflow.config.hydra_errors import describe, unwritable_run_dir

        unwritable = unwritable_run_dir(err, os.getcwd())  # a read-only working directory: not the config
        heading = "cannot create the run directory" if unwritable else "invalid config"
        detail = "\n".join("  " + line for line in (unwritable or describe(err)).split("\n"))
        print(f"fsdp_workflow: {heading}\n{detail}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    finally:
        _restore_full_error_env()
    if _sweep_codes:  # a -m sweep ran every point: its exit code is the worst point's
        print(_sweep_summary(_sweep_codes, _num_points), file=sys.stderr)
        raise SystemExit(worst(_sweep_codes))


if __name__ == "__main__":
    main()
