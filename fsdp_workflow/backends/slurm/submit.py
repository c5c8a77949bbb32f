"""Submit a planned run to Slurm: the run directory's own scripts, training then consolidation afterok.

Called by ``python -m fsdp_workflow ... cluster=slurm`` after the run directory
is written; ``bash RUN_DIR/submit.sh`` submits the same chain without Python.

    python -m fsdp_workflow +experiment=smoke cluster=slurm cluster.partition=debug run_dir=/scratch/r1
    python -m fsdp_workflow.status /scratch/r1

Both routes run the same ``sbatch`` argument lists
(:func:`fsdp_workflow.backends.slurm.scripts.sbatch_argv`) on the same batch scripts, so
what Slurm holds for every job (``scontrol write batch_script ID``) is, byte
for byte, the ``train.sbatch`` / ``consolidate.sbatch`` in the run directory.
That is why submission does not go through submitit's executor: it writes a
batch script of its own around a pickled function, which is not the script a
user reads when a job fails (docs/slurm.md).

Before the first sbatch, every job is checked against the cluster's partitions,
nodes and QoS (:mod:`fsdp_workflow.backends.slurm.cluster_check`); right after the last,
the jobs' pending reasons are read (:mod:`fsdp_workflow.backends.slurm.pending`). Either
refusing exits 2 with the key to change, and leaves no job in the queue.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

from fsdp_workflow.backends.base import Refused, Role, refused
from fsdp_workflow.config.errors import ConfigError, Issue
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import SUBMIT_SCRIPT
from fsdp_workflow.backends.slurm import pending
from fsdp_workflow.backends.finished import finished_message
from fsdp_workflow.backends.slurm.live_chain import live_chain_problem
from fsdp_workflow.backends.slurm.cluster_check import check_chain, skipped_line
from fsdp_workflow.backends.slurm.cluster_info import ClusterUnreachable, read_cluster
from fsdp_workflow.backends.slurm.scripts import sbatch_argv
from fsdp_workflow.plan.jobs import NOUN, LaunchPlan, SbatchJob, job_label
from fsdp_workflow.plan.render import shell_join

log = logging.getLogger(__name__)

SBATCH_TIMEOUT_S = 120  # a busy controller can take a while; never hang the login shell forever


class SubmissionError(RuntimeError):
    """sbatch refused a job; the message says which and why.

    Attributes:
        role: the refused job's role ("" when sbatch could not be run at all).
        text: sbatch's own words.
        cancelled: what happened to the jobs submitted before it (one line each).
    """

    def __init__(self, message: str, role: str = "", text: str = "", cancelled: str = "") -> None:
        super().__init__(message)
        self.role, self.text, self.cancelled = role, text, cancelled


# sbatch's refusal -> (the key for the training job, the key for a CPU job, what to do). First match wins.
_REFUSALS = [
    ("invalid partition", ("cluster.partition", "cluster.consolidate_partition"),
     "a partition that exists (sinfo -s lists them)"),
    ("invalid account", ("cluster.account", "cluster.account"), "one of your accounts (sacctmgr show assoc user=$USER)"),
    ("invalid qos", ("cluster.qos", "cluster.qos"), "a QoS you may use (sacctmgr show assoc user=$USER)"),
    ("memory specification", ("cluster.mem_gb", "cluster.consolidate_mem_gb"),
     "at most a node's memory in GB (sinfo -o '%N %m' gives MB)"),
    ("time limit", ("cluster.time_min", "cluster.consolidate_time_min"),
     "at most the partition's MaxTime (sinfo -o '%P %l')"),
    ("invalid feature", ("cluster.constraint", "cluster.constraint"), "features the nodes have (sinfo -o '%N %f')"),
    ("invalid generic resource", ("cluster.gpus_per_node", "cluster.gpus_per_node"),
     "the GPUs the nodes have (sinfo -o '%N %G')"),
    ("node configuration is not available", ("cluster.cpus_per_task", "cluster.consolidate_cpus"),
     "a request some node can meet: CPUs, GPUs, memory, cluster.constraint (sinfo -o '%N %c %m %G %f')"),
]


def sbatch_refusal_issue(cfg: WorkflowConfig, err: "SubmissionError") -> Optional[Issue]:
    """sbatch's refusal as a config problem on the key that set the option, where it can be told.

    Returns:
        The issue, or None when sbatch's words name no option we set (then it stays exit 1).
    """
    text = err.text.lower()
    for needle, (train_key, cpu_key), fix in _REFUSALS:
        if needle in text:
            key = train_key if err.role == Role.train else cpu_key
            if key == "cluster.consolidate_partition" and not cfg.cluster.consolidate_partition:
                key = "cluster.partition"  # the CPU jobs use the training partition unless told
            value: object = cfg
            for part in key.split("."):
                value = getattr(value, part, None)
            said = "; ".join(line.strip() for line in err.text.splitlines() if line.strip())
            return Issue(key, value, f"sbatch refused the {NOUN.get(err.role, err.role)} job: {said}",
                         f"set {key} to {fix}")
    return None


class ClusterLimitError(ConfigError):
    """The chain asks for what the cluster never gives: a config error, found against the cluster (exit 2)."""

    def __init__(self, issues: List[Issue], note: str = "") -> None:
        super().__init__(issues)
        self.note = note

    def __str__(self) -> str:
        return super().__str__() + (f"\n  {self.note}" if self.note else "")


@dataclass(frozen=True)
class Submitted:
    """One job of the chain as Slurm accepted it."""

    job: SbatchJob
    job_id: str


def _sbatch(argv: List[str], what: str) -> str:
    """Run one ``sbatch --parsable`` command; return the job id.

    Raises:
        SubmissionError: sbatch is missing, refused the job, or printed no id.
    """
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    except FileNotFoundError as err:
        raise SubmissionError(
            f"{err.filename or 'sbatch'} not found: cluster=slurm needs Slurm's client commands on PATH. "
            "Submit from a login node, or write the scripts with dry_run=true and run "
            f"`bash RUN_DIR/{SUBMIT_SCRIPT}` there.") from err
    except subprocess.TimeoutExpired as err:
        raise SubmissionError(f"sbatch did not answer within {SBATCH_TIMEOUT_S} s for the {what} job") from err
    job_id = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not job_id.isdigit():
        msg = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
        raise SubmissionError(f"sbatch refused the {what} job: {msg}", text=msg)
    return job_id


def cancel(job_ids: List[str]) -> None:
    """``scancel`` the jobs in one call (those already ended are left as they are).

    Raises:
        subprocess.CalledProcessError: scancel failed.
    """
    if job_ids:
        subprocess.run(["scancel", *job_ids], check=True, capture_output=True, text=True)


def _cancel(jobs: List[Submitted]) -> str:
    """Cancel jobs already submitted; say what happened to each."""
    if not jobs:
        return ""
    ids = [s.job_id for s in jobs]
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if proc.returncode == 0:
        return "".join(f"\nThe {NOUN[s.job.role]} job {s.job_id} was submitted; cancelled it." for s in jobs)
    return "".join(f"\nThe {NOUN[s.job.role]} job {s.job_id} was submitted; could not cancel it "
                   f"({proc.stderr.strip()}): run scancel {s.job_id}." for s in jobs)


def submit_chain(plan: LaunchPlan) -> List[Submitted]:
    """Submit every job of ``plan.chain`` in order, each ``afterok`` the one it waits for.

    Returns:
        The jobs as submitted.

    Raises:
        SubmissionError: with sbatch's message; the jobs submitted before are cancelled.
    """
    plan.layout.logs.mkdir(parents=True, exist_ok=True)  # sbatch does not create --output's directory
    done: List[Submitted] = []
    for job in plan.chain:
        after = next((s.job_id for s in done if s.job.role == job.after), None)
        try:
            done.append(Submitted(job, _sbatch(sbatch_argv(job, plan.run_dir, after), NOUN[job.role])))
        except SubmissionError as err:
            cancelled = _cancel(done)
            raise SubmissionError(f"{err}{cancelled}", job.role, err.text, cancelled.strip()) from err
    return done


def _id_of(submitted: List[Submitted], role: Optional[str]) -> str:
    return next(s.job_id for s in submitted if s.job.role == role)


def check_limits(cfg: WorkflowConfig, plan: LaunchPlan) -> None:
    """Judge every job of the chain against the cluster's limits; print the warnings.

    Skipped, with a line saying how to run it later, when Slurm does not answer
    (sbatch will say the same) or ``cluster.check_limits=false``.

    Raises:
        ClusterLimitError: a job could never start; nothing is submitted.
    """
    if not cfg.cluster.check_limits:
        log.info("fsdp_workflow: cluster checks off (cluster.check_limits=false)")
        return
    try:
        limits = read_cluster()
    except ClusterUnreachable as err:
        log.warning("fsdp_workflow: warning: %s", skipped_line(str(plan.run_dir), why=str(err)))
        return
    report = check_chain(cfg, plan, limits)
    for warning in report.warnings:
        log.warning("fsdp_workflow: warning: %s", warning.format())
    if report.errors:
        raise ClusterLimitError(report.errors, "checked against the cluster before submitting (scontrol, sacctmgr); "
                                "nothing was submitted. To submit anyway: cluster.check_limits=false")


def refuse_never_starting(cfg: WorkflowConfig, submitted: List[Submitted]) -> None:
    """Read the pending reasons just after submitting; cancel the whole chain if one means "never".

    Raises:
        ClusterLimitError: a job can never start; every job of the chain was cancelled.
    """
    stuck = pending.watch([(s.job, s.job_id) for s in submitted])
    if not stuck:
        return
    ids = [s.job_id for s in submitted]
    left = pending.cancel_and_wait(ids)
    note = f"cancelled the whole chain ({', '.join(ids)}): none of it stays in the queue."
    if left:
        note = f"cancelled the chain, but squeue still lists {', '.join(left)}: run scancel {' '.join(left)}."
    raise ClusterLimitError(pending.issues(cfg, stuck), note)


def as_config_error(cfg: WorkflowConfig, err: SubmissionError) -> Optional[ClusterLimitError]:
    """sbatch's refusal of an option we set, as a config error naming the key (exit 2); else None (exit 1)."""
    refused = sbatch_refusal_issue(cfg, err)
    if refused is None:
        return None
    note = " ".join(line.strip() for line in err.cancelled.splitlines() if line.strip())
    return ClusterLimitError([refused], (note + " " if note else "") + "Nothing of this chain is left in the queue.")


