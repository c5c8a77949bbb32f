"""A resume under other ranks, another cp or another ``train.seq_len`` is said at planning (issue 49, item 7).

    python -m pytest tests/plan/test_resume_changes.py

A real 2-rank CPU run through ``python -m fsdp_workflow`` checkpoints step 2; its
directory is then copied and resumed from that checkpoint by the same command with one
thing changed. Before, each was planned without a word: the global batch (or the
packing the data position counts) changed from step 2 on. Now one warning on
``checkpoint.resume`` names the change and the override that keeps the old shape,
and that override is then planned without it. A resume with the same shape says nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.plan.resume_changes import resume_changes

ROOT = Path(__file__).resolve().parents[2]
FIRST = ("+experiment=smoke", "train.max_steps=2", "checkpoint.every_steps=2", "optimizer.warmup_steps=0",
         "consolidate.enabled=false")
RESUMED = ("+experiment=smoke", "train.max_steps=4", "checkpoint.every_steps=2", "optimizer.warmup_steps=0",
           "consolidate.enabled=false")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT)), timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("resume_changes") / "run"
    res = cli(*FIRST, f"run_dir={run}")
    assert res.returncode == 0, res.stderr[-4000:]
    assert (run / "checkpoints" / "step-2").is_dir()
    return run


def resume_warning(trained: Path, tmp_path: Path, *changed: str) -> List[str]:
    """The ``checkpoint.resume`` warning's lines of a dry run resuming a copy of ``trained`` from step 2."""
    run = tmp_path / "copy"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    res = cli(*RESUMED, f"run_dir={run}", f"checkpoint.resume={run}/checkpoints/step-2", "dry_run=true", *changed)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("fsdp_workflow: warning: checkpoint.resume = ")]
    assert len(starts) <= 1, res.stderr  # one warning, whatever changed
    return lines[starts[0]:starts[0] + 3] if starts else []


@pytest.mark.slow
def test_other_ranks_name_the_global_batch_they_change_and_the_fix_keeps_it(trained: Path, tmp_path: Path) -> None:
    warning = resume_warning(trained, tmp_path / "a", "cluster.processes_per_node=1")
    assert "the global batch changes from 4 sequences (micro 2 x accum 1 x dp 2 of 2 ranks) to 2 " \
           "(micro 2 x accum 1 x dp 1 of 1 rank) from step 2 on" in warning[1]
    assert "data position" in warning[1]
    assert warning[2].strip() == ("fix: to continue as that run trained: train.grad_accum_steps=2; "
                                  "to change it on purpose, nothing")
    assert resume_warning(trained, tmp_path / "b", "cluster.processes_per_node=1", "train.grad_accum_steps=2") == []


@pytest.mark.slow
def test_another_cp_and_another_seq_len_are_named(trained: Path, tmp_path: Path) -> None:
    cp = resume_warning(trained, tmp_path / "cp", "strategy.context_parallel_size=2")
    assert "from 4 sequences (micro 2 x accum 1 x dp 2 of 2 ranks) to 2 (micro 2 x accum 1 x dp 1 of 2 ranks / cp 2)" \
        in cp[1]
    seq = resume_warning(trained, tmp_path / "seq", "train.seq_len=64")
    assert "global batch" not in seq[1]
    assert "train.seq_len changes from 128 to 64: the data is packed again" in seq[1]
    assert "tokens per step go from 512 to 256" in seq[1] and "train.seq_len=128" in seq[2]


@pytest.mark.slow
def test_the_same_shape_resumes_without_a_word(trained: Path, tmp_path: Path) -> None:
    assert resume_warning(trained, tmp_path, "optimizer.lr=1e-4") == []


def test_tensor_parallel_counts_too_and_a_config_read_back_changes_nothing(tmp_path: Path) -> None:
    old = config(tmp_path / "old", "cluster.processes_per_node=4")
    new = config(tmp_path / "new", "cluster.processes_per_node=4", "strategy.tensor_parallel_size=2")
    changes, fixes = resume_changes(old, new, 7)
    assert len(changes) == 1 and "dp 2 of 4 ranks / tp 2" in changes[0] and "from step 7 on" in changes[0]
    assert fixes == [f"train.grad_accum_steps={2 * old.train.grad_accum_steps}"]
    assert resume_changes(old, load_run_config(tmp_path / "old"), 7) == ([], [])


def config(run: Path, *overrides: str):
    """The smoke experiment with ``overrides``, as the planner records it in ``run/config.yaml`` (a dry run)."""
    res = cli("+experiment=smoke", "dry_run=true", f"run_dir={run}", *overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    return load_run_config(run)


@pytest.mark.slow
def test_a_model_change_at_resume_is_refused_at_planning_and_leaves_config_yaml_as_it_was(trained: Path,
                                                                                       tmp_path: Path) -> None:
    """Was: the trainer refused it (exit 2) after the planner had rewritten config.yaml, and ``status`` then
    printed a resume command repeating the refused ``model.hidden_size=96``."""
    run = tmp_path / "copy"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "provenance.json", "train.sbatch")}
    res = cli(*RESUMED, f"run_dir={run}", f"checkpoint.resume={run}/checkpoints/step-2", "model.hidden_size=96")
    assert res.returncode == 2, res.stderr[-4000:]
    assert "model.hidden_size = 96" in res.stderr and "trained with model.hidden_size=64" in res.stderr
    assert "fix: model.hidden_size=64 to resume that run" in res.stderr
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing rewritten
    assert not (run / "checkpoints" / "step-4").exists()
    status = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run)], capture_output=True, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert status.returncode == 0 and "hidden_size=96" not in status.stdout, status.stdout  # no command repeats it
    ok = cli(*RESUMED, f"run_dir={run}", f"checkpoint.resume={run}/checkpoints/step-2", "model.hidden_size=64",
             "dry_run=true")
    assert ok.returncode == 0, ok.stderr[-3000:]
