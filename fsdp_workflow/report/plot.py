"""The one picture of a run's curves: loss (eval loss as dots), tokens/s and MFU by step, as a PNG.

``status --plot OUT.png`` and the model card's ``loss_curve.png`` are both drawn here, by
the same matplotlib code, with labelled axes. matplotlib is a dependency of the package
(the consolidation job writes the card wherever the project is installed); it is imported
inside :func:`write_png`, so ``status`` without ``--plot`` never pays its import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fsdp_workflow.report.curves import Series, finite

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STEP_LABEL = "optimizer step"  # the x axis of every panel
INSTALL_HINT = "pip install matplotlib (a dependency of fsdp_workflow: reinstall the package)"


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported; the message names the pip command."""


def curve_figure(series: Series, *, title: Optional[str] = None, loss_only: bool = False) -> "Figure":
    """The curves as a matplotlib figure: loss (eval loss as dots), then tokens/s and MFU, by optimizer step.

    Args:
        series: From :func:`fsdp_workflow.report.curves.series_of` (cut with ``up_to`` for a card).
        title: The figure title.
        loss_only: Only the loss panel (the model card); else loss, tokens/s and MFU.

    Returns:
        The figure (not drawn yet), every axis labelled.

    Raises:
        PlotUnavailable: matplotlib cannot be imported.
        ValueError: the series has no finite loss to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotUnavailable(f"drawing the curves needs matplotlib, which cannot be imported ({err}): "
                              f"{INSTALL_HINT}") from err
    xs, ys = finite(series.steps, series.loss)
    if not xs:
        raise ValueError("metrics.jsonl has no finite training loss to plot yet")
    fig = Figure(figsize=(8.0, 3.2 if loss_only else 8.0), dpi=100, layout="constrained")
    axes = fig.subplots(1 if loss_only else 3, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.plot(xs, ys, lw=1.2, label="training loss")
    if series.eval_steps:
        ax.plot(series.eval_steps, series.eval_loss, "o-", ms=4, lw=1.2, label="eval loss")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if not loss_only:
        for ax_, ys_, label, scale in ((axes[1], series.tokens_per_s, "tokens/s", 1.0),
                                       (axes[2], series.mfu, "MFU %", 100.0)):
            x2, y2 = finite(series.steps, ys_)
            ax_.plot(x2, [v * scale for v in y2], lw=1.0, color="tab:green")
            ax_.set_ylabel(label)
            ax_.grid(alpha=0.3)
    axes[-1].set_xlabel(STEP_LABEL)
    if title:
        fig.suptitle(title)
    return fig


def write_png(series: Series, out: Path, *, title: Optional[str] = None, loss_only: bool = False) -> Path:
    """Draw :func:`curve_figure` into ``out`` (a PNG), written to a temporary name and renamed.

    Args:
        series: The curves.
        out: The PNG to write.
        title: The figure title.
        loss_only: Only the loss panel (the model card).

    Returns:
        ``out``.

    Raises:
        PlotUnavailable: matplotlib cannot be imported.
        ValueError: the series has no finite loss to draw.
        OSError: ``out`` cannot be written (no temporary file is left behind).
    """
    fig = curve_figure(series, title=title, loss_only=loss_only)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise
    return out


__all__ = ["INSTALL_HINT", "PlotUnavailable", "STEP_LABEL", "curve_figure", "write_png"]
