"""Consolidate one checkpoint and append its held-out perplexity to RUN_DIR/evals.jsonl.

    python -m fsdp_workflow.evaluate RUN_DIR STEP

Run by ``eval.sbatch`` for each checkpoint (``consolidate.every_checkpoint=true``), or by
hand. It prints the record it appended (one JSON line, :mod:`fsdp_workflow.evaluate.eval_record`)
and logs it to the run's experiment trackers. Exit code 0 (``ok`` or ``skipped``), 1 when the
evaluation failed, 2 for bad arguments, a RUN_DIR without a readable config.yaml, or a STEP
the run never saved (nothing is appended then; the message lists the steps it saved, from
``RUN_DIR/saves.jsonl``, and the save interval).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from fsdp_workflow.core.logs import setup_logging
from fsdp_workflow.evaluate.per_checkpoint import NoSuchCheckpoint, evaluate_checkpoint
from fsdp_workflow.evaluate.eval_record import FAILED, append_record, track_result
from fsdp_workflow.evaluate.run import RunNotReadable, open_run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml and checkpoints/)")
    p.add_argument("step", type=_step, help="the checkpoint's step (checkpoints/step-STEP)")
    return p


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (checkpoints/step-N: give N, e.g. 200)")
    return int(text)


def main(argv: Optional[List[str]] = None) -> int:
    """Evaluate RUN_DIR's checkpoint STEP; see the module docstring for the exit codes."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # argparse printed the usage and the problem
        return EXIT_OK if exit_.code == 0 else EXIT_USAGE
    try:
        run = open_run(args.run_dir.absolute())
    except RunNotReadable as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(run.cfg.log_level.value)
    try:
        record = evaluate_checkpoint(run, args.step, os.environ.get("SLURM_JOB_ID"))
    except NoSuchCheckpoint as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    append_record(run, record)
    track_result(run, record)
    print(json.dumps(record, sort_keys=True))
    return EXIT_FAILURE if record["status"] == FAILED else EXIT_OK


if __name__ == "__main__":
    from fsdp_workflow.core.fastexit import run_main

    run_main(main)  # raise SystemExit(main()), without tearing down torch's modules (fastexit)
