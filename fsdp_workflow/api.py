"""The Python API: submit a run's Slurm chain and get submitit job handles back.

    import fsdp_workflow

    chain = fsdp_workflow.submit(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug",
                                  "run_dir=/scratch/me/smoke1"])
    chain["train"].state          # "PENDING", "RUNNING", ... (a submitit.SlurmJob)
    chain.wait()                  # {"train": "COMPLETED", "consolidate": "COMPLETED"}
    print(chain["consolidate"].stdout())

:func:`submit` does what ``python -m fsdp_workflow OVERRIDES`` does for
``cluster=slurm``, in the same order and through the same functions: compose
``conf/``, validate (every problem in one report), take ``RUN_DIR/.lock``, plan
and render the run directory, check the chain against the cluster, submit the run
directory's own batch scripts with ``sbatch`` and record them in ``jobs.txt``.
What Slurm runs is therefore what the CLI would have submitted, byte for byte.

Where the CLI exits with a code, :func:`submit` raises :class:`SubmitError`
carrying that code and the message the CLI prints: 2 for an invalid config (nothing
written or submitted), a run directory in use, a chain already queued, or a cluster
that could never run the chain; 1 when ``sbatch`` failed otherwise.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

from fsdp_workflow.core.exit_codes import EXIT_USAGE

if TYPE_CHECKING:
    from fsdp_workflow.config.errors import Issue, ValidationReport
    from fsdp_workflow.config.schema import WorkflowConfig
    from fsdp_workflow.backends.slurm.handles import ChainJob
    from fsdp_workflow.launch.pipeline import Refused

# What the CLI records as argv[0] when run as ``python -m fsdp_workflow``: provenance.json's
# command, from which status and the launcher build resume commands.
_CLI_PROGRAM = str(Path(__file__).resolve().with_name("__main__.py"))


class SubmitError(RuntimeError):
    """:func:`submit` refused or failed; ``str(err)`` is what the CLI prints, ``exit_code`` what it exits with.

    Attributes:
        exit_code: the CLI's exit code for the same command (2: config, run directory, cluster limits).
        issues: the config problems, one per key (empty when the refusal is not about a key).
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE, issues: Sequence["Issue"] = ()) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.issues = list(issues)


@dataclass(frozen=True)
class Chain:
    """The submitted chain: one submitit handle per job, in submission order.

    Attributes:
        run_dir: the run directory the chain runs from.
        jobs: the handles (``prepare``, ``train``, ``consolidate``..., as the plan chains them).
        note: why nothing was submitted (the run is already complete), else "".
    """

    run_dir: Path
    jobs: Tuple["ChainJob", ...] = field(default_factory=tuple)
    note: str = ""

    def __getitem__(self, role: str) -> "ChainJob":
        for job in self.jobs:
            if job.role == role:
                return job
        raise KeyError(f"no {role!r} job in this chain; its jobs: {', '.join(self.roles) or 'none'}")

    def __iter__(self) -> Iterator["ChainJob"]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def roles(self) -> List[str]:
        return [job.role for job in self.jobs]

    @property
    def states(self) -> Dict[str, str]:
        """role -> Slurm state, as submitit's watcher last saw it."""
        return {job.role: job.state for job in self.jobs}

    def done(self) -> bool:
        """Whether every job has ended (a job cancelled because its dependency failed counts)."""
        return all(job.done() for job in self.jobs)

    def wait(self) -> Dict[str, str]:
        """Block until every job has ended; return the final states."""
        for job in self.jobs:
            job.wait()
        return {job.role: job.watcher.get_state(job.job_id, mode="force") for job in self.jobs}

    def cancel(self) -> None:
        """``scancel`` every job of the chain in one call (those already ended are left as they are).

        Raises:
            subprocess.CalledProcessError: scancel failed.
        """
        from fsdp_workflow.backends.slurm.submit import cancel

        cancel([job.job_id for job in self.jobs])


def _invalid(body: str, issues: Sequence["Issue"] = (), heading: str = "invalid config") -> SubmitError:
    return SubmitError(f"fsdp_workflow: {heading}\n{body}", EXIT_USAGE, issues)


