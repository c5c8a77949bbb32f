"""``train.report_to``: a missing tracker package is an error for a local run, a warning for Slurm."""

from __future__ import annotations

import pytest

from fsdp_workflow.config import rules_trackers
from fsdp_workflow.config.schema import Tracker
from fsdp_workflow.plan.checks import check as validate

NO_SUCH_MODULE = "fsdp_workflow_tests_no_such_tracker"


@pytest.fixture
def wandb_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb as if it were not installed, whatever this environment holds."""
    monkeypatch.setitem(rules_trackers.TRACKER_PACKAGES, Tracker.wandb, ((NO_SUCH_MODULE,), "wandb"))


def test_missing_package_is_an_error_for_a_local_run(composed, wandb_missing) -> None:
    report = validate(composed(["train.report_to=[tensorboard,wandb]"]))
    [issue] = [i for i in report.errors if i.key == "train.report_to"]
    assert "wandb" in issue.why and "not installed" in issue.why
    assert "pip install wandb" in issue.fix and "fsdp_workflow[wandb]" in issue.fix
    assert not [w for w in report.warnings if w.key == "train.report_to"]


@pytest.mark.parametrize("where", [["cluster=slurm", "cluster.partition=gpu"], ["dry_run=true"]])
def test_missing_package_is_a_warning_where_the_job_may_run_elsewhere(composed, wandb_missing, where) -> None:
    report = validate(composed(["train.report_to=[wandb]", *where]))
    assert not [i for i in report.errors if i.key == "train.report_to"]
    [warning] = [w for w in report.warnings if w.key == "train.report_to"]
    assert "pip install wandb" in warning.fix


def test_installed_trackers_and_none_pass(composed) -> None:
    for value in ("[tensorboard,mlflow]", "[none]", "[]"):
        report = validate(composed([f"train.report_to={value}"]))
        assert not [i for i in [*report.errors, *report.warnings] if i.key == "train.report_to"], value


def test_none_with_a_tracker_is_refused(composed) -> None:
    report = validate(composed(["train.report_to=[none,tensorboard]"]))
    [issue] = [i for i in report.errors if i.key == "train.report_to"]
    assert "none" in issue.why and "train.report_to=[tensorboard]" in issue.fix
