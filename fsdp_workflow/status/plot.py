"""``status --plot OUT.png``: the run's loss (with eval losses), tokens/s and MFU as a picture.

Needs matplotlib, the ``plot`` extra (``pip install 'fsdp_workflow[plot]'``); without it the
command says so and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_workflow.core.curves import PlotUnavailable, read_series, write_png
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.rundir import RunDir


def plot_run(run_dir: Path, out: Path) -> int:
    """Write ``out`` from ``run_dir``'s metrics.jsonl; the exit code (0, or 2 with a message on stderr)."""
    metrics = RunDir(run_dir).metrics
    try:
        write_png(read_series(metrics), out, title=Path(run_dir).name)
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
