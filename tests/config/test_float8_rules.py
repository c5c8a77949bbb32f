"""``train.float8`` at validation: refused with the reason on CPU, on GPUs below 8.9 and without torchao.

The CLI cases run the real ``python -m fsdp_workflow`` (exit 2, the key and the
reason in stderr, no run directory). The GPU is asked through ``nvidia-smi``; a
stand-in script on ``PATH`` plays an A100 (8.0) or an H100 (9.0), since this
machine has no GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py

from fsdp_workflow.config import rules_float8
from fsdp_workflow.plan.checks import check as validate

CUDA = "cluster.device=cuda"


def cli(*args: str, cwd: Path, path_first: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return forked_cli.run(["+experiment=smoke", *args], cwd=cwd, env=env, timeout=120)  # forked `python -m`


def fake_nvidia_smi(where: Path, name: str, capability: str) -> Path:
    """A directory holding an ``nvidia-smi`` that answers the query the rule makes, as one GPU would."""
    where.mkdir()
    exe = where / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{name}, {capability}'\n")
    exe.chmod(0o755)
    return where


def test_refused_on_cpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = cli("train.float8=true", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "train.float8" in res.stderr and "compute capability >= 8.9" in res.stderr and "CPU" in res.stderr
    assert "Traceback" not in res.stderr and not run_dir.exists()


def test_refused_on_a_local_gpu_below_8_9(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    bin_dir = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB", "8.0")
    res = cli("train.float8=true", "train.compile=true", CUDA, f"run_dir={run_dir}", cwd=tmp_path, path_first=bin_dir)
    assert res.returncode == 2, res.stderr
    assert "A100-SXM4-80GB has compute capability 8.0, below the 8.9" in res.stderr
    assert not run_dir.exists()


def test_nvidia_smi_is_read_as_name_and_capability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = fake_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3", "9.0")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert rules_float8.local_gpus() == [("NVIDIA H100 80GB HBM3", (9, 0))]


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules_float8, "local_gpus", lambda: [("NVIDIA H100 80GB HBM3", (9, 0))])


def _torchao(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    real = importlib.util.find_spec
    fake = object()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (fake if present else None) if name == "torchao" else real(name, *a))


def test_refused_without_torchao_for_a_local_run_with_the_install_command(composed, h100, monkeypatch) -> None:
    _torchao(monkeypatch, present=False)
    report = validate(composed(["train.float8=true", "train.compile=true", CUDA]))
    issue = next(i for i in report.errors if i.key == "train.float8")
    assert "torchao" in issue.why and "pip install 'fsdp_workflow[float8]'" in issue.fix


def test_only_a_warning_without_torchao_for_a_slurm_run(composed, monkeypatch) -> None:
    _torchao(monkeypatch, present=False)
    report = validate(composed(["train.float8=true", "train.compile=true", CUDA, "cluster=slurm",
                                "cluster.partition=gpu", "dry_run=true"]))
    assert "train.float8" not in report.keys()
    assert any(w.key == "train.float8" and "torchao" in w.why for w in report.warnings)


def test_accepted_on_an_fp8_gpu_with_torchao(composed, h100, monkeypatch) -> None:
    _torchao(monkeypatch, present=True)
    report = validate(composed(["train.float8=true", "train.compile=true", CUDA]))
    assert "train.float8" not in report.keys(), [i.format() for i in report.errors]
    assert not any(w.key == "train.float8" for w in report.warnings)
    report = validate(composed(["train.float8=true", "train.compile=false", CUDA]))  # eager: accepted, warned
    assert any(w.key == "train.float8" and "compile" in w.why for w in report.warnings)
    report = validate(composed(["train.float8=true", CUDA]))  # compile's default on CUDA with FSDP2: on
    assert not any(w.key == "train.float8" for w in report.warnings)
