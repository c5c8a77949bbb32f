"""A run's training curves read from ``metrics.jsonl``; ``status --plot``'s PNG when matplotlib is installed.

``status`` (terminal curves, ``--plot``) and the consolidator's model card (its small PNG:
:mod:`.pngplot`) both read the curves here: the status command and the consolidator may not
import each other, and neither may import the trainer. matplotlib is an optional extra
(``pip install 'fsdp_workflow[plot]'``) imported only inside :func:`write_png`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

PLOT_EXTRA = "pip install 'fsdp_workflow[plot]'  (or: pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message names the pip command."""


@dataclass
class Series:
    """One value per optimizer step.

    The trainer keeps each step once in ``metrics.jsonl``: a run starting at step N
    first drops the lines past N (``fsdp_workflow.train.metrics.keep_steps_up_to``).
    Should a file still hold a step twice (written by an older version), the last
    line wins here, which is the same answer: the redone step.

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


_CACHE: Dict[Tuple[str, int, int], Series] = {}


def read_series(path: Path) -> Series:
    """The curves of ``metrics.jsonl``, one point per step (empty when the file is missing).

    Broken lines are skipped and listed in ``problems``. Every reader of the curves
    (``status``, ``status --plot``, the model card) goes through here, so they all
    follow the one rule of :class:`Series`.

    Cached on (path, size, mtime): ``status`` reads it for the ETA and again for the curves.
    """
    try:
        st = os.stat(path)
    except OSError:
        return Series()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    by_step: Dict[int, dict] = {}
    problems: List[str] = []
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as err:
        return Series(problems=[f"{path}: unreadable: {err.strerror or err}"])
    with f:
        for num, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                if line.endswith("\n") and line.strip():
                    problems.append(f"{path}:{num}: not JSON")
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                by_step[step] = rec
            else:
                problems.append(f"{path}:{num}: not a step record (no integer \"step\")")
    s = Series(problems=problems)
    for step in sorted(by_step):
        rec = by_step[step]
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
    _CACHE.clear()  # one run at a time: keep only the latest read
    _CACHE[key] = s
    return s


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


def write_png(series: Series, out: Path, *, title: Optional[str] = None) -> Path:
    """Draw the curves into ``out`` (a PNG), written to a temporary name and renamed.

    Args:
        series: From :func:`read_series`.
        out: The PNG to write.
        title: The figure title.

    Returns:
        ``out``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        ValueError: the series has no finite loss to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from err
    xs, ys = finite(series.steps, series.loss)
    if not xs:
        raise ValueError("metrics.jsonl has no finite training loss to plot yet")
    fig = Figure(figsize=(8.0, 8.0), dpi=100, layout="constrained")
    axes = fig.subplots(3, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.plot(xs, ys, lw=1.2, label="training loss")
    if series.eval_steps:
        ax.plot(series.eval_steps, series.eval_loss, "o-", ms=4, lw=1.2, label="eval loss")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    for ax_, ys_, label, scale in ((axes[1], series.tokens_per_s, "tokens/s", 1.0),
                                   (axes[2], series.mfu, "MFU %", 100.0)):
        x2, y2 = finite(series.steps, ys_)
        ax_.plot(x2, [v * scale for v in y2], lw=1.0, color="tab:green")
        ax_.set_ylabel(label)
        ax_.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise
    return out
