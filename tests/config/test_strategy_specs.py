"""The strategy registry (issue 40, item 6): one spec per strategy, both halves, nothing branching on names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_workflow
from fsdp_workflow.config.schema import StrategyName
from fsdp_workflow.config.strategies import STRATEGIES, spec

PACKAGE = Path(fsdp_workflow.__file__).parent
CONF = PACKAGE.parent / "conf" / "strategy"


def test_every_strategy_name_has_one_planning_spec_and_a_yaml() -> None:
    assert list(STRATEGIES) == list(StrategyName)
    shipped = {re.search(r"^name: (\S+)", p.read_text(), re.M).group(1) for p in CONF.glob("*.yaml")}
    assert shipped == {n.value for n in StrategyName}


def test_every_strategy_name_has_a_trainer_half() -> None:
    code = ("from fsdp_workflow.train.strategies import TRAIN_STRATEGIES; "
            "print(' '.join(n.value for n in TRAIN_STRATEGIES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [n.value for n in StrategyName]


@pytest.mark.parametrize(("name", "words"), [
    (StrategyName.fsdp2, "dp_replicate 1 x dp_shard 4 x cp 1 x tp 2"),
    (StrategyName.ddp, "none (ddp): 8 data-parallel rank(s); each holds the whole model (DDP replicas)"),
    (StrategyName.fsdp1, "none (fsdp1): 8 data-parallel rank(s); FSDP1 shards the model over all of them"),
    (StrategyName.deepspeed_zero2,
     "none (deepspeed_zero2): 8 data-parallel rank(s); DeepSpeed ZeRO stage 2 over all of them"),
])
def test_the_mesh_is_said_as_before(name: StrategyName, words: str) -> None:
    assert spec(name).describe_mesh({"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}) == words


def test_the_planning_half_imports_no_torch() -> None:
    code = "import sys, fsdp_workflow.config.strategies; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# Modules that may still name a strategy: the registries themselves, and code about checkpoint formats
# or other owners' modules (see docs/contributing.md, "Adding a strategy").
MAY_NAME = ("config/schema.py", "config/strategies/", "train/strategies/", "consolidate/", "core/",
            "config/rules_env.py")


def test_no_module_outside_the_specs_compares_a_strategy_name() -> None:
    """``StrategyName.x`` outside the specs is a branch a new strategy would have to find."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(MAY_NAME):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"StrategyName\.\w+|\.name\.value\s*[!=]=|== \"(fsdp[12]|ddp|deepspeed_zero\d)\"", line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []
