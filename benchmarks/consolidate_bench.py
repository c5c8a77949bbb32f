"""Benchmark the streaming consolidator against Accelerate, torch DCP and ``cp -r``.

Run::

    python benchmarks/consolidate_bench.py --sizes 1.5 3 --ranks 2

For each size it writes a synthetic Llama-shaped bf16 checkpoint (``--ranks`` FSDP shards)
under ``benchmarks/_work/`` and runs, each in its own subprocess under ``/usr/bin/time``:
this consolidator twice with its architecture cache disabled (``FSDP_WORKFLOW_NO_CACHE=1``,
so each run is what a first consolidation of a new config costs),
``accelerate.utils.merge_fsdp_weights``, torch's ``dcp_to_torch_save`` and ``cp -r`` of
the shards. The page cache is warmed first so every tool reads from memory. Prints a
markdown table of wall time, peak RSS and ratios; ``--keep`` keeps the data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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


def bench(gb: float, ranks: int, keep: bool) -> list[tuple[str, float, float]]:
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
    rows = []
    for label in ("fsdp_workflow.consolidate (no arch cache, run 1)", "fsdp_workflow.consolidate (no arch cache, run 2)"):
        out = WORK / "out-ours"
        rows.append((label, *timed([py, "-m", "fsdp_workflow.consolidate", str(run), str(out), "--no-progress"], env)))
        arch = json.loads((out / "verification.json").read_text())["architecture"]
        print(f"{label}: architecture check: {arch['notes']}", file=sys.stderr)
        shutil.rmtree(out)
    out = WORK / "out-acc"
    code = f"from accelerate.utils import merge_fsdp_weights; merge_fsdp_weights({str(ckpt)!r}, {str(out)!r}, safe_serialization=True)"
    rows.append(("accelerate merge_fsdp_weights", *timed([py, "-c", code], env)))
    shutil.rmtree(out)
    out = WORK / "out-torch.pt"
    code = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            f"dcp_to_torch_save({str(ckpt)!r}, {str(out)!r})")
    rows.append(("torch dcp_to_torch_save", *timed([py, "-c", code], env)))
    out.unlink()
    out = WORK / "out-cp"
    rows.append(("cp -r (floor)", *timed(["cp", "-r", str(ckpt), str(out)])))
    shutil.rmtree(out)
    if not keep:
        shutil.rmtree(run)
    print(f"\n### {size / 1e9:.2f} GB bf16, {ranks} ranks, {os.cpu_count()} CPUs\n")
    acc = next(r for r in rows if r[0].startswith("accelerate"))[1]
    cp = rows[-1][1]
    print("| tool | wall s | peak RSS GB | wall / Accelerate | wall / cp -r |")
    print("|---|---|---|---|---|")
    for name, wall, rss in rows:
        print(f"| {name} | {wall:.2f} | {rss:.2f} | {wall / acc:.2f} | {wall / cp:.2f} |")
    sys.stdout.flush()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="benchmark consolidation tools")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.5, 3.0], help="checkpoint sizes in GB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints in benchmarks/_work/")
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    for gb in a.sizes:
        bench(gb, a.ranks, a.keep)
    if not a.keep:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