def submit_recorded(cfg: WorkflowConfig, plan: LaunchPlan) -> List[Submitted]:
    """Check the chain against the cluster, submit it, and append it to RUN_DIR/jobs.txt.

    The CLI (:func:`submit`) and the Python API (:func:`fsdp_workflow.api.submit`) both
    submit through here: the same checks, the same ``sbatch`` commands, the same record.

    Returns:
        The jobs as submitted, in chain order.

    Raises:
        ClusterLimitError: the cluster could never start a job; nothing is left in the queue.
        SubmissionError: sbatch failed; the jobs submitted before were cancelled
            (:func:`as_config_error` tells whether it was an option we set).
    """
    check_limits(cfg, plan)
    submitted = submit_chain(plan)
    refuse_never_starting(cfg, submitted)
    with open(plan.layout.jobs, "a") as f:
        f.write("".join(f"{s.job.role} {s.job_id}\n" for s in submitted))
    return submitted


def submit_checked(cfg: WorkflowConfig, plan: LaunchPlan) -> Tuple[List[Submitted], str]:
    """The pipeline's last step (:mod:`fsdp_workflow.launch.pipeline`): submit a written run, or say why not.

    Returns:
        The jobs as submitted, in chain order, and ``""``; or no jobs and the line saying
        that the run is already complete (nothing submitted).

    Raises:
        Refused: exit 2 when a chain of the run directory is still queued or running, when
            the cluster could never start it or sbatch refused an option we set (the key
            named; nothing left in the queue), or an old model must be moved first; exit 1
            when sbatch failed otherwise.
    """
    problem = live_chain_problem(plan.run_dir)  # asked before planning too; this is the last word
    if problem:
        raise Refused(f"fsdp_workflow: {problem}")
    done, rc = finished_message(plan.layout, plan.max_steps, plan.consolidate is not None)
    if done:
        if rc:
            raise Refused(f"fsdp_workflow: {done}", rc)
        return [], done
    try:
        return submit_recorded(cfg, plan), ""
    except ClusterLimitError as err:
        raise refused(str(err), issues=err.issues) from None
    except SubmissionError as err:
        limit = as_config_error(cfg, err)
        if limit is not None:  # an option we set: the key, like any invalid config (exit 2)
            raise refused(str(limit), issues=limit.issues) from None
        raise Refused(f"fsdp_workflow: submission failed: {err}", 1) from None


