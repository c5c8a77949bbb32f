"""A run's training curves: ``metrics.jsonl``'s records (through the run record) as plottable columns.

``status`` (terminal curves, ``--plot``) and the model card (``loss_curve.png``) both take
their curves from :func:`series_of`, which reads the run record
(:mod:`fsdp_workflow.config.record`): one reader, one rule for a step logged twice. The
picture itself is drawn by one function, :func:`fsdp_workflow.report.plot.write_png`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from fsdp_workflow.config.record import StepRecords, read_steps


@dataclass
class Series:
    """One value per optimizer step.

    The trainer keeps each step once in ``metrics.jsonl``: a run starting at step N
    first drops the lines past N (``fsdp_workflow.train.metrics.keep_steps_up_to``).
    Should a file still hold a step twice (written by an older version), the record
    reader keeps the last line (:func:`fsdp_workflow.config.record.read_steps`), which
    is the same answer: the redone step.

    ``times`` are the wall-clock seconds at which each step was logged (``time``), so the
    pace includes checkpoint saves and evaluations, which ``step_time_s`` leaves out.
    """

    steps: List[int] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)  # nan where the line had none or a non-finite one
    tokens_per_s: List[float] = field(default_factory=list)
    mfu: List[float] = field(default_factory=list)  # fraction of peak_tflops
    times: List[float] = field(default_factory=list)
    step_time_s: List[float] = field(default_factory=list)
    eval_steps: List[int] = field(default_factory=list)
    eval_loss: List[float] = field(default_factory=list)
    # "PATH:51: not JSON": the lines that hold no step record, so ``status`` can say so (the last
    # line while it has no newline yet is being written, not broken, and is not listed)
    problems: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def up_to(self, step: int) -> "Series":
        """The steps at or before ``step`` (a model consolidated at step N shows its curve to N)."""
        n = sum(1 for x in self.steps if x <= step)
        e = sum(1 for x in self.eval_steps if x <= step)
        return Series(self.steps[:n], self.loss[:n], self.tokens_per_s[:n], self.mfu[:n], self.times[:n],
                      self.step_time_s[:n], self.eval_steps[:e], self.eval_loss[:e])


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def series_of(metrics: StepRecords) -> Series:
    """The curves of ``metrics.jsonl``'s records, one point per step (empty for an empty series).

    Args:
        metrics: :attr:`fsdp_workflow.config.record.RunRecord.metrics` (or :func:`read_steps` of a file).

    Returns:
        The columns; a value a line lacks (or holds as a non-number) is nan; broken lines in ``problems``.
    """
    s = Series(problems=list(metrics.problems))
    for step, rec in metrics:
        s.steps.append(step)
        s.loss.append(_num(rec.get("loss")))
        s.tokens_per_s.append(_num(rec.get("tokens_per_s")))
        s.mfu.append(_num(rec.get("mfu")))
        s.times.append(_num(rec.get("time")))
        s.step_time_s.append(_num(rec.get("step_time_s")))
        ev = _num(rec.get("eval_loss"))
        if math.isfinite(ev):
            s.eval_steps.append(step)
            s.eval_loss.append(ev)
    return s


def read_series(path: Path) -> Series:
    """:func:`series_of` a metrics file by path (tests, and a file outside a run directory)."""
    return series_of(read_steps(path))


def finite(xs: Sequence[int], ys: Sequence[float]) -> Tuple[List[int], List[float]]:
    """The (x, y) pairs whose y is a finite number."""
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def columns(xs: Sequence[float], ys: Sequence[float], num_cols: int, x0: float,
            x1: float) -> List[Optional[Tuple[float, float]]]:
    """Per column, the (min, max) of the points that fall in it (None where none does)."""
    out: List[Optional[Tuple[float, float]]] = [None] * num_cols
    span = (x1 - x0) or 1.0
    for x, y in zip(xs, ys):
        c = min(num_cols - 1, max(0, int((x - x0) / span * (num_cols - 1) + 0.5)))
        cur = out[c]
        out[c] = (y, y) if cur is None else (min(cur[0], y), max(cur[1], y))
    return out


def bridge(cols: List[Optional[Tuple[float, float]]]) -> List[Optional[Tuple[float, float]]]:
    """Fill the empty columns between two drawn ones by linear interpolation (fewer points than columns)."""
    known = [i for i, mm in enumerate(cols) if mm is not None]
    out = list(cols)
    for a, b in zip(known, known[1:]):
        ya, yb = cols[a][1], cols[b][0]  # type: ignore[index]
        for i in range(a + 1, b):
            y = ya + (yb - ya) * (i - a) / (b - a)
            out[i] = (y, y)
    return out
