"""``status --plot OUT.png``: the run's loss (with eval losses), tokens/s and MFU as a picture.

Drawn by :func:`fsdp_workflow.report.plot.write_png`, the function that draws the model
card's ``loss_curve.png``. matplotlib is a dependency of the package; should it be missing,
the command says how to install it and exits 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from fsdp_workflow.config.record import open_run
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.report.curves import series_of
from fsdp_workflow.report.plot import PlotUnavailable, write_png


def plot_target_problem(out: Path) -> Optional[str]:
    """Why ``--plot out`` cannot be written (None when it can), checked before anything is written.

    The PNG is written to ``.OUT.tmp`` beside ``out`` and renamed: a directory at ``out``
    would fail only at the rename, leaving the temporary file behind.
    """
    out = Path(out)
    if out.is_dir():
        return f"--plot {out}: is a directory; name the PNG file to write, e.g. {out / 'loss.png'}"
    if out.exists() and not out.is_file():
        return f"--plot {out}: exists and is not a regular file"
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return f"--plot {out}: its directory {parent} does not exist; create it first"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--plot {out}: its directory {parent} is not writable"
    if out.exists() and not os.access(out, os.W_OK):
        return f"--plot {out}: exists and is not writable"
    return None


def plot_run(run_dir: Path, out: Path) -> int:
    """Write ``out`` from ``run_dir``'s metrics.jsonl; the exit code (0, or 2 with a message on stderr)."""
    record = open_run(run_dir)
    metrics = record.layout.metrics
    problem = plot_target_problem(out)
    if problem:
        print(f"fsdp_workflow.status: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        write_png(series_of(record.metrics), out, title=Path(run_dir).name)
    except PlotUnavailable as err:
        print(f"fsdp_workflow.status: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as err:
        print(f"fsdp_workflow.status: --plot {out}: {err} ({metrics}); try again once training has logged a step.",
              file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"fsdp_workflow.status: --plot {out}: cannot write it: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"plot: {out}")
    return 0