def _validated(overrides: List[str]) -> Tuple["WorkflowConfig", "ValidationReport"]:
    """Compose and validate as the CLI's task does; every problem in one :class:`SubmitError`."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_workflow.config.errors import ConfigError, Issue
    from fsdp_workflow.config.hydra_errors import describe
    from fsdp_workflow.config.load import compose_collecting, experiment_selected, normalize_overrides
    from fsdp_workflow.launch.pipeline import NO_EXPERIMENT_HINT, Refused, validated
    from fsdp_workflow.backends.registry import backend_for

    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise _invalid(f"  {' '.join(flags)}: fsdp_workflow.submit takes overrides, not command-line flags; "
                       "for a sweep, call submit once per point, each with its own run_dir")
    if not any(o.startswith("run_dir=") for o in overrides):
        issue = Issue("run_dir", None, "fsdp_workflow.submit has no Hydra output directory to default to",
                      "pass run_dir=DIR, a directory on storage every node sees")
        raise _invalid(str(ConfigError([issue])), [issue])
    try:
        cfg, unknown = compose_collecting(overrides)
    except (HydraException, ValueError, yaml.YAMLError) as err:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            raise _invalid(f"  {err.full_key}: {err}") from None
        raise _invalid("\n".join("  " + line for line in describe(err).split("\n"))) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise _invalid(f"  {key}: {err}" if key else f"  {err}") from None
    mine: List[Issue] = []  # this API's own problems, after the pipeline's
    if not backend_for(cfg).queued:
        mine.append(Issue("cluster.kind", cfg.cluster.kind.name, "fsdp_workflow.submit submits to Slurm",
                          "add cluster=slurm (and cluster.partition=...), or run on this machine with "
                          "python -m fsdp_workflow"))
    if cfg.dry_run:
        mine.append(Issue("dry_run", True, "fsdp_workflow.submit submits; a dry run submits nothing",
                          "leave dry_run out, or plan with python -m fsdp_workflow dry_run=true"))
    hint = NO_EXPERIMENT_HINT if experiment_selected(normalize_overrides(overrides)) is None else ""
    try:
        return cfg, validated(cfg, first=unknown, last=mine, hint=hint)
    except Refused as err:
        raise _again(err) from None


def _again(err: "Refused") -> SubmitError:
    """The pipeline's refusal as this API's error: the same words and exit code."""
    return SubmitError(str(err), err.exit_code, err.issues)


def _submitted(cfg: "WorkflowConfig", report: "ValidationReport", overrides: List[str]) -> Chain:
    """The CLI's own pipeline, once the lock is held: write the run directory, submit its chain."""
    from fsdp_workflow.config.load import normalize_overrides
    from fsdp_workflow.backends.slurm.handles import ChainJob
    from fsdp_workflow.launch.pipeline import Refused, write_checked
    from fsdp_workflow.backends.slurm.submit import submit_checked

    try:
        plan = write_checked(cfg, report, command=[_CLI_PROGRAM, *normalize_overrides(overrides)])
        submitted, done = submit_checked(cfg, plan)
    except Refused as err:
        raise _again(err) from None
    if done:
        return Chain(plan.run_dir, (), note=done)
    layout = plan.layout
    return Chain(plan.run_dir, tuple(
        ChainJob(layout.logs, s.job_id, role=s.job.role, log=layout.log_file(s.job.role, s.job_id),
                 script=layout.script(s.job.script)) for s in submitted))


def submit(overrides: Optional[Sequence[str]] = None) -> Chain:
    """Compose, validate, plan and submit a run's chain to Slurm, as ``python -m fsdp_workflow`` does.

    Args:
        overrides: Hydra overrides, as on the command line, e.g. ``["+experiment=smoke",
            "cluster=slurm", "cluster.partition=debug", "run_dir=/scratch/me/r1"]``.
            ``run_dir`` is required (there is no Hydra output directory to default to) and
            ``cluster=slurm``: a local run is ``python -m fsdp_workflow``.

    Returns:
        The chain: a ``submitit.SlurmJob`` per job (``state``, ``done()``, ``wait()``,
        ``cancel()``, ``stdout()``, ``paths.stdout``), in submission order. Empty, with
        ``note`` saying where the model is, when the run in ``run_dir`` is already complete.

    Raises:
        SubmitError: with the CLI's message and exit code. 2 when ``overrides`` is one string
            (the message gives the list to pass instead), when the config is invalid
            (nothing was written or submitted), ``run_dir`` is locked by another command or
            has a chain still queued, or the cluster could never run the chain (nothing is
            left in the queue); 1 when ``sbatch`` failed otherwise.
    """
    from fsdp_workflow.launch.pipeline import Refused, lock_run_dir

    if isinstance(overrides, (str, bytes)):  # iterated, it would be one override per character
        text = overrides.decode() if isinstance(overrides, bytes) else overrides
        try:
            words: List[str] = shlex.split(text)
        except ValueError:
            words = text.split()
        raise _invalid(f"  overrides = {text!r}\n    why: fsdp_workflow.submit takes a list of overrides, one per "
                       f"word, not one string\n    fix: fsdp_workflow.submit({words!r})")
    ov = [str(o) for o in (overrides or [])]
    cfg, report = _validated(ov)
    try:
        lock = lock_run_dir(cfg, "planning and submitting the run (fsdp_workflow.submit)")
    except Refused as err:
        raise _again(err) from None
    try:
        return _submitted(cfg, report, ov)
    finally:
        lock.release()


__all__ = ["Chain", "SubmitError", "submit"]
