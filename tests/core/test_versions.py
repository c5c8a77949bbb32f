"""The tested set of libraries: declared ranges, the lock, ``--version``, and the records that name them.

``pyproject.toml`` declares the ranges the suite ran on, ``requirements/`` locks the exact
set ``tools/install.sh`` installs, and :mod:`fsdp_workflow.core.versions` reads both
without importing the libraries. These tests hold the three to each other and check
that ``--version``, ``provenance.json``, ``train_exit.json`` and the model card name
what ran.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from fsdp_workflow.core import versions

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "requirements"


def lock_pins(name: str) -> dict[str, str]:
    """``{distribution: version}`` of a lock file, following its ``-c`` includes."""
    pins: dict[str, str] = {}
    for line in (LOCKS / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            pins.update(lock_pins(line[3:].strip()))
        elif "==" in line:
            dist, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", dist).lower()] = version
    return pins


def test_every_declared_range_holds_the_locked_version() -> None:
    """The lock is inside the ranges, for CPU and GPU: a range moved without the lock (or back) fails here."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    ranges = versions.declared()
    assert {"torch", "transformers", "accelerate", "safetensors"} <= set(ranges), ranges
    for lock in ("cpu.txt", "cuda.txt"):
        pins = lock_pins(lock)
        for name, spec in ranges.items():
            pinned = pins.get(re.sub(r"[-_.]+", "-", name).lower())
            if pinned is None and lock == "cpu.txt" and name in ("deepspeed", "torchao"):
                continue  # GPU extras: CI installs neither; cuda.txt pins them
            assert pinned is not None, f"requirements/{lock} pins no {name}"
            assert Version(pinned) in SpecifierSet(spec), f"requirements/{lock}: {name}=={pinned} outside {spec}"
    assert all("<" in spec for spec in ranges.values()), f"every library that matters has an upper bound: {ranges}"


@pytest.mark.skipif(os.environ.get("FSDP_WORKFLOW_UNLOCKED") == "1",
                    reason="tools/check_newest.sh installs other versions than the lock on purpose")
def test_the_suite_runs_on_the_locked_set() -> None:
    """What is tested is what installs: the libraries that change behaviour are the lock's versions."""
    pins = lock_pins("cpu.txt")
    found = versions.installed(tuple(n for n in versions.LIBRARIES if n not in versions.BUILDS))
    wrong = {n: (v, pins.get(re.sub(r"[-_.]+", "-", n).lower())) for n, v in found.items()
             if v != pins.get(re.sub(r"[-_.]+", "-", n).lower())}
    assert not wrong, f"installed vs requirements/cpu.txt: {wrong}; install with: bash tools/install.sh"


def test_a_version_outside_its_range_is_named_with_the_range() -> None:
    ranges = versions.declared()
    assert versions.outside_tested({"accelerate": "99.0.0", "torch": "2.13.0+cpu", "transformers": None}) == [
        f"accelerate 99.0.0 is outside the tested range {ranges['accelerate']}"]
    assert versions.outside_tested({"accelerate": metadata.version("accelerate")}) == []


def test_version_flag_names_each_library_and_its_tested_range() -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow", "--version"], capture_output=True, text=True,
                          cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in ("torch", "transformers", "accelerate"):
        line = next(x for x in out.splitlines() if x.split()[:1] == [name])
        assert metadata.version(name) in line and f"tested: {versions.declared()[name]}" in line, line
    assert out.startswith("fsdp_workflow ")


def test_provenance_records_the_planning_environment(tmp_path: Path) -> None:
    run = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "dry_run=true",
                           f"run_dir={run}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    recorded = json.loads((run / "provenance.json").read_text())["versions"]
    assert recorded == versions.installed() and recorded["transformers"] == metadata.version("transformers")


def test_the_card_names_the_libraries_that_trained(tmp_path: Path) -> None:
    """train_exit.json's versions (the trainer's environment) win over provenance.json's (the planner's)."""
    from huggingface_hub import ModelCard

    from tests.consolidate.test_hf_assets import tiny_model
    from tests.report.test_card import make_run, ship

    run = make_run(tmp_path / "run", tiny_model(tied=True))
    run.provenance.write_text(json.dumps({"git_revision": "abc", "versions": {"torch": "0.0-planner"}}))
    run.train_exit.write_text(json.dumps({"exit_code": 0, "reason": "finished", "step": 5, "checkpoint": None,
                                          "versions": {"torch": "2.13.0+cpu", "transformers": "5.25.0",
                                                       "deepspeed": None}}))
    text = ModelCard.load(ship(run.root, tmp_path / "out", run.root)).text
    assert "| libraries | torch 2.13.0+cpu, transformers 5.25.0 (the trainer's, train_exit.json) |" in text
    assert "0.0-planner" not in text
