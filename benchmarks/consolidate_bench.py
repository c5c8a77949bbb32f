"""Benchmark the streaming consolidator against Accelerate, torch DCP and ``cp -r``.

Run::

    python benchmarks/consolidate_bench.py --sizes 1.5 3 --ranks 2

For each size it writes a synthetic Llama-shaped bf16 checkpoint (``--ranks`` FSDP shards)
under ``benchmarks/_work/`` and runs, each in its own subprocess under ``/usr/bin/time``,
in ``--repeats`` interleaved rounds (median wall reported, every run listed): this
consolidator with its architecture cache disabled (``FSDP_WORKFLOW_NO_CACHE=1``, so each
run is what a first consolidation of a new config costs), ``accelerate.utils.merge_fsdp_weights``,
torch's ``dcp_to_torch_save`` and ``cp -r`` of the shards. The page cache is warmed first
so every tool reads from memory, and ``sync`` runs before each timed command. Prints a
markdown table of wall time, peak RSS and ratios; ``--keep`` keeps the data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "_work"


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run ``cmd`` under /usr/bin/time; return (wall seconds, peak RSS in GB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        subprocess.run(["sync"], check=True)
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", tf.name, *cmd], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
        wall, rss_kb = tf.read().split()[-2:]
    return float(wall), int(rss_kb) / 1e6


def warm_cache(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def bench(gb: float, ranks: int, keep: bool, repeats: int) -> list:
    from fsdp_workflow.consolidate.synthetic import write_llama_run

    run = WORK / f"run-{gb}gb"
    if not (run / "checkpoints" / "step-1" / ".metadata").is_file():
        shutil.rmtree(run, ignore_errors=True)
        write_llama_run(run, gb, ranks)
    ckpt = run / "checkpoints" / "step-1"
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    warm_cache(ckpt)
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FSDP_WORKFLOW_NO_CACHE": "1"}
    acc_code = (f"from accelerate.utils import merge_fsdp_weights; "
                f"merge_fsdp_weights({str(ckpt)!r}, {str(WORK / 'out-acc')!r}, safe_serialization=True)")
    torch_code = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  f"dcp_to_torch_save({str(ckpt)!r}, {str(WORK / 'out-torch.pt')!r})")
    tools = [
        # FSDP_WORKFLOW_NO_CACHE: every run costs what a first consolidation of a new config costs
        ("fsdp_workflow.consolidate (default verification, no cache)",
         [py, "-m", "fsdp_workflow.consolidate", str(run), str(WORK / "out-ours"), "--no-progress"], WORK / "out-ours"),
        ("accelerate merge_fsdp_weights", [py, "-c", acc_code], WORK / "out-acc"),
        ("torch dcp_to_torch_save", [py, "-c", torch_code], WORK / "out-torch.pt"),
        ("cp -r (floor)", ["cp", "-r", str(ckpt), str(WORK / "out-cp")], WORK / "out-cp"),
    ]
    samples: dict = {name: [] for name, _, _ in tools}
    # Interleaved rounds, median wall: this machine's disk write-back makes single runs noisy.
    for _ in range(repeats):
        for name, cmd, out in tools:
            samples[name].append(timed(cmd, env))
            if name.startswith("fsdp_workflow"):
                notes = json.loads((out / "verification.json").read_text())["architecture"]["notes"]
                print(f"{name}: architecture check: {notes}", file=sys.stderr)
            shutil.rmtree(out) if out.is_dir() else out.unlink()
    rows = [(name, statistics.median(w for w, _ in runs), max(r for _, r in runs), [w for w, _ in runs])
            for name, runs in samples.items()]
    print(f"\n### {size / 1e9:.2f} GB bf16, {ranks} ranks, {os.cpu_count()} CPUs, median of {repeats}\n")
    acc = rows[1][1]
    cp = rows[-1][1]
    print("| tool | wall s (median) | runs | peak RSS GB | wall / Accelerate | wall / cp -r |")
    print("|---|---|---|---|---|---|")
    for name, wall, rss, walls in rows:
        runs_s = ", ".join(f"{w:.2f}" for w in walls)
        print(f"| {name} | {wall:.2f} | {runs_s} | {rss:.2f} | {wall / acc:.2f} | {wall / cp:.2f} |")
    sys.stdout.flush()
    if not keep:
        shutil.rmtree(run)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="benchmark consolidation tools")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.5, 3.0], help="checkpoint sizes in GB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median wall is reported")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints in benchmarks/_work/")
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    for gb in a.sizes:
        bench(gb, a.ranks, a.keep, a.repeats)
    if not a.keep:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
