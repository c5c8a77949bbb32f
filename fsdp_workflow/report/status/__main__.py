"""Where a submitted run stands: its Slurm jobs, latest checkpoint, consolidated model, evaluations.

    python -m fsdp_workflow.status RUN_DIR
    python -m fsdp_workflow.status RUN_DIR --json
    python -m fsdp_workflow.status RUN_DIR --watch 30      # redraw every 30 s until the chain ends (its exit code)
    python -m fsdp_workflow.status RUN_DIR --plot loss.png # the curves as a PNG (the model card draws the same one)
    python -m fsdp_workflow.status SWEEP_DIR          # one line per point of a -m sweep

See :mod:`fsdp_workflow.report.status` for what is read and from where.
Exit code 0, or 2 when RUN_DIR is not a run directory, or --plot cannot draw or names a path it cannot
write (a directory, an unwritable one): refused before anything is written.
A broken record (a file or line that cannot be read) is reported as ``broken record: PATH[:LINE]: why``,
not skipped; the exit code stays 0 (the report itself succeeded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Tuple

from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.rundir import CONFIG_FILE, SWEEP_FILE
from fsdp_workflow.report.status.collect import chain_outcome, collect
from fsdp_workflow.report.status.plot_option import plot_run, plot_target_problem
from fsdp_workflow.report.status.text import format_text
from fsdp_workflow.report.status.watch import DEFAULT_S, watch


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.status", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the run directory given as run_dir= at submission, or a sweep directory")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=DEFAULT_S, metavar="SECONDS",
                   help=f"redraw every SECONDS (default {DEFAULT_S:g}) until the chain ends: exit 0 done, "
                   "the failed job's code, 2 when it can never start; Ctrl-C exits 0")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="also draw the curves into a PNG (needs matplotlib)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    if args.plot is not None:  # refused before anything is read or written
        problem = plot_target_problem(args.plot)
        if problem:
            print(f"fsdp_workflow.status: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if (run_dir / SWEEP_FILE).is_file():
        from fsdp_workflow.report.status.sweep_status import collect_sweep, format_sweep

        points = collect_sweep(run_dir)
        print(json.dumps([asdict(p) for p in points], indent=2) if args.json else format_sweep(run_dir, points))
        return 0
    if not (run_dir / CONFIG_FILE).is_file():
        print(f"fsdp_workflow.status: {run_dir} is not a run directory (no {CONFIG_FILE}) nor a sweep directory "
              f"(no {SWEEP_FILE}); pass the run_dir= given to `python -m fsdp_workflow`.", file=sys.stderr)
        return EXIT_USAGE
    if args.plot is not None and plot_run(run_dir, args.plot) != 0:
        return EXIT_USAGE

    def render() -> Tuple[str, Optional[int]]:
        rs = collect(run_dir)
        text = json.dumps(asdict(rs), indent=2) if args.json else format_text(rs, _width())
        return text, chain_outcome(rs)[1]

    if args.watch is not None:
        return watch(render, max(0.5, args.watch))
    try:
        print(render()[0], flush=True)
    except BrokenPipeError:  # `status RUN_DIR | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _width() -> int:
    """The terminal's columns (80 when not a terminal), at most 120: wider curves get no easier to read."""
    return min(120, shutil.get_terminal_size((80, 24)).columns)


if __name__ == "__main__":
    raise SystemExit(main())
