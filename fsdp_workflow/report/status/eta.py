"""How far a run is and how long it has left: pace, ETA, time left in the Slurm allocation, requeues.

The pace is the median wall-clock time between consecutive steps' ``time`` stamps in
``metrics.jsonl`` over the last :data:`PACE_WINDOW` steps (checkpoint saves and
evaluations included; the gap of a requeue is one outlier the median ignores). The time
left is the running training job's ``TimeLimit`` minus its ``RunTime`` from ``scontrol``.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from fsdp_workflow.config.record import RunRecord
from fsdp_workflow.report.curves import Series, series_of
from fsdp_workflow.backends.base import JobStatus

PACE_WINDOW = 20  # steps
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


@dataclass
class Progress:
    """The numbers behind the status's progress lines (all in ``--json``)."""

    step: Optional[int] = None  # last step in metrics.jsonl
    max_steps: Optional[int] = None  # train.max_steps of config.yaml
    sec_per_step: Optional[float] = None  # median wall-clock seconds per step, last PACE_WINDOW steps
    eta_s: Optional[float] = None  # (max_steps - step) * sec_per_step
    time_left_s: Optional[float] = None  # in the running training job's allocation
    time_limit_s: Optional[float] = None  # that job's TimeLimit
    train_job: str = ""  # the job the time left is for
    requeues: Optional[int] = None  # restarts of the training jobs (None: nothing submitted)
    max_requeues: Optional[int] = None  # cluster.max_requeues, as the training log states it
    loss: Optional[float] = None
    eval_loss: Optional[float] = None
    eval_step: Optional[int] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None


def slurm_seconds(text: str) -> Optional[float]:
    """Seconds of a Slurm duration (``[D-]HH:MM:SS``, ``MM:SS``); None for UNLIMITED and the like."""
    m = _SLURM_TIME.match(text.strip())
    if not m:
        return None
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def seconds_per_step(series: Series, window: int = PACE_WINDOW) -> Optional[float]:
    """Median wall-clock seconds between consecutive logged steps among the last ``window`` steps.

    Falls back to the trainer's own ``step_time_s`` when the lines carry no ``time``.
    """
    gaps = []
    start = max(1, len(series) - window)
    for i in range(start, len(series)):
        dt = series.times[i] - series.times[i - 1]
        if series.steps[i] - series.steps[i - 1] == 1 and math.isfinite(dt) and dt > 0:
            gaps.append(dt)
    if not gaps:
        gaps = [t for t in series.step_time_s[-window:] if math.isfinite(t) and t > 0]
    return statistics.median(gaps) if gaps else None


def _last(xs: Sequence[float]) -> Optional[float]:
    for v in reversed(xs):
        if math.isfinite(v):
            return v
    return None


def progress(series: Series, max_steps: Any, jobs: List[JobStatus]) -> Progress:
    """The progress numbers of a run.

    Args:
        series: metrics.jsonl's curves.
        max_steps: ``train.max_steps`` from config.yaml (anything non-int: unknown).
        jobs: The run's jobs (the ``train`` ones give the time left and the requeues).

    Returns:
        The numbers; what cannot be known stays None.
    """
    p = Progress(max_steps=max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None)
    if len(series):
        p.step = series.steps[-1]
        p.sec_per_step = seconds_per_step(series)
        p.loss, p.tokens_per_s, p.mfu = _last(series.loss), _last(series.tokens_per_s), _last(series.mfu)
    if series.eval_steps:
        p.eval_step, p.eval_loss = series.eval_steps[-1], series.eval_loss[-1]
    if p.max_steps is not None and p.sec_per_step is not None and p.step is not None:
        p.eta_s = max(0, p.max_steps - p.step) * p.sec_per_step
    train = [j for j in jobs if j.role == "train"]
    if train:
        p.requeues = sum(j.restarts for j in train)
        p.max_requeues = next((j.max_requeues for j in reversed(train) if j.max_requeues is not None), None)
    for j in reversed(train):
        if j.status == "running":
            p.train_job = j.job_id
            p.time_limit_s = slurm_seconds(j.time_limit)
            ran = slurm_seconds(j.run_time)
            if p.time_limit_s is not None and ran is not None:
                p.time_left_s = max(0.0, p.time_limit_s - ran)
            break
    return p


def run_progress(record: RunRecord, jobs: List[JobStatus]) -> Progress:
    """:func:`progress` of a run: its metrics series and the typed config's ``train.max_steps``.

    Args:
        record: the run's record.
        jobs: its jobs (:func:`progress`).

    Returns:
        The numbers; ``max_steps`` is unknown when the config does not load.
    """
    cfg = record.config
    return progress(series_of(record.metrics), cfg.train.max_steps if cfg is not None else None, jobs)


def duration(seconds: float) -> str:
    """``2d04h``, ``1h02m``, ``3m05s``, ``12s``."""
    s = int(round(seconds))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def progress_lines(p: Optional[Progress]) -> List[str]:
    """The progress lines of the status text (none before anything was logged or submitted)."""
    if p is None:
        return []
    lines = []
    if p.step is not None:
        of = f" of {p.max_steps} ({100 * p.step / p.max_steps:.0f}%)" if p.max_steps else ""
        pace = f", {p.sec_per_step:.3g} s/step (median of the last {PACE_WINDOW})" if p.sec_per_step else ""
        if p.max_steps is not None and p.step >= p.max_steps:
            left = ", all steps done"
        elif p.eta_s is not None:
            left = f", ETA {duration(p.eta_s)}"
        else:
            left = ""
        lines.append(f"progress: step {p.step}{of}{pace}{left}")
    if p.time_left_s is not None:
        limit = f" of {duration(p.time_limit_s)}" if p.time_limit_s else ""
        line = f"slurm time left: {duration(p.time_left_s)}{limit} (train job {p.train_job})"
        if p.eta_s is not None and p.eta_s > p.time_left_s:
            line += "; training outlasts it: a requeue continues from the last checkpoint"
        lines.append(line)
    elif p.requeues is not None and p.eta_s:
        lines.append("slurm time left: no training job running")
    if p.requeues is not None:
        cap = f" of cluster.max_requeues={p.max_requeues}" if p.max_requeues is not None else ""
        lines.append(f"requeues: {p.requeues}{cap}")
    return lines


__all__ = ["PACE_WINDOW", "Progress", "duration", "progress", "progress_lines", "run_progress", "seconds_per_step", "slurm_seconds"]
