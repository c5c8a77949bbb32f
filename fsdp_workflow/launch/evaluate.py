"""Consolidate one checkpoint and append its held-out perplexity to RUN_DIR/evals.jsonl.

Run by ``eval.sbatch`` (``consolidate.every_checkpoint=true``), or by hand:

    python -m fsdp_workflow.launch.evaluate RUN_DIR STEP

Each line of evals.jsonl: ``{"step", "status", "perplexity", "loss", "num_tokens",
"job_id", "seconds"}``; ``status`` is ``ok``, ``skipped`` (the checkpoint was pruned
before the job ran, or there is no held-out data) or ``failed``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from fsdp_workflow.plan.spec import EVALS_FILE

MAX_EVAL_BLOCKS = 64  # held-out sequences per evaluation, at most


def append_result(run_dir: Path, record: Dict[str, Any]) -> None:
    """Append one JSON line, under a lock: evaluation jobs may finish together."""
    with open(run_dir / EVALS_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def perplexity(model_dir: Path, cfg: Any) -> Optional[Dict[str, float]]:
    """Mean token loss and perplexity of the consolidated model on the held-out split."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_workflow.train.data import build_sources
    from fsdp_workflow.train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    _, held = build_sources(cfg.data, tokenizer, cfg.train.seq_len, cfg.model.vocab_size)
    if held is None:
        return None
    n = min(held.num_blocks or MAX_EVAL_BLOCKS, MAX_EVAL_BLOCKS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)  # sized by config.rules_env.eval_job_mem_gb
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            ids = held.sample(i).unsqueeze(0)
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.numel() - 1)
            count += ids.numel() - 1
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "num_tokens": count}


def evaluate_step(run_dir: Path, step: int) -> Dict[str, Any]:
    """Consolidate ``checkpoints/step-STEP`` into ``evals/step-STEP``, measure it, clean up."""
    from fsdp_workflow.config.load import load_run_config

    cfg = load_run_config(run_dir)
    t0 = time.time()
    record: Dict[str, Any] = {"step": step, "job_id": os.environ.get("SLURM_JOB_ID")}
    from fsdp_workflow.launch.eval_jobs import snapshot_dir

    ckpt = snapshot_dir(run_dir, step)  # hard links made at submission: immune to pruning
    if not ckpt.is_dir():
        ckpt = run_dir / "checkpoints" / f"step-{step}"
    if not ckpt.is_dir():
        record.update(status="skipped", reason=f"{ckpt} is gone (pruned by keep_last before this job ran)")
        return record
    out = run_dir / "evals" / f"step-{step}"
    if out.exists():
        shutil.rmtree(out)  # left by an earlier attempt of this job
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "fsdp_workflow.consolidate", str(ckpt), str(out),
            "--max-shard-size", cfg.consolidate.max_shard_size, "--no-verify", "--no-progress"]
    if (run_dir / "hf_assets" / "config.json").is_file():
        argv += ["--reference", str(run_dir / "hf_assets")]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        record.update(status="failed", reason=f"consolidation exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return record
    try:
        result = perplexity(out, cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # one model per checkpoint would fill the disk
        if ckpt.parent.name == "pending":
            shutil.rmtree(ckpt, ignore_errors=True)
    if result is None:
        record.update(status="skipped", reason="no held-out data (data.eval_path / data.eval_fraction)")
    else:
        record.update(status="ok", **result)
    record["seconds"] = round(time.time() - t0, 2)
    return record


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, step = Path(args[0]).absolute(), int(args[1])
    record = evaluate_step(run_dir, step)
    append_result(run_dir, record)
    print(json.dumps(record, sort_keys=True))
    return 1 if record["status"] == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())
