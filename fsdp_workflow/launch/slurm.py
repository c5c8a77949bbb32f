"""Submit a planned run to Slurm through submitit: training, then consolidation afterok.

Called by ``python -m fsdp_workflow ... cluster=slurm`` after the run directory
is written; ``bash RUN_DIR/submit.sh`` submits the same chain with plain sbatch.

    python -m fsdp_workflow +experiment=smoke cluster=slurm cluster.partition=debug run_dir=/scratch/r1
    python -m fsdp_workflow.status /scratch/r1

Both jobs take their ``#SBATCH`` options from the plan (:func:`executor_parameters`).
The training job runs :class:`~fsdp_workflow.launch.slurm_task.TrainNodeTask` in
each node's task; submitit's own preemption requeue is replaced by the
``.requeue``-marker logic train.sbatch uses (see :mod:`fsdp_workflow.launch.slurm_task`
and docs/slurm.md for why).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.launch.slurm_task import CommandTask, TrainNodeTask
from fsdp_workflow.plan.render import pre_step_lines, site_env_lines, requeue_lines
from fsdp_workflow.plan.spec import JOBS_FILE, LOG_DIR, LaunchPlan, SbatchJob

SUBMITIT_DIR = "submitit"  # under the log dir: submitit's pickles and per-task logs

# #SBATCH option -> submitit parameter, for the options submitit itself knows.
# Everything else goes through ``additional_parameters`` verbatim (mem too: submitit
# would reparse "8G" as a number of GB).
_NATIVE = {
    "job-name": "job_name",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "nodes": "nodes",
    "ntasks-per-node": "ntasks_per_node",
    "cpus-per-task": "cpus_per_task",
    "time": "time",
    "gpus-per-node": "gpus_per_node",
    "constraint": "constraint",
    "exclusive": "exclusive",
}
_INT_PARAMS = {"nodes", "ntasks_per_node", "cpus_per_task", "time", "gpus_per_node"}


class SubmissionError(RuntimeError):
    """sbatch (through submitit) refused a job; the message says which and why."""


def executor_parameters(job: SbatchJob) -> Dict[str, Any]:
    """submitit ``update_parameters`` kwargs reproducing ``job.options`` exactly.

    Flags (value None) become ``True``, which submitit renders as ``#SBATCH --flag``.
    ``--signal`` and ``--open-mode`` go through ``additional_parameters``, which
    override submitit's own values for the same keys.
    """
    params: Dict[str, Any] = {}
    additional: Dict[str, Any] = {}
    for key, value in job.options:
        name = _NATIVE.get(key)
        if name is not None and value is None:
            params[name] = True
        elif name in _INT_PARAMS and value is not None and value.isdigit():
            params[name] = int(value)
        elif name is not None:
            params[name] = value
        else:
            additional.pop(key, None)  # a later duplicate (additional_parameters) wins
            additional[key] = True if value is None else value
    params["additional_parameters"] = additional
    params["stderr_to_stdout"] = True  # one log per task, like the sbatch path
    return params


def _executor(folder: Path, params: Dict[str, Any], **extra: Any):
    import submitit

    try:
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    except RuntimeError as err:  # "Could not detect srun"
        raise SubmissionError(
            f"{err} cluster=slurm needs Slurm's client commands (sbatch, srun) on PATH. "
            "Submit from a login node, or write the scripts with dry_run=true and run "
            "`bash RUN_DIR/submit.sh` there."
        ) from err
    ex.update_parameters(**params, **extra)
    return ex


def _submit(ex, fn, what: str):
    try:
        return ex.submit(fn)
    except Exception as err:  # noqa: BLE001 - sbatch's message is what the user needs
        raise SubmissionError(f"sbatch refused the {what} job: {str(err).strip()}") from err


def _srun_args(step_argv: List[str], command_len: int) -> List[str]:
    """The srun options of a plan step (``srun OPTS... COMMAND``), for submitit's own srun."""
    if step_argv[:1] != ["srun"]:
        return []
    return list(step_argv[1:len(step_argv) - command_len])


def train_executor_kwargs(plan: LaunchPlan) -> Dict[str, Any]:
    """Everything the training executor is given besides the #SBATCH options."""
    return {
        # --kill-on-bad-exit, --nodes, --ntasks-per-node and any container options:
        # the same srun options train.sbatch uses (the command, bash train_node.sh, is 2 words).
        "srun_args": _srun_args(plan.train.step_argv, 2),
        "setup": pre_step_lines(plan),
        # requeue_lines() starts with rc=$?, so it must follow the srun line directly.
        "teardown": requeue_lines(),
    }


def submit_chain(plan: LaunchPlan) -> Tuple[Any, Optional[Any]]:
    """Submit training, then consolidation afterok; cancel training if the second fails.

    Returns:
        The submitit jobs (train, consolidate or None).

    Raises:
        SubmissionError: with sbatch's message; nothing is left submitted.
    """
    folder = plan.run_dir / LOG_DIR / SUBMITIT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    train_ex = _executor(folder, executor_parameters(plan.train), **train_executor_kwargs(plan))
    task = TrainNodeTask(str(plan.run_dir), plan.master_port_base, plan.port_range, dict(plan.nccl_env))
    train_job = _submit(train_ex, task, "training")
    if plan.consolidate is None:
        return train_job, None
    try:
        params = executor_parameters(plan.consolidate)
        params["additional_parameters"]["kill-on-invalid-dep"] = "yes"
        cons_ex = _executor(folder, params, dependency=f"afterok:{train_job.job_id}", setup=site_env_lines(plan),
                            srun_args=_srun_args(plan.consolidate.step_argv, len(plan.consolidate_argv)))
        cons_job = _submit(cons_ex, CommandTask(list(plan.consolidate_argv)), "consolidation")
    except SubmissionError as err:
        cancelled = subprocess.run(["scancel", str(train_job.job_id)], capture_output=True, text=True)
        note = ("cancelled it" if cancelled.returncode == 0
                else f"could not cancel it ({cancelled.stderr.strip()}): run scancel {train_job.job_id}")
        raise SubmissionError(f"{err}\nThe training job {train_job.job_id} was submitted; {note}.") from err
    return train_job, cons_job


def submit(cfg: WorkflowConfig, plan: LaunchPlan) -> int:
    """Submit the chain, record it in RUN_DIR/jobs.txt, print how to follow it; never waits.

    Returns:
        0 when both jobs were submitted, 1 otherwise (a message says why).
    """
    try:
        train_job, cons_job = submit_chain(plan)
    except SubmissionError as err:
        print(f"fsdp_workflow: submission failed: {err}", file=sys.stderr)
        return 1
    lines = [f"train {train_job.job_id}"]
    if cons_job is not None:
        lines.append(f"consolidate {cons_job.job_id}")
    with open(plan.run_dir / JOBS_FILE, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    run_dir = plan.run_dir
    train_log = train_job.paths.stdout
    print(f"training job:      {train_job.job_id}  ({cfg.cluster.nodes} node(s) x 1 task, "
          f"{cfg.cluster.processes_per_node} process(es) per node)")
    print(f"  log:             {train_log}")
    if cons_job is not None:
        print(f"consolidation job: {cons_job.job_id}  (afterok:{train_job.job_id}, kill-on-invalid-dep)")
        print(f"  log:             {cons_job.paths.stdout}")
    print(f"follow:            python -m fsdp_workflow.status {shlex.quote(str(run_dir))}")
    print(f"                   tail -f {shlex.quote(str(train_log))}")
    return 0
