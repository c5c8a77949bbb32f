"""Training curves drawn as terminal text: braille dots, y-axis labels, a step axis.

Each character cell holds 2 x 4 braille dots. A run longer than the plot is wide is
downsampled per dot column to the column's min and max, joined to the neighbouring
columns, so a loss spike of a single step stays visible. Eval losses are drawn over the
training loss as ``o``. Only the standard library is used.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from fsdp_workflow.report.curves import Series, bridge, columns, finite

# braille dot bits by (x 0..1, y 0..3 from the top)
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
EVAL_MARK = "o"
MIN_WIDTH = 40


def _label(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.3f}"
    return f"{v:.4f}"


def plot(xs: Sequence[float], ys: Sequence[float], width: int, height: int, *,
         marks: Tuple[Sequence[float], Sequence[float]] = ((), ()),
         fmt=_label) -> List[str]:
    """A braille line chart, ``width`` columns wide (labels included), ``height`` rows plus a step axis.

    Args:
        xs, ys: The points (finite ys only), xs ascending.
        width: Total width in characters.
        height: Rows of the plotting area.
        marks: (xs, ys) drawn as ``o`` over the line (eval losses).
        fmt: y-label formatter.

    Returns:
        ``height + 2`` lines, none wider than ``width``.
    """
    all_y = list(ys) + list(marks[1])
    lo, hi = min(all_y), max(all_y)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    labels = [fmt(hi), fmt((lo + hi) / 2), fmt(lo)]
    lw = max(len(s) for s in labels)
    plot_w = width - lw - 2  # "label ┤" + area
    cols = plot_w * 2
    rows = height * 4
    x0, x1 = min(list(xs) + list(marks[0])), max(list(xs) + list(marks[0]))
    grid = [[0] * plot_w for _ in range(height)]

    def dot_row(y: float) -> int:
        return min(rows - 1, max(0, int(round((hi - y) / (hi - lo) * (rows - 1)))))

    prev: Optional[Tuple[int, int]] = None
    for c, mm in enumerate(bridge(columns(xs, ys, cols, x0, x1))):
        if mm is None:
            continue
        top, bot = dot_row(mm[1]), dot_row(mm[0])
        if prev is not None:  # join to the previous column so the line has no gaps
            top, bot = min(top, prev[1]), max(bot, prev[0])
        for r in range(top, bot + 1):
            grid[r // 4][c // 2] |= _DOTS[c % 2][r % 4]
        prev = (dot_row(mm[1]), dot_row(mm[0]))
    text = [[chr(0x2800 + v) if v else " " for v in row] for row in grid]
    for c, mm in enumerate(columns(marks[0], marks[1], cols, x0, x1)):
        if mm is not None:
            text[dot_row(mm[0]) // 4][c // 2] = EVAL_MARK
    mid = height // 2
    out = []
    for i, row in enumerate(text):
        lab = labels[0] if i == 0 else labels[2] if i == height - 1 else labels[1] if i == mid else ""
        tick = "┤" if lab else "│"
        out.append(f"{lab:>{lw}} {tick}{''.join(row)}".rstrip())
    out.append(" " * lw + " └" + "─" * plot_w)
    left, right = f"{x0:g}", f"{x1:g}"
    mid_x = f"{round((x0 + x1) / 2):g}" if x1 - x0 >= 4 else ""
    axis = [" "] * (lw + 2 + plot_w)
    for pos, s in ((lw + 2, left), (lw + 2 + plot_w // 2 - len(mid_x) // 2, mid_x), (lw + 2 + plot_w - len(right), right)):
        for k, ch in enumerate(s):
            if 0 <= pos + k < len(axis):
                axis[pos + k] = ch
    out.append("".join(axis).rstrip())
    return out


def _side_by_side(a: List[str], b: List[str], width: int) -> List[str]:
    n = max(len(a), len(b))
    a, b = a + [""] * (n - len(a)), b + [""] * (n - len(b))
    return [f"{x:<{width}}  {y}".rstrip() for x, y in zip(a, b)]


def curve_block(series: Series, width: int = 80) -> List[str]:
    """The curves section of the status text: loss (with eval losses), then tokens/s and MFU side by side.

    Args:
        series: metrics.jsonl's curves.
        width: The terminal width (at least :data:`MIN_WIDTH` is used).

    Returns:
        Lines no wider than ``max(width, MIN_WIDTH)``; one line saying so when nothing is logged yet.
    """
    width = max(MIN_WIDTH, width)
    xs, ys = finite(series.steps, series.loss)
    if not xs:
        return ["curves: no training step logged in metrics.jsonl yet"]
    head = f"loss (step {xs[-1]}: {ys[-1]:.4f}"
    if series.eval_loss:
        head += f"; eval {series.eval_loss[-1]:.4f} at step {series.eval_steps[-1]}, drawn {EVAL_MARK}"
    skipped = len(series) - len(xs)
    head += ")" + (f"; {skipped} non-finite not drawn" if skipped else "")
    lines = [head[:width]] + plot(xs, ys, width, 10, marks=(series.eval_steps, series.eval_loss))
    half = (width - 2) // 2
    tx, ty = finite(series.steps, series.tokens_per_s)
    mx, my = finite(series.steps, series.mfu)
    if tx and mx:
        left = [f"tokens/s (last {ty[-1]:,.0f})"[:half]] + plot(tx, ty, half, 4)
        right = [f"MFU % (last {100 * my[-1]:.2f})"[:half]] + plot(mx, [100 * v for v in my], half, 4,
                                                                    fmt=lambda v: f"{v:.2f}")
        lines += [""] + _side_by_side(left, right, half)
    return lines


__all__ = ["EVAL_MARK", "columns", "curve_block", "plot"]