def submit(cfg: WorkflowConfig, plan: LaunchPlan) -> int:
    """Check the chain against the cluster, submit it, record it in RUN_DIR/jobs.txt; never waits for it to run.

    Returns:
        0 when every job was submitted, or the run is already complete (nothing submitted);
        otherwise :func:`submit_checked`'s refusal's code, its message printed (exit 1: logged).
    """
    try:
        submitted, done = submit_checked(cfg, plan)
    except Refused as err:
        if err.exit_code == 1:  # sbatch failed: into the run's log as well
            log.error("%s", err)
        else:
            print(err, file=sys.stderr)
        return err.exit_code
    if done:
        print(f"fsdp_workflow: {done}")
        return 0
    train = next(s for s in submitted if s.job is plan.train)
    for s in submitted:
        if s is train:
            detail = (f"{cfg.cluster.nodes} node(s) x 1 task, {cfg.cluster.processes_per_node} process(es) per node"
                      + (f", afterok:{_id_of(submitted, s.job.after)}" if s.job.after else ""))
        elif s.job.after:
            detail = f"afterok:{_id_of(submitted, s.job.after)}, kill-on-invalid-dep"
        else:
            detail = "CPU"
        print(f"{job_label(s.job.role)}{s.job_id}  ({detail})")
        print(f"  log:             {plan.layout.log_file(s.job.role, s.job_id)}")
    print("follow:            " + shell_join(["python", "-m", "fsdp_workflow.status", str(plan.run_dir)]))
    print("                   " + shell_join(["tail", "-f", str(plan.layout.log_file(train.job.role, train.job_id))]))
    return 0
