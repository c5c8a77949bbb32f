"""What a finished run says when its command is given again, and that its advice is accepted.

The Slurm route end to end (the CLI and ``submit.sh`` on a finished run, a live chain refused)
is in tests/slurm/test_chain_guard.py; the local route in tests/backends/test_local.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.config.errors import ConfigError
from fsdp_workflow.core.commands import hydra_value
from fsdp_workflow.backends.finished import finished_message
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import check_run_dir_reuse, write_run_dir
from tests.launch.test_complete_inputs import save_step


@pytest.mark.parametrize("local", [False, True], ids=["slurm", "local"])
@pytest.mark.parametrize("name", ["plain", "with space and 'quote"])
def test_the_advice_to_train_further_is_accepted_by_the_planner(name: str, local: bool, tmp_path: Path) -> None:
    run_dir = tmp_path / name / "run"
    base = ["+experiment=smoke", f"run_dir={hydra_value(str(run_dir))}"]
    cfg = compose([*base, "dry_run=true"])
    plan = write_run_dir(cfg, backend_for(cfg))
    save_step(plan.layout.step_dir(plan.max_steps))
    plan.layout.hf_model.mkdir()
    message, rc = finished_message(plan.layout, plan.max_steps, consolidates=True, local=local)
    assert rc == 0 and message is not None and message.startswith("this run is complete")
    words = shlex.split(message.split("a larger train.max_steps and ", 1)[1].split(";")[0].split(", after")[0])
    assert words == [f"checkpoint.resume={hydra_value(str(plan.layout.step_dir(plan.max_steps)))}"], words
    longer = f"train.max_steps={2 * plan.max_steps}"
    with pytest.raises(ConfigError, match="holds a run with a different config"):  # the rule the advice meets
        check_run_dir_reuse(compose([*base, "dry_run=true", longer]))
    check_run_dir_reuse(compose([*base, "dry_run=true", longer, *words]))  # accepted as given


def test_a_run_whose_checkpoints_were_removed_says_it_starts_from_the_model(tmp_path: Path) -> None:
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", "dry_run=true"])
    plan = write_run_dir(cfg, backend_for(cfg))
    plan.layout.hf_model.mkdir()
    message, rc = finished_message(plan.layout, plan.max_steps, consolidates=True)
    assert rc == 0 and "trained to step ? of" in message
    assert f"model.init=pretrained model.name_or_path={plan.layout.hf_model}" in message


def test_a_shorter_runs_model_stops_the_slurm_route_and_not_the_local_one(tmp_path: Path) -> None:
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", "dry_run=true"])
    plan = write_run_dir(cfg, backend_for(cfg))
    save_step(plan.layout.step_dir(plan.max_steps // 2))
    plan.layout.hf_model.mkdir()
    message, rc = finished_message(plan.layout, plan.max_steps, consolidates=True)
    assert rc == 2 and "Move it aside first: mv" in message
    assert finished_message(plan.layout, plan.max_steps, consolidates=True, local=True) == (None, 0)
