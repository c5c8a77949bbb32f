"""The command composes the config once (Hydra's mode read without a composition of its own), and
falls back to Hydra's two compositions wherever a config could set ``hydra.mode``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config.hydra_mode import mode_is_the_flags, tree_may_set_mode
from fsdp_workflow.config.load import CONF_DIR

# Runs `python -m fsdp_workflow ARGS` with Hydra's compose_config counted (printed last on stderr).
_COUNTED = r"""
import atexit, runpy, sys
from hydra._internal.hydra import Hydra
calls = []
original = Hydra.compose_config
def counted(self, *args, **kwargs):
    calls.append(kwargs.get("run_mode"))
    return original(self, *args, **kwargs)
Hydra.compose_config = counted
atexit.register(lambda: print(f"COMPOSED {len(calls)} {[str(m) for m in calls]}", file=sys.stderr))
sys.argv = ["fsdp_workflow", *sys.argv[1:]]
runpy.run_module("fsdp_workflow", run_name="__main__", alter_sys=True)
"""


def _counted_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    proc = subprocess.run([sys.executable, "-c", _COUNTED, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("COMPOSED ")]
    return proc, line


def test_the_shipped_tree_cannot_set_hydra_mode() -> None:
    """What makes the single composition safe: no file of conf/ has a mode: or searchpath: line."""
    assert not tree_may_set_mode(CONF_DIR)
    assert mode_is_the_flags(["+experiment=smoke", "dry_run=true", "run_dir=/tmp/x"])


@pytest.mark.parametrize("argv", [
    ["hydra.mode=MULTIRUN"], ["+hydra.mode=RUN"], ["--config-dir", "/elsewhere"], ["-cd=/elsewhere"],
    ["--config-name", "other"], ["hydra.searchpath=[file:///elsewhere]"],
])
def test_a_command_line_that_may_set_the_mode_keeps_hydras_own_reading(argv: list[str]) -> None:
    assert not mode_is_the_flags(["+experiment=smoke", *argv])


def test_a_tree_that_may_set_the_mode_keeps_hydras_own_reading(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - _self_\nseed: 1\n")
    assert mode_is_the_flags([], tmp_path)
    (tmp_path / "experiment" / "sweep.yaml").write_text("# @package _global_\nhydra:\n  mode: MULTIRUN\n")
    tree_may_set_mode.cache_clear()
    assert not mode_is_the_flags([], tmp_path)


def test_a_dry_run_composes_once_and_a_mode_on_the_command_line_is_the_flag(tmp_path: Path) -> None:
    """One composition (RUN) for a dry run. ``hydra.mode=MULTIRUN`` is ``-m``: each point gets its
    own run directory (it used to reach Hydra raw, and the second point was refused as the first's)."""
    proc, line = _counted_run(tmp_path, "+experiment=smoke", "dry_run=true", f"run_dir={tmp_path / 'one'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert line == "COMPOSED 1 ['RunMode.RUN']", line
    assert (tmp_path / "one" / "submit.sh").is_file()

    proc, line = _counted_run(tmp_path, "+experiment=smoke", "dry_run=true", "hydra.mode=MULTIRUN",
                              f"run_dir={tmp_path / 'swept'}", "optimizer.lr=1e-4,2e-4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "swept").iterdir() if (p / "submit.sh").is_file()) == ["0", "1"]
    assert "Launching 2 jobs" in proc.stdout + proc.stderr


def test_a_mode_set_by_a_config_is_read_by_hydra_as_before(tmp_path: Path) -> None:
    """A config dir whose experiment sets ``hydra.mode: MULTIRUN``: Hydra composes to read it
    (the MULTIRUN composition first), then runs the multirun it asks for."""
    extra = tmp_path / "mine" / "experiment"
    extra.mkdir(parents=True)
    (extra / "multi.yaml").write_text("# @package _global_\ndefaults:\n  - smoke\n  - _self_\n"
                                      "hydra:\n  mode: MULTIRUN\n")
    proc, line = _counted_run(tmp_path, "--config-dir", str(tmp_path / "mine"), "+experiment=multi",
                              "dry_run=true", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert line.startswith("COMPOSED 2 ['RunMode.MULTIRUN'"), line
    assert "Launching 1 jobs" in proc.stdout + proc.stderr and (tmp_path / "run" / "submit.sh").is_file()
