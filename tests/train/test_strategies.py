"""Strategy switching through config alone: DDP on CPU; clear errors for what cannot run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from fsdp_workflow.config.schema import StrategyName
from fsdp_workflow.train.mesh import StrategyError
from fsdp_workflow.train.strategies import check_strategy_available
from tests.train.runner import launch, log_text, make_run_dir


@pytest.mark.slow
def test_ddp_through_config_whatever_the_environment_says(tmp_path: Path) -> None:
    """``strategy=ddp`` alone switches the trainer to DDP, while the environment says FSDP2, a
    tensor-parallel mesh and Accelerate's activation checkpointing: the trainer follows the typed
    config (issue 28, item 3), and no module under train/ reads those variables
    (``test_no_train_module_reads_the_planned_environment_back``).

    Before, the trainer rebuilt the strategy and mesh from these variables: such a run stopped
    with "the mesh ... under ddp" (exit 2) or trained another strategy than the one planned.
    """
    run = make_run_dir(tmp_path / "run", [
        "strategy=ddp", "train.max_steps=8", "train.grad_accum_steps=2", "checkpoint.every_steps=4",
        "optimizer.lr=3e-3",
    ])
    assert "ACCELERATE_USE_FSDP='false'" in (run / "launch.env").read_text() or \
        "ACCELERATE_USE_FSDP=false" in (run / "launch.env").read_text()
    lying = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true",
             "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}
    proc = launch(run, extra_env=lying)
    log = log_text(run)
    assert proc.returncode == 0, log
    assert "strategy ddp (DistributedType.MULTI_CPU), 2 rank(s), mesh none (ddp): 2 data-parallel rank(s); " \
           "each holds the whole model (DDP replicas)" in log, log  # not "dp_shard 2": nothing is sharded
    assert "activation checkpointing" not in log, log  # none, as configured: not the environment's full
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"]
    md = FileSystemReader(str(run / "checkpoints" / "step-8")).read_metadata()
    q = md.state_dict_metadata["model.model.layers.0.self_attn.q_proj.weight"]
    assert [tuple(c.sizes) for c in q.chunks] == [tuple(q.size)]  # replicated: one full chunk, not sharded nor split
    assert not any(k.startswith("model.module.") for k in md.state_dict_metadata)


def test_no_train_module_reads_the_planned_environment_back() -> None:
    """The trainer's config values travel as typed values (STYLE.md): the variables the planner writes for
    Accelerate (ACCELERATE_*, FSDP_*, PARALLELISM_CONFIG_*) are never read under fsdp_workflow/train, nor
    parsed there through Accelerate's plugin classes. torchrun's (RANK, LOCAL_RANK, WORLD_SIZE), the test
    fault hooks' and the trackers' own variables remain."""
    import re

    train = Path(__file__).resolve().parents[2] / "fsdp_workflow" / "train"
    planned = re.compile(r"""(environ|getenv|env)\b[^\n]*["'](ACCELERATE_|FSDP_|PARALLELISM_CONFIG_)""")
    offenders = []
    for path in sorted(train.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if planned.search(line) or "DataParallelPlugin(" in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == [], "read cfg instead:\n" + "\n".join(offenders)


def test_fsdp1_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(StrategyError, match="strategy=fsdp2"):
        check_strategy_available(StrategyName.fsdp1, "cpu")
    check_strategy_available(StrategyName.fsdp1, "cuda")


def test_deepspeed_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    with pytest.raises(StrategyError, match="needs CUDA"):
        check_strategy_available(StrategyName.deepspeed_zero3, "cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(StrategyError, match="pip install"):
        check_strategy_available(StrategyName.deepspeed_zero3, "cuda")
