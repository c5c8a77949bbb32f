"""``python -m fsdp_workflow.status SWEEP_DIR`` over run directories written by hand (no Slurm, no training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fsdp_workflow.config.load import compose, to_yaml
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.launch.sweep import record_planned, record_point
from fsdp_workflow.report.status.sweep_status import collect_sweep, format_sweep


def _run(root: Path, lr: str, metrics: list, exit_code: int | None = None, evals: list | None = None) -> Path:
    root.mkdir(parents=True)
    run = RunDir.of(root)
    run.config.write_text(to_yaml(compose(["+experiment=smoke", f"optimizer.lr={lr}", f"run_dir={root}"])))
    run.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if exit_code is not None:
        run.train_exit.write_text(json.dumps({"exit_code": exit_code, "reason": "r", "step": metrics[-1]["step"]}))
    if evals:
        run.evals_file.write_text("".join(json.dumps(e) + "\n" for e in evals))
    return root


def test_points_show_state_step_losses_and_the_best_by_eval_loss(tmp_path: Path) -> None:
    common = ["experiment=smoke", "cluster=local"]
    points = [([*common, f"optimizer.lr={lr}"], str(tmp_path / str(n))) for n, lr in enumerate(("1e-3", "2e-3", "3e-3"))]
    record_planned(tmp_path, points)  # all three listed before any runs
    # Point 0 finished: the per-checkpoint evaluation (1.5) counts over the last in-loop eval (2.0).
    _run(tmp_path / "0", "1e-3", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "eval_loss": 2.0}], 0,
         evals=[{"step": 2, "status": "ok", "loss": 1.5, "perplexity": 4.48}])
    record_point(tmp_path, 0, points[0][0], tmp_path / "0", 0)
    # Point 1 stopped on a full disk at step 1; its in-loop eval loss is the sweep's lowest.
    _run(tmp_path / "1", "2e-3", [{"step": 1, "loss": 2.9, "eval_loss": 1.2}], 74)
    record_point(tmp_path, 1, points[1][0], tmp_path / "1", 74)
    # Point 2 never started.

    rows = collect_sweep(tmp_path)
    assert [(r.num, r.point, r.state, r.step, r.max_steps, r.loss, r.eval_loss, r.best) for r in rows] == [
        (0, "optimizer.lr=1e-3", "done", 2, 30, 2.5, 1.5, False),
        (1, "optimizer.lr=2e-3", "failed (74)", 1, 30, 2.9, 1.2, True),
        (2, "optimizer.lr=3e-3", "planned", None, None, None, None, False),
    ]
    text = format_sweep(tmp_path, rows)
    lines = [line for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert text.splitlines()[1].split()[:2] == ["#", "optimizer.lr"]  # the swept key heads its column
    assert lines[1].split()[:5] == ["1", "2e-3", "failed", "(74)", "1/30"] and lines[1].endswith("<- best")
    assert "<- best" not in lines[0] + lines[2] and lines[2].split()[2] == "planned"
    assert max(map(len, text.splitlines()[1:5])) <= 80  # the table (the first line names the sweep dir)


def test_no_eval_loss_marks_no_point_and_the_cli_reads_the_index(tmp_path: Path) -> None:
    points = [(["optimizer.lr=1e-3"], str(tmp_path / "0"))]
    record_planned(tmp_path, points)
    _run(tmp_path / "0", "1e-3", [{"step": 1, "loss": 3.0}], 0)
    record_point(tmp_path, 0, points[0][0], tmp_path / "0", 0)
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert (row["state"], row["loss"], row["eval_loss"], row["best"]) == ("done", 3.0, None, False)


def test_a_point_whose_command_failed_before_training_shows_its_exit_code(tmp_path: Path) -> None:
    """No train_exit.json to read (refused at submission, prepare failed, stopped): the index's code is the outcome."""
    points = [([f"optimizer.lr={lr}"], str(tmp_path / str(n))) for n, lr in enumerate(("1e-3", "2e-3", "3e-3", "4e-3"))]
    record_planned(tmp_path, points)
    _run(tmp_path / "0", "1e-3", [{"step": 1, "loss": 3.0}])  # planned, then sbatch refused it: no jobs
    record_point(tmp_path, 0, points[0][0], tmp_path / "0", 2)
    _run(tmp_path / "1", "2e-3", [{"step": 1, "loss": 3.0}])  # a local prepare that failed
    record_point(tmp_path, 1, points[1][0], tmp_path / "1", 1)
    _run(tmp_path / "2", "3e-3", [{"step": 1, "loss": 3.0}])  # SIGTERM during its prepare: the sweep stopped
    record_point(tmp_path, 2, points[2][0], tmp_path / "2", 143)
    rows = collect_sweep(tmp_path)
    assert [r.state for r in rows] == ["refused (2)", "failed (1)", "terminated (143)", "planned"]


def test_every_swept_value_shows_in_its_own_column_however_many_keys_vary(tmp_path: Path) -> None:
    """Issue 49, item 7: a point was cut at 40 characters (``optimizer.lr=0.0003 model.hidden_size...``)."""
    data = tmp_path / "a_rather_long_directory_name_for_the_data" / "and_another_level"
    data.mkdir(parents=True)
    corpus = Path(__file__).resolve().parents[3] / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt"
    for name in ("corpus_english_v1.txt", "corpus_english_v2.txt"):
        (data / name).write_bytes(corpus.read_bytes())
    sweep = tmp_path / "sweep"
    plan = subprocess.run([sys.executable, "-m", "fsdp_workflow", "-m", "+experiment=smoke", "dry_run=true",
                           f"run_dir={sweep}", "optimizer.lr=1e-3,3e-4", "model.hidden_size=64,128",
                           f"data.path={data}/corpus_english_v1.txt,{data}/corpus_english_v2.txt"],
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(sweep)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    head, *rows = [ln.split() for ln in proc.stdout.splitlines()[1:10] if ln.strip()[:1] in "#0123456789"]
    assert head[:4] == ["#", "optimizer.lr", "model.hidden_size", "data.path"], proc.stdout
    shown = [tuple(r[1:4]) for r in rows]
    assert shown == [(lr, size, f"...corpus_english_{v}.txt") for lr in ("0.001", "0.0003") for size in ("64", "128")
                     for v in ("v1", "v2")], proc.stdout
    assert len(set(shown)) == 8  # every point told apart
