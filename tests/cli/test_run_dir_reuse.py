"""Run directories are never reused by accident, and every sweep point gets its own.

A run_dir holding a run with another config is refused (exit 2, nothing touched)
unless checkpoint.resume names it; a -m sweep validates every point before it
runs the first, and ``run_dir=X`` gives point N the directory ``X/N``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Dict, Tuple

import pytest

import forked_cli  # tests/forked_cli.py

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ("+experiment=smoke", "dry_run=true")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return forked_cli.run(args, cwd=ROOT, env=env, timeout=120)  # `python -m fsdp_workflow ARGS`, forked


def snapshot(root: Path) -> Dict[str, Tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime, to prove nothing changed."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def max_steps_in(run_dir: Path) -> int:
    from fsdp_workflow.config import load_run_config

    return load_run_config(run_dir).train.max_steps


def test_replanning_the_same_run_is_allowed_and_another_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for extra in ((), (), ("checkpoint.resume=none",)):  # resubmitting; resume may change
        res = cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=20", *extra)
        assert res.returncode == 0, res.stderr
    res = cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=30")
    assert res.returncode == 2, res.stderr


def test_a_different_config_into_the_same_run_dir_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=20").returncode == 0
    (run_dir / "checkpoints" / "step-10").mkdir(parents=True)  # what a resume would pick up
    before = snapshot(tmp_path)
    res = cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=30")
    assert res.returncode == 2, res.stderr
    assert "run_dir" in res.stderr and "train.max_steps: 20 -> 30" in res.stderr, res.stderr
    assert "checkpoint.resume=" in res.stderr and "Traceback" not in res.stderr
    assert snapshot(tmp_path) == before, "a refused reuse must leave the existing run as it was"
    assert (run_dir / "checkpoints" / "step-10").is_dir()


@pytest.mark.parametrize("resume", ["checkpoints/step-10", "."], ids=["a checkpoint of it", "the run dir"])
def test_checkpoint_resume_inside_the_run_dir_continues_it_under_a_new_config(tmp_path: Path, resume: str) -> None:
    run_dir = tmp_path / "run"
    assert cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=20").returncode == 0
    assert cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=30").returncode == 2
    target = run_dir if resume == "." else run_dir / resume  # a dry run only warns on a missing path
    res = cli(*SMOKE, f"run_dir={run_dir}", "train.max_steps=30", f"checkpoint.resume={target}")
    assert res.returncode == 0, res.stderr
    assert max_steps_in(run_dir) == 30


def test_only_resubmission_keys_are_ignored(tmp_path: Path) -> None:
    from fsdp_workflow.config.errors import ConfigError
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.backends.registry import backend_for
    from fsdp_workflow.plan.run_dir import check_run_dir_reuse, write_run_dir

    run_dir = tmp_path / "run"
    cfg = compose(["+experiment=smoke", "dry_run=true", f"run_dir={run_dir}"])
    write_run_dir(cfg, backend_for(cfg))
    same_run = dataclasses.replace(
        cfg, dry_run=False, run_dir=str(run_dir) + "/",
        checkpoint=dataclasses.replace(cfg.checkpoint, resume="none"),
        cluster=dataclasses.replace(cfg.cluster, partition="other", time_min=cfg.cluster.time_min * 2),
    )
    check_run_dir_reuse(same_run)  # a resubmission: nothing raised
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=cfg.train.seed + 1))
    with pytest.raises(ConfigError) as err:
        check_run_dir_reuse(other)
    assert err.value.issues[0].key == "run_dir" and "train.seed" in err.value.issues[0].why


def test_multirun_with_run_dir_gives_each_point_its_own_dir(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    res = cli("-m", *SMOKE, f"run_dir={sweep}", "train.max_steps=4,6", "checkpoint.every_steps=2")
    assert res.returncode == 0, res.stderr
    assert [max_steps_in(sweep / str(n)) for n in (0, 1)] == [4, 6]
    assert not (sweep / "config.yaml").exists()
    from fsdp_workflow.config import load_run_config

    assert load_run_config(sweep / "1").run_dir == str(sweep / "1")


def test_an_invalid_sweep_point_stops_the_sweep_before_any_point_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    res = cli("-m", *SMOKE, f"run_dir={sweep}", "optimizer.lr=1e-5,-1")
    assert res.returncode == 2, res.stderr
    assert "optimizer.lr=-1" in res.stderr and "optimizer.lr = -1" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not sweep.exists(), sorted(str(p) for p in sweep.rglob("*"))


def test_resweeping_a_changed_point_into_the_same_dir_is_refused_before_any_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ("-m", *SMOKE, f"run_dir={sweep}", "checkpoint.every_steps=2")
    assert cli(*args, "train.max_steps=4,6").returncode == 0
    before = snapshot(sweep)
    res = cli(*args, "train.max_steps=4,8")  # point 1 would land on point 1's old run
    assert res.returncode == 2, res.stderr
    assert "sweep point 1" in res.stderr and "train.max_steps: 6 -> 8" in res.stderr, res.stderr
    assert snapshot(sweep) == before
