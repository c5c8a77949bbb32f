"""One live chain per run directory, and a finished run is not run again.

Submitting the same command twice used to start a second chain in the same run
directory: both trained into one ``checkpoints/``, one crashed on the other's
``step-N.tmp``, and ``metrics.jsonl`` interleaved them. After a chain finished,
the same command trained 0 steps and then failed its consolidation on the
existing ``hf_model``. So before anything is submitted (and, for the CLI, before
planning rewrites the run directory: :func:`live_chain_problem` needs only the
directory):

- a job of ``jobs.txt`` that Slurm still lists as pending, running or requeued
  refuses (exit 2), naming each job, its state and reason, and how to follow
  (``status``) or cancel it (``scancel``);
- a run trained to ``train.max_steps`` whose model is written is complete:
  :func:`~fsdp_workflow.backends.finished.finished_message` says where the model is;
  nothing is submitted (exit 0);
- a model written by an earlier, shorter run must be moved aside before the run is
  continued (a larger ``train.max_steps``): ``finished_message`` refuses, exit 2.
  The local backend asks the same question (:mod:`fsdp_workflow.backends.finished`).

``submit.sh`` renders the live-chain rule in shell (:func:`fsdp_workflow.backends.slurm.scripts.chain_guard_lines`)
and asks this module whether the run is complete, with the planning interpreter:

    python -m fsdp_workflow.launch.chain_guard RUN_DIR --max-steps N [--consolidates]

which exits 0 printing nothing (go on), 0 printing that the run is complete, or 2
with the reason on stderr (an earlier, shorter run's model to move aside).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional, Tuple

from fsdp_workflow.config.record import open_run
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.backends.finished import finished_message
from fsdp_workflow.backends.slurm.queue import SlurmQueue, SlurmUnreachable

SQUEUE_TIMEOUT_S = 30


def live_jobs(layout: RunDir) -> List[Tuple[str, str, str, str]]:
    """``(role, job id, state, reason)`` of every job of ``jobs.txt`` Slurm still lists as not ended.

    Raises:
        SlurmUnreachable: squeue is missing or failed for another reason than unknown ids.
    """
    submitted = layout.submitted_jobs()
    if not submitted:
        return []
    roles = {job_id: role for role, job_id in submitted}
    queue = SlurmQueue(SQUEUE_TIMEOUT_S).squeue(list(roles))
    return [(roles[i], i, job.state.value, job.reason) for i, job in queue.items()
            if i in roles and not job.state.ended]


def live_chain_problem(run_dir: Path) -> Optional[str]:
    """Why ``run_dir`` must not be planned or submitted again now: a live chain, or Slurm unreachable.

    Call before planning rewrites the run directory (its scripts, config and code
    snapshot are what the queued jobs will run).

    Args:
        run_dir: the run directory (holding ``jobs.txt`` once submitted).

    Returns:
        None when no job of ``jobs.txt`` is pending or running; else the message to print (exit 2).
    """
    layout = open_run(run_dir).layout  # cluster.log_dir as the run's config sets it
    try:
        live = live_jobs(layout)
    except SlurmUnreachable as err:
        return (f"{layout.jobs} lists jobs, and Slurm cannot be asked whether they still run ({err}); "
                "nothing was planned or submitted. Retry where squeue answers.")
    if not live:
        return None
    jobs = "\n".join(f"  {role} job {job_id}: {state}" + (f" ({reason})" if reason and reason != "None" else "")
                     for role, job_id, state, reason in live)
    return (f"a chain of this run directory ({layout.root}) is still in the queue; nothing was planned or "
            f"submitted:\n{jobs}\n"
            f"follow it:  {shlex.join(['python', '-m', 'fsdp_workflow.status', str(layout.root)])}\n"
            f"or cancel it, then submit again:  {shlex.join(['scancel', *[j[1] for j in live]])}")


def main(argv: Optional[List[str]] = None) -> int:
    """``submit.sh``'s question: is this run complete, or must an old model be moved first?

    Returns:
        0 to submit (nothing printed) or for a complete run (the message on stdout);
        2 for a model of an earlier, shorter run (the message on stderr).
    """
    import argparse
    import sys

    from fsdp_workflow.core.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m fsdp_workflow.launch.chain_guard",
                                     description="Whether the run in RUN_DIR is complete (submit.sh asks it).")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-steps", type=int, required=True, help="train.max_steps of the plan to submit")
    parser.add_argument("--consolidates", action="store_true", help="the chain ends with a consolidation job")
    args = parser.parse_args(argv)
    setup_logging("WARNING")  # a damaged newest checkpoint is named on stderr
    message, rc = finished_message(open_run(args.run_dir).layout, args.max_steps, args.consolidates)
    if message is not None:
        print(f"submit.sh: {message}", file=sys.stderr if rc else sys.stdout)
    return rc


__all__ = ["SlurmUnreachable", "live_chain_problem", "live_jobs", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
