"""One evaluation's result: its line of ``RUN_DIR/evals.jsonl``, and the run's experiment trackers.

Each line: ``{"step", "status", "job_id", "seconds"}``, with ``"loss", "perplexity",
"num_tokens"`` when ``status`` is ``ok``, ``"ema_loss", "ema_perplexity"`` when the run keeps
an EMA of the weights (``train.ema_decay``; measured on the same tokens), and ``"reason"``
when it is ``skipped`` (the checkpoint was pruned before the job ran, or the run keeps no
held-out data) or ``failed``. ``status`` reads these lines back.
"""

from __future__ import annotations

import fcntl
import json
import logging
from typing import Optional, TypedDict

from .run import EvalRun

log = logging.getLogger(__name__)

OK, SKIPPED, FAILED = "ok", "skipped", "failed"


class EvalRecord(TypedDict, total=False):
    """One line of ``evals.jsonl``; ``step``, ``status`` and ``job_id`` are always there."""

    step: int
    status: str  # OK, SKIPPED or FAILED
    job_id: Optional[str]  # SLURM_JOB_ID of the evaluation job (None when run by hand)
    reason: str  # why it was skipped or failed
    loss: float  # mean loss per trained held-out token
    perplexity: float  # exp(loss)
    num_tokens: int  # trained held-out tokens measured
    ema_loss: float  # the same, for the EMA of the weights
    ema_perplexity: float
    seconds: float  # wall time of consolidation and measurement


def append_record(run: EvalRun, record: EvalRecord) -> None:
    """Append ``record`` as one JSON line of ``evals.jsonl``, under a lock: evaluation jobs may finish together.

    Args:
        run: the run (its ``evals.jsonl``).
        record: the evaluation's result.
    """
    with open(run.layout.evals_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def track_result(run: EvalRun, record: EvalRecord) -> None:
    """Log ``record`` to the run's experiment trackers (``train.report_to``); never fails the job.

    Args:
        run: the run (its config names the trackers; they resume the training's runs).
        record: the evaluation's result (only ``ok`` lines carry values).
    """
    from fsdp_workflow.train.trackers import log_checkpoint_eval

    try:
        logged = log_checkpoint_eval(run.cfg, run.layout, record)
    except Exception as err:  # noqa: BLE001 - evals.jsonl has the result; a tracker error must not lose it
        log.warning("step %s: could not log to the experiment trackers: %s", record.get("step"), err)
        return
    if logged:
        log.info("step %s: logged to %s", record.get("step"), ", ".join(logged))
