"""The command line: Hydra behaviour, dry runs for every experiment, exit code 2 on bad configs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import forked_cli  # tests/forked_cli.py
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "fsdp_workflow" / "conf" / "experiment").glob("*.yaml"))
RUN_FILES = ["config.yaml", "launch.env", "train.sbatch", "train_node.sh", "consolidate.sbatch",
             "submit.sh", "provenance.json"]

_spec = importlib.util.spec_from_file_location("invalid_corpus", ROOT / "tests/config/invalid_corpus.py")
invalid_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(invalid_corpus)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return forked_cli.run(args, cwd=cwd or ROOT, env=env, timeout=120)  # `python -m fsdp_workflow ARGS`, forked


def test_experiment_list_is_what_the_issue_promises() -> None:
    assert {"smoke", "llama8b_fft", "llama8b_zero3", "qwen7b_fft", "mistral7b_fft"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_dry_run_writes_the_whole_run_dir_and_submits_nothing(experiment: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = cli(f"+experiment={experiment}", "dry_run=true", f"run_dir={run_dir}")
    assert res.returncode == 0, res.stderr
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from the dry run of {experiment}"
    assert "nothing submitted" in res.stdout
    assert "world size" in res.stderr and "global batch" in res.stderr and "GiB per" in res.stderr
    assert not (run_dir / "jobs.txt").exists()  # nothing was submitted
    # a Slurm plan says its partition/QoS limits were not read, and how to check them (issue 27)
    slurm = "kind: slurm" in (run_dir / "config.yaml").read_text()
    assert ("cluster checks skipped" in res.stdout) == slurm, res.stdout
    if slurm:
        assert f"python -m fsdp_workflow.check {run_dir}" in res.stdout
    # the resolved config reloads as the same typed config the planner used
    from fsdp_workflow.config import load_run_config

    cfg = load_run_config(run_dir)
    assert cfg.run_dir == str(run_dir) and cfg.dry_run is True
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["git_revision"] and "dry_run=true" in prov["command"]


def test_planning_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """Nor NumPy: a dry run is the edit-plan loop, and each of those imports costs it time."""
    code = (
        "import sys; from fsdp_workflow.__main__ import main\n"
        "try:\n    main(['+experiment=llama8b_fft', 'dry_run=true', 'run_dir=%s'])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "bad = [m for m in ('torch', 'transformers', 'accelerate', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n" % (tmp_path / "r")
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_help_and_cfg_job_work_as_hydra_users_expect() -> None:
    res = cli("--help")
    assert res.returncode == 0 and "strategy: ddp, deepspeed_zero1" in res.stdout.replace("\n", " ")
    res = cli("+experiment=llama8b_fft", "--cfg", "job")
    assert res.returncode == 0
    assert "name: fsdp2" in res.stdout and "nodes: 2" in res.stdout


def test_overrides_reach_the_written_config(tmp_path: Path) -> None:
    res = cli("+experiment=smoke", "dry_run=true", f"run_dir={tmp_path}", "train.max_steps=17",
              "strategy=ddp", "optimizer.lr=0.5")
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "config.yaml").read_text()
    assert "max_steps: 17" in text and "name: ddp" in text and "lr: 0.5" in text
    from fsdp_workflow.config.accelerate_env import read_launch_env

    env = read_launch_env(tmp_path / "launch.env")
    assert env["ACCELERATE_USE_FSDP"] == "false" and env["ACCELERATE_USE_DEEPSPEED"] == "false"


def test_multirun_plans_one_run_dir_per_job(tmp_path: Path) -> None:
    res = cli("-m", "+experiment=smoke", "dry_run=true", "train.micro_batch_size=1,2",
              f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    sizes = sorted((tmp_path / str(i) / "config.yaml").read_text().count("micro_batch_size: 2") for i in (0, 1))
    assert sizes == [0, 1]
    # sweep.json indexes the points (a dry run submits nothing: no job ids), and status reads it back.
    index = json.loads((tmp_path / "sweep.json").read_text())
    assert [(p["num"], p["run_dir"], p["jobs"], p["exit_code"]) for p in index["points"]] == [
        (0, str(tmp_path / "0"), {}, 0), (1, str(tmp_path / "1"), {}, 0)]
    assert [[o for o in p["overrides"] if "micro_batch" in o] for p in index["points"]] == [
        ["train.micro_batch_size=1"], ["train.micro_batch_size=2"]]
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(tmp_path)], capture_output=True, text=True)
    assert st.returncode == 0, st.stderr
    rows = [line.split() for line in st.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert st.stdout.splitlines()[1].split()[:2] == ["#", "train.micro_batch_size"], st.stdout
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("0", "1", "dry", "run"), ("1", "2", "dry", "run")], st.stdout


def test_an_invalid_sweep_point_leaves_no_index_and_no_run_dir(tmp_path: Path) -> None:
    res = cli("-m", "+experiment=smoke", "dry_run=true", "train.micro_batch_size=1,0", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 2 and "sweep point 1" in res.stderr and "train.micro_batch_size" in res.stderr, res.stderr
    assert not (tmp_path / "sweep.json").exists() and not (tmp_path / "0").exists()


@pytest.mark.parametrize("overrides,key", invalid_corpus.INVALID_CASES,
                         ids=[" ".join(o)[:60] for o, _ in invalid_corpus.INVALID_CASES])
def test_invalid_config_exits_2_naming_the_key(overrides, key, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = cli("+experiment=smoke", *overrides, "dry_run=true", f"run_dir={run_dir}")  # the corpus varies smoke
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert key in res.stderr
    assert "Traceback" not in res.stderr
    assert not run_dir.exists(), "a rejected config must leave nothing behind"


@pytest.mark.parametrize("override,key", [
    ("strategy.bogus=1", "strategy.bogus"),
    ("train.max_steps=abc", "train.max_steps"),
    ("strategy=fsdp3", "strategy"),
    ("train.mixed_precision=fp8", "train.mixed_precision"),
])
def test_compose_errors_exit_2_naming_the_key(override: str, key: str, tmp_path: Path) -> None:
    res = cli(override, "dry_run=true", f"run_dir={tmp_path / 'r'}")
    assert res.returncode == 2, res.stderr
    assert key in res.stderr and "Traceback" not in res.stderr
