"""The Python submission route without a cluster: what it refuses, and that it says why.

The real submissions (the chain, refused jobs, batch scripts as Slurm holds them)
run on the test Slurm in tests/slurm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.backends.slurm.submit import SubmissionError, submit_chain
from fsdp_workflow.backends.slurm.scripts import sbatch_argv
from fsdp_workflow.plan.spec import build_plan


def _plan(tmp_path: Path, *extra: str):
    return build_plan(compose(["+experiment=smoke", "cluster=slurm", f"run_dir={tmp_path / 'run'}", *extra]))


def test_without_slurm_commands_the_error_says_how_to_submit_elsewhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SubmissionError, match=r"needs Slurm's client commands.*submit\.sh"):
        submit_chain(_plan(tmp_path))


def test_a_dependent_job_cannot_be_submitted_without_the_id_it_waits_for(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert plan.consolidate is not None and plan.consolidate.after == "train"
    with pytest.raises(ValueError, match="waits for the train job"):
        sbatch_argv(plan.consolidate, plan.run_dir)
    argv = sbatch_argv(plan.consolidate, plan.run_dir, "42")
    assert argv[:4] == ["sbatch", "--parsable", "--dependency=afterok:42", "--kill-on-invalid-dep=yes"]
    assert argv[-1] == str(plan.run_dir / "consolidate.sbatch")


def test_log_dir_is_where_every_job_writes(tmp_path: Path) -> None:
    logs = tmp_path / "my logs"
    plan = _plan(tmp_path, f"cluster.log_dir='{logs}'", "consolidate.every_checkpoint=true")
    jobs = [*plan.chain, plan.eval_job]
    assert all(j is not None and Path(j.path_options["output"]).parent == logs for j in jobs)


def test_without_slurm_the_cluster_checks_are_skipped_with_how_to_run_them(tmp_path: Path, monkeypatch,
                                                                             caplog) -> None:
    from fsdp_workflow.backends.slurm.submit import check_limits

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={tmp_path / 'run'}"])
    with caplog.at_level("WARNING"):
        check_limits(cfg, build_plan(cfg))  # no raise: sbatch will say the same, and the message says how to check
    assert "cluster checks skipped (scontrol not found on PATH)" in caplog.text
    assert f"python -m fsdp_workflow.check {tmp_path / 'run'}" in caplog.text
