"""Submit the evaluation of one saved checkpoint as its own small Slurm job.

With ``consolidate.every_checkpoint=true`` the planner writes ``eval.sbatch`` and
``submit_eval.sh`` into the run directory; rank 0 of training calls
:func:`submit_checkpoint_eval` after each checkpoint is complete:

    from fsdp_workflow.launch.eval_jobs import submit_checkpoint_eval
    submit_checkpoint_eval(run_dir, step)   # returns at once; the job runs on CPU resources

The job consolidates ``checkpoints/step-N`` and appends its held-out perplexity
to ``RUN_DIR/evals.jsonl`` (:mod:`fsdp_workflow.launch.evaluate`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, Mapping, Optional

from fsdp_workflow.plan.spec import SUBMIT_EVAL_SCRIPT

# Set inside a job step or by torchrun; inherited by sbatch they would describe the
# training job to the new one (sbatch reads SBATCH_*, srun reads SLURM_*).
_STRIP_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "TORCHELASTIC_")
_STRIP_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER"}
# Which cluster to talk to is configuration, not job state: keep it.
_KEEP = {"SLURM_CONF"}


def clean_slurm_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``environ`` without the training job's Slurm and torchrun variables (SLURM_CONF kept)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k in _KEEP or not (k.startswith(_STRIP_PREFIXES) or k in _STRIP_NAMES)}


def snapshot_dir(run_dir: Path, step: int) -> Path:
    """Where :func:`snapshot_checkpoint` puts step N (``RUN_DIR/evals/pending/step-N``)."""
    return run_dir / "evals" / "pending" / f"step-{step}"


def snapshot_checkpoint(run_dir: Path, step: int) -> Path:
    """Hard-link ``checkpoints/step-N`` for its evaluation job.

    The trainer prunes old checkpoints (``checkpoint.keep_last``) while evaluations
    wait their turn; links keep the files alive, cost no copy, and are removed by
    the evaluation job.
    """
    src = run_dir / "checkpoints" / f"step-{step}"
    dst = snapshot_dir(run_dir, step)
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def submit_checkpoint_eval(run_dir: str | os.PathLike, step: int, wait: bool = False) -> Optional[int]:
    """Submit ``bash RUN_DIR/submit_eval.sh STEP`` from a cleaned environment.

    Args:
        run_dir: the run directory (holds submit_eval.sh when every_checkpoint is on).
        step: the step of a complete ``checkpoints/step-N``.
        wait: wait for sbatch (well under a second) and return the job id; by
            default return at once and report the outcome on stderr from a thread.

    Returns:
        The job id when ``wait`` and sbatch succeeded, else None. Never raises for a
        refused submission: a failed evaluation must not stop training.
    """
    script = Path(run_dir) / SUBMIT_EVAL_SCRIPT
    if not script.is_file():
        return None
    try:
        snapshot_checkpoint(Path(run_dir), step)
    except OSError as err:
        print(f"[fsdp_workflow] evaluation of step {step} skipped: cannot snapshot it: {err}", file=sys.stderr)
        return None
    proc = subprocess.Popen(["bash", str(script), str(int(step))], env=clean_slurm_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def report() -> Optional[int]:
        out, err = proc.communicate()
        if proc.returncode != 0:
            print(f"[fsdp_workflow] evaluation of step {step} not submitted: {err.strip()}", file=sys.stderr)
            return None
        job_id = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"[fsdp_workflow] evaluation of step {step}: job {job_id}", file=sys.stderr)
        return int(job_id) if job_id.isdigit() else None

    if wait:
        return report()
    threading.Thread(target=report, name=f"eval-submit-{step}", daemon=True).start()
    return None
