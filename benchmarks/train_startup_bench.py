"""Training start-up and per-rank memory against corpus size, with a ready token cache.

    python benchmarks/train_startup_bench.py [--sizes 20,200] [--out /tmp/startup_bench]

For each size (MB of generated chat JSONL, as in data_prepare_bench.py) and for
synthetic data (no cache: the model-load baseline), it plans a run (tiny Llama
with the benchmark's 8000-token BPE tokenizer, 2 CPU ranks, FSDP2), prepares the
cache (not timed), then launches the trainer exactly as ``train_node.sh`` does
(``torchrun --nproc_per_node 2 -m fsdp_workflow.train RUN_DIR`` with
``launch.env``) and measures:

- **start-up**: wall time from launch until ``metrics.jsonl`` holds step 1;
- **peak RSS per rank**: the largest ``VmHWM`` of the rank processes, polled
  from ``/proc`` every 50 ms (the ranks' own figure, not the launcher's).

The issue's targets: start-up within 10 s of the synthetic run's (the model load)
and independent of the corpus size; per-rank RSS flat from 20 to 200 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from data_prepare_bench import build_tokenizer, generate  # noqa: E402

from fsdp_workflow.config.accelerate_env import read_launch_env  # noqa: E402


def plan(run_dir: Path, tok_dir: Path, data: Optional[Path]) -> None:
    """Write the run directory (config.yaml, launch.env) as the CLI's dry run does."""
    data_args = (["data=synthetic"] if data is None else
                 ["data=chat_jsonl", f"data.path={data}", "data.chat_template=chatml", "data.eval_fraction=0.01"])
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", *data_args, f"model.tokenizer={tok_dir}",
            "model.vocab_size=8000", "train.seq_len=1024", "train.max_steps=3", "optimizer.warmup_steps=0",
            "checkpoint.every_steps=0",
            "checkpoint.save_final=false", "consolidate.enabled=false", "dry_run=true", f"run_dir={run_dir}"]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True)


def _rank_pids(run_dir: Path) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"fsdp_workflow.train" in cmd and str(run_dir).encode() in cmd and b"torchrun" not in b" ".join(cmd):
                out.append(int(p.name))
    return out


def _hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def launch(run_dir: Path) -> Dict[str, float]:
    """Run the trainer; return start-up seconds and the peak RSS (MB) of the largest rank."""
    env = {**os.environ, **read_launch_env(run_dir / "launch.env")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "-m", "fsdp_workflow.train", str(run_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first: Optional[float] = None
    peak: Dict[int, int] = {}
    while proc.poll() is None:
        for pid in _rank_pids(run_dir):
            peak[pid] = max(peak.get(pid, 0), _hwm_kb(pid))
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.perf_counter() - t0
        time.sleep(0.05)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed ({proc.returncode}):\n{err[-3000:]}")
    if first is None:  # finished between two polls
        first = time.perf_counter() - t0
    return {"startup_s": round(first, 2), "peak_rank_rss_mb": round(max(peak.values(), default=0) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20,200", help="MB of chat JSONL, comma separated")
    ap.add_argument("--out", default="/tmp/startup_bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        build_tokenizer(tok_dir)
    rows = []
    for label in ["synthetic", *args.sizes.split(",")]:
        run_dir = out / f"run-{label}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        data = None
        if label != "synthetic":
            data = out / f"chat-{label}mb.jsonl"
            if not data.is_file():
                generate(data, float(label))
        plan(run_dir, tok_dir, data)
        if data is not None:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "fsdp_workflow.data.prepare", str(run_dir)], check=True,
                           capture_output=True, text=True)
            prep_s = round(time.perf_counter() - t0, 1)
        else:
            prep_s = 0.0
        row = {"data": label if label == "synthetic" else f"{label} MB chat JSONL", "prepare_s": prep_s,
               **launch(run_dir)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["startup_s"]
    print("| data | prepare (s, not in start-up) | start-up to step 1 (s) | over synthetic (s) | peak RSS per rank (MB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['data']} | {r['prepare_s']} | {r['startup_s']} | {r['startup_s'] - base:+.1f} | "
              f"{r['peak_rank_rss_mb']} |")


if __name__ == "__main__":
    main()
