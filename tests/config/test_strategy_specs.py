"""The strategy registry (issue 40, item 6): one spec per strategy, both halves, nothing branching on names.

Adding a strategy touches 3 files (docs/contributing.md, "Adding a strategy"): its planning
module, its trainer module and its YAML. ``StrategyName`` is built from the planning modules,
and both registries find their modules themselves; the last test adds a strategy to a copy of
the package in exactly those 3 files and composes it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fsdp_workflow
from fsdp_workflow.config.schema import StrategyName
from fsdp_workflow.config.strategies import STRATEGIES, gathered, spec, strategy_names

PACKAGE = Path(fsdp_workflow.__file__).parent
CONF = PACKAGE.parent / "conf" / "strategy"


def test_every_strategy_name_has_one_planning_spec_and_a_yaml() -> None:
    assert list(STRATEGIES) == list(StrategyName)
    shipped = {re.search(r"^name: (\S+)", p.read_text(), re.M).group(1) for p in CONF.glob("*.yaml")}
    assert shipped == {n.value for n in StrategyName}


def test_strategy_name_is_the_planning_modules_names_in_todays_order() -> None:
    """Derived, not listed: the members are what the modules of config/strategies/ declare, in their ORDER."""
    assert [n.value for n in StrategyName] == list(strategy_names()) == [s.name for s in gathered()]
    assert [n.value for n in StrategyName] == [
        "fsdp2", "fsdp1", "ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"]
    assert all(n.name == n.value for n in StrategyName)
    assert StrategyName.__doc__.startswith("How parameters, gradients and optimizer state are distributed.")


def test_the_schema_lists_no_strategy() -> None:
    """schema.py names no strategy: a member written there would be a 4th file to touch."""
    source = (PACKAGE / "config" / "schema.py").read_text(encoding="utf-8")
    for name in StrategyName:
        assert not re.search(rf"\b{name.value}\b", source), f"schema.py names the strategy {name.value}"


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
MAY_NAME = ("config/schema.py", "config/strategies/", "train/strategies/", "consolidate/", "core/")


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


PROBE_PLAN = """
    from typing import Dict, Tuple

    from fsdp_workflow.config.strategies.base import StrategySpec


    def memory(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
        return 4 * p, 4 * p, opt


    SPECS = (StrategySpec(name="probe", memory=memory, held="a probe"),)
"""
PROBE_TRAIN = """
    from fsdp_workflow.config.schema import StrategyName
    from fsdp_workflow.train.strategies.base import TrainStrategy

    SPECS = (TrainStrategy(StrategyName.probe),)
"""
PROBE_CHECK = """
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.config.schema import StrategyName
    from fsdp_workflow.config.strategies import STRATEGIES
    from fsdp_workflow.train.strategies import TRAIN_STRATEGIES

    cfg = compose(["strategy=probe"])
    assert cfg.strategy.name is StrategyName.probe, cfg.strategy.name
    assert compose(["strategy.name=probe"]).strategy.name is StrategyName.probe
    print(" ".join(n.value for n in StrategyName))
    print(" ".join(n.value for n in STRATEGIES))
    print(" ".join(n.value for n in TRAIN_STRATEGIES))
"""


def test_a_new_strategy_is_three_new_files(tmp_path: Path) -> None:
    """In a copy of the package: a planning module, a trainer module and a YAML make a strategy that composes."""
    root = PACKAGE.parent
    shutil.copytree(PACKAGE, tmp_path / "fsdp_workflow", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("__pycache__"))
    new = {
        "fsdp_workflow/config/strategies/probe.py": PROBE_PLAN,
        "fsdp_workflow/train/strategies/probe.py": PROBE_TRAIN,
        "conf/strategy/probe.yaml": "defaults:\n  - strategy_schema\nname: probe\n",
    }
    for rel, text in new.items():
        (tmp_path / rel).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE_CHECK)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    names = " ".join(n.value for n in StrategyName) + " probe"  # no ORDER: after the ordered modules
    assert run.stdout.split("\n")[:3] == [names] * 3
