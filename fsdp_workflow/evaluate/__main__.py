"""Consolidate one checkpoint and append its held-out perplexity to RUN_DIR/evals.jsonl.

Run by ``eval.sbatch`` (``consolidate.every_checkpoint=true``), or by hand:

    python -m fsdp_workflow.evaluate RUN_DIR STEP

Each line of evals.jsonl: ``{"step", "status", "perplexity", "loss", "num_tokens",
"job_id", "seconds"}``, and ``"ema_loss", "ema_perplexity"`` (the EMA of the weights on
the same tokens) when the run keeps one (``train.ema_decay``); ``status`` is ``ok``,
``skipped`` (the checkpoint was pruned before the job ran, or there is no held-out
data) or ``failed``. Exit code 0, 1 when the evaluation failed, 2 for bad arguments.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import run_layout
from fsdp_workflow.consolidate import ConsolidationError, consolidate
from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from fsdp_workflow.core.logs import recorded_log_level, setup_logging
from fsdp_workflow.core.rundir import EMA_KEY, MODEL_KEY, RunDir
from fsdp_workflow.evaluate.perplexity import perplexity
from fsdp_workflow.train.data import DataError

Record = Dict[str, Union[str, int, float, None]]
log = logging.getLogger(__name__)


def append_result(layout: RunDir, record: Record) -> None:
    """Append one JSON line, under a lock: evaluation jobs may finish together."""
    with open(layout.evals_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def _source(layout: RunDir, step: int) -> Optional[Path]:
    """The hard-linked snapshot post_checkpoint.sh made (immune to pruning), else the checkpoint itself."""
    for cand in (layout.eval_snapshot(step), layout.step_dir(step)):
        if cand.is_dir():
            return cand
    return None


def evaluate_step(run_dir: Path, step: int) -> Record:
    """Consolidate ``step-STEP`` into ``evals/step-STEP`` (and its EMA into ``evals/step-STEP_ema``), measure, clean up."""
    cfg = load_run_config(run_dir)
    layout = run_layout(cfg)
    t0 = time.time()
    record: Record = {"step": step, "job_id": os.environ.get("SLURM_JOB_ID")}
    src = _source(layout, step)
    if src is None:
        record.update(status="skipped", reason=f"{layout.step_dir(step)} is gone (pruned by keep_last before this job ran)")
        return record
    # With an EMA the checkpoint holds two models: name each one's key root.
    models = {"": (layout.eval_model(step), None)}
    if cfg.train.ema_decay is not None:
        models = {"": (layout.eval_model(step), MODEL_KEY), "ema_": (layout.eval_model_ema(step), EMA_KEY)}
    results: Dict[str, Optional[Dict[str, float]]] = {}
    try:
        reference = layout.hf_assets if (layout.hf_assets / "config.json").is_file() else None
        for prefix, (out, subtree) in models.items():
            if out.exists():
                shutil.rmtree(out)  # left by an earlier attempt of this job
            out.parent.mkdir(parents=True, exist_ok=True)
            consolidate(src, out, max_shard_size=cfg.consolidate.max_shard_size, verify=False, progress=False,
                        reference=reference, subtree=subtree)
            results[prefix] = perplexity(out, cfg)
            shutil.rmtree(out, ignore_errors=True)  # one model per checkpoint would fill the disk
    except ConsolidationError as err:
        record.update(status="failed", reason=f"consolidation failed: {str(err)[-500:]}")
        return record
    except DataError as err:
        record.update(status="failed", reason=f"no held-out data to read: {str(err)[-500:]}")
        return record
    finally:
        for out, _ in models.values():
            shutil.rmtree(out, ignore_errors=True)
        if src == layout.eval_snapshot(step):
            shutil.rmtree(src, ignore_errors=True)
    if results[""] is None:
        record.update(status="skipped", reason="no held-out data (data.eval_path / data.eval_fraction)")
    else:
        record.update(status="ok", **results[""])
        ema = results.get("ema_")
        if ema is not None:
            record.update(ema_loss=ema["loss"], ema_perplexity=ema["perplexity"])
    record["seconds"] = round(time.time() - t0, 2)
    return record


def track_result(run_dir: Path, record: Record) -> None:
    """Log the result to the run's experiment trackers (``train.report_to``); never fails the job."""
    from fsdp_workflow.train.trackers import log_checkpoint_eval

    try:
        logged = log_checkpoint_eval(load_run_config(run_dir), RunDir.of(run_dir), record)
    except Exception as err:  # noqa: BLE001 - evals.jsonl has the result; a tracker error must not lose it
        log.warning("step %s: could not log to the experiment trackers: %s", record.get("step"), err)
        return
    if logged:
        log.info("step %s: logged to %s", record.get("step"), ", ".join(logged))


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print(__doc__, file=sys.stderr)
        return EXIT_USAGE
    run_dir, step = Path(args[0]).absolute(), int(args[1])
    setup_logging(recorded_log_level(run_dir))
    record = evaluate_step(run_dir, step)
    append_result(RunDir.of(run_dir), record)  # evals.jsonl sits in the run dir itself
    track_result(run_dir, record)
    print(json.dumps(record, sort_keys=True))
    return EXIT_FAILURE if record["status"] == "failed" else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
