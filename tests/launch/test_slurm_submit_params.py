"""The submitit path without Slurm: parameter mapping, rendezvous, the task wrapper.

The real chain is exercised in tests/slurm/test_submit.py and test_pipeline.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.launch.rendezvous import master_port, rendezvous_env, slurm_rendezvous_env
from fsdp_workflow.launch.slurm import executor_parameters, train_executor_kwargs
from fsdp_workflow.launch.slurm_task import TrainNodeTask
from fsdp_workflow.plan.render import render_all, rendezvous_lines
from fsdp_workflow.plan.spec import build_plan

submitit_slurm = pytest.importorskip("submitit.slurm.slurm")

EXPERIMENTS = ["smoke", "llama8b_fft", "llama8b_zero3"]


def _plan(experiment: str, *extra: str, run_dir: str = "/runs/x"):
    return build_plan(compose([f"+experiment={experiment}", "cluster=slurm", "cluster.partition=gpu",
                               f"run_dir='{run_dir}'", *extra]))


def _sbatch_lines(text: str) -> set:
    return {line for line in text.splitlines() if line.startswith("#SBATCH")}


def _submitit_script(plan, params, **extra) -> str:
    return submitit_slurm._make_sbatch_string(
        command="python -u -m submitit.core._submit /f", folder="/runs/x/logs/submitit", **params, **extra)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_submitit_renders_every_sbatch_option_of_the_plan(experiment: str) -> None:
    plan = _plan(experiment, "cluster.account=proj", "cluster.qos=high", "cluster.constraint=a100",
                 "cluster.exclusive=true", "+cluster.additional_parameters.mail-type=END")
    scripts = render_all(plan)
    params = executor_parameters(plan.train)
    text = _submitit_script(plan, params, **train_executor_kwargs(plan))
    missing = _sbatch_lines(scripts["train.sbatch"]) - _sbatch_lines(text)
    assert not missing, f"submitit script lacks {missing}:\n{text}"
    # submitit's own default (USR2@90) must not survive next to the plan's --signal
    assert sum(line.startswith("#SBATCH --signal=") for line in text.splitlines()) == 1
    # the same srun options as train.sbatch, and the shared requeue decision after the step
    srun_line = next(line for line in text.splitlines() if line.startswith("srun "))
    for opt in plan.train.step_argv[1:-2]:
        assert opt in srun_line.split()
    assert "scontrol requeue \"$SLURM_JOB_ID\"" in text
    assert text.index("rc=$?") > text.index(srun_line)

    cparams = executor_parameters(plan.consolidate)
    ctext = _submitit_script(plan, cparams)
    assert not _sbatch_lines(scripts["consolidate.sbatch"]) - _sbatch_lines(ctext)


def test_flags_and_memory_map_without_submitit_reinterpreting_them() -> None:
    params = executor_parameters(_plan("smoke", "cluster.exclusive=true").train)
    assert params["exclusive"] is True
    assert params["additional_parameters"]["mem"] == "8G"  # not reparsed as GB by submitit
    assert params["additional_parameters"]["requeue"] is True
    assert params["additional_parameters"]["signal"] == "USR2@30"
    assert params["nodes"] == 1 and params["ntasks_per_node"] == 1 and params["time"] == 20


@pytest.mark.parametrize("job_id", [0, 1, 7, 9999, 10000, 12345, 987654321])
def test_python_rendezvous_matches_train_sbatch(job_id: int, tmp_path: Path) -> None:
    plan = _plan("llama8b_fft")
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    # `scontrol show hostnames gpu[3-4]` -> one host per line
    fake.write_text("#!/bin/bash\necho gpu3\necho gpu4\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}",
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="gpu[3-4]")
    script = "\n".join(rendezvous_lines(plan) + ['echo "$MASTER_ADDR $MASTER_PORT"'])
    shell = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    py = slurm_rendezvous_env(plan.master_port_base, plan.port_range, plan.nccl_env, environ=env)
    assert shell.stdout.split() == [py["MASTER_ADDR"], py["MASTER_PORT"]]
    assert shell.stdout.split() == ["gpu3", str(master_port(job_id, plan.master_port_base, plan.port_range))]


def test_rendezvous_port_stays_below_the_ephemeral_range_and_carries_nccl_presets() -> None:
    env = rendezvous_env(32767, "n1", 20000, 10000, {"NCCL_DEBUG": "WARN"})
    assert env == {"NCCL_DEBUG": "WARN", "MASTER_ADDR": "n1", "MASTER_PORT": "22767"}
    assert all(master_port(j, 20000, 10000) < 32768 for j in range(0, 50000, 997))


def _task_env(tmp_path: Path, monkeypatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "scontrol"
    fake.write_text("#!/bin/bash\necho node7\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node7")


def test_train_node_task_runs_train_node_sh_with_the_rendezvous_env(tmp_path: Path, monkeypatch) -> None:
    _task_env(tmp_path, monkeypatch)
    run_dir = tmp_path / "run dir; 'x'"
    run_dir.mkdir()
    out = tmp_path / "env.txt"
    (run_dir / "train_node.sh").write_text(f'echo "$MASTER_ADDR $MASTER_PORT $NCCL_DEBUG" > {str(out)!r}\n')
    assert TrainNodeTask(str(run_dir), 20000, 10000, {"NCCL_DEBUG": "INFO"})() == 0
    assert out.read_text().split() == ["node7", "20041", "INFO"]


def test_train_node_task_exits_with_the_trainer_code(tmp_path: Path, monkeypatch) -> None:
    _task_env(tmp_path, monkeypatch)
    (tmp_path / "train_node.sh").write_text("exit 75\n")
    with pytest.raises(SystemExit) as exc:
        TrainNodeTask(str(tmp_path), 20000, 10000)()
    assert exc.value.code == 75
