"""The configuration claims of the README and docs are checked against what the code does (issue 24, item 13)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config.load import CONF_DIR, compose

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GROUPS = ["model", "data", "strategy", "optimizer", "cluster", "container", "experiment"]


@pytest.mark.parametrize("group", GROUPS)
def test_the_readme_lists_every_option_of_each_group(group: str) -> None:
    row = next(ln for ln in README.splitlines() if ln.startswith(f"| `{group}` |"))
    listed = set(re.findall(r"`([a-z0-9_]+)`", row.split("|")[2]))
    shipped = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    assert listed == shipped, f"README's {group} row: missing {shipped - listed}, not shipped {listed - shipped}"


def test_the_readme_says_jobs_txt_is_written_only_on_submission(tmp_path: Path) -> None:
    sentence = next(s for s in re.split(r"(?<=\.)\s", README.replace("\n", " ")) if "`jobs.txt`" in s)
    assert "Slurm" in sentence and "local run" in sentence, sentence
    # and it is so: a dry run (as a local run) submits nothing and writes no jobs.txt
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "dry_run=true", f"run_dir={run}"],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, HYDRA_FULL_ERROR="0"))
    assert res.returncode == 0, res.stderr
    assert (run / "config.yaml").is_file() and not (run / "jobs.txt").exists()


def test_launch_env_is_written_as_the_docs_say() -> None:
    """docs/configuration.md: one `export K=v` line per variable, each value through shlex.quote."""
    from fsdp_workflow.config.accelerate_env import accelerate_env
    from fsdp_workflow.plan.render import render_launch_env

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert "`export K=v` line per" in doc and "`shlex.quote`" in doc and "export K='v'" not in doc
    env = dict(accelerate_env(compose(["+experiment=smoke"])))
    env["FSDP_TEST_HOSTILE"] = "a b'$(touch x);\nz"
    lines = [ln for ln in render_launch_env(env).splitlines() if not ln.startswith("#")]
    exported = [ln for ln in lines if ln.startswith("export ")]
    assert len(exported) == len(env)
    for key, value in env.items():
        assert f"export {key}={shlex.quote(value)}" in render_launch_env(env)
    assert "export ACCELERATE_USE_FSDP=true" in lines  # a plain value stays bare, as the doc says


def test_the_70b_hybrid_example_of_parallelism_md_plans_as_written(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "parallelism.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "strategy.dp_replicate_size=2" in b)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "fsdp_workflow"]
    argv = [a if not a.startswith("run_dir=") else f"run_dir={tmp_path / 'plan'}" for a in argv[3:]]
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", *argv], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "dp_replicate 2 x dp_shard 4 x cp 1 x tp 8" in res.stderr
