"""Path keys are made absolute at planning, and paths that cannot work are refused (issue 36, item 7).

    python -m pytest tests/cli/test_path_keys.py

Relative paths mean the directory the command ran in: ``config.yaml`` records them
absolute, so the prepare job (or ``status``, ``replan``) reads the same files from any
other directory. A path longer than the filesystem allows, below a file, or (for a
directory the run writes) on a read-only filesystem is refused at planning, exit 2,
naming the key: before, an ``OSError`` or lock traceback, or a job failing after the queue.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_workflow.core.exit_codes import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt"
SMOKE = ("+experiment=smoke", "dry_run=true")
LONG = "x" * 300  # past NAME_MAX (255) on every Linux filesystem


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", *args], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)


def test_relative_paths_are_recorded_absolute_and_prepare_runs_from_another_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(CORPUS, work / "data" / "corpus.txt")
    res = cli(*SMOKE, "run_dir=run", "data.path=data/corpus.txt", "data.cache_dir=cache",
              "consolidate.output_dir=models/out", "cluster.log_dir=logs", cwd=work)
    assert res.returncode == 0, res.stderr
    recorded = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert recorded["run_dir"] == str(work / "run")
    assert recorded["data"]["path"] == str(work / "data" / "corpus.txt")
    assert recorded["data"]["cache_dir"] == str(work / "cache")
    assert recorded["consolidate"]["output_dir"] == str(work / "models" / "out")
    assert recorded["cluster"]["log_dir"] == str(work / "logs")
    # What a job does: prepare from its own working directory (here "/"), reading config.yaml.
    prep = subprocess.run([sys.executable, "-m", "fsdp_workflow.data.prepare", str(work / "run"), "--workers", "1"],
                          capture_output=True, text=True, cwd="/", timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert [p.name for p in (work / "cache").iterdir()], "the cache was written where the planner was told"
    # The same command again is the same run (nothing differs once resolved).
    again = cli(*SMOKE, "run_dir=run", "data.path=data/corpus.txt", "data.cache_dir=cache",
                "consolidate.output_dir=models/out", "cluster.log_dir=logs", cwd=work)
    assert again.returncode == 0, again.stderr


def test_a_run_recorded_with_relative_paths_is_the_same_run_when_planned_again(tmp_path: Path) -> None:
    """A run planned before this rule recorded ``data.path: corpus.txt``: the same command is not another config."""
    shutil.copy(CORPUS, tmp_path / "corpus.txt")
    assert cli(*SMOKE, "run_dir=run", "data.path=corpus.txt", cwd=tmp_path).returncode == 0
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace(f"path: {tmp_path / 'corpus.txt'}", "path: corpus.txt"))
    assert "path: corpus.txt\n" in config.read_text()
    res = cli(*SMOKE, "run_dir=run", "data.path=corpus.txt", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    other = cli(*SMOKE, "run_dir=run", "data.path=corpus.txt", "train.max_steps=20", cwd=tmp_path)
    assert other.returncode == EXIT_USAGE and "train.max_steps: 30 -> 20" in other.stderr, other.stderr
    assert "data.path" not in other.stderr  # the only difference is the one made on purpose


@pytest.fixture
def read_only_fs(tmp_path: Path):
    """A real tmpfs holding an existing directory ``existing``, remounted read-only (as root; CI runs as root)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("key,where,why", [
    ("run_dir", "ro/existing", "why: {t}/ro/existing is on a read-only file system"),  # was: a lock traceback
    ("run_dir", "ro/new", "why: {t}/ro is on a read-only file system"),
    ("consolidate.output_dir", "ro/out", "why: {t}/ro is on a read-only file system"),  # was: failed in the job
    ("data.cache_dir", "ro/cache", "why: {t}/ro is on a read-only file system"),
    ("run_dir", f"{LONG}/run", "why: [Errno 36] a name in it is 300 bytes long"),  # was: an OSError traceback
    ("cluster.log_dir", f"{LONG}", "why: [Errno 36] a name in it is 300 bytes long"),
    ("data.cache_dir", "afile/cache", "why: lies below {t}/afile, which is a file, not a directory"),
    ("consolidate.output_dir", "afile", "why: is a file, not a directory"),
])
def test_a_path_that_cannot_work_is_refused_at_planning_naming_the_key(key: str, where: str, why: str,
                                                                        read_only_fs: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    run = [] if key == "run_dir" else ["run_dir=run"]
    res = cli(*SMOKE, *run, f"{key}={tmp_path / where}", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE, res.stderr[-3000:]
    assert f"{key} = '{tmp_path / where}'" in res.stderr, res.stderr
    assert why.format(t=tmp_path) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "OSError" not in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_read_only_working_directory_is_named_as_such_not_as_an_invalid_config(read_only_fs: Path, tmp_path: Path,
                                                                                  sweep: bool) -> None:
    """Issue 49, item 7: without run_dir=, Hydra makes runs/NAME/TIME below the working directory; from a
    read-only one that was ``invalid config`` quoting ``[Errno 30]``. Now the directory, why and the fix."""
    args = (*(("-m",) if sweep else ()), *SMOKE, *(("optimizer.lr=1e-3,1e-4",) if sweep else ()))
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", *args], capture_output=True, text=True,
                         cwd=read_only_fs, env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT)), timeout=120)
    assert res.returncode == EXIT_USAGE, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert lines[0] == "fsdp_workflow: cannot create the run directory" and "invalid config" not in res.stderr
    assert f"run_dir = '{read_only_fs}/runs/smoke" in lines[1] and f"working directory {read_only_fs})" in lines[1]
    assert f"why: cannot create {read_only_fs}/runs: Read-only file system" in lines[2]
    assert lines[3].strip().startswith("fix: run from a writable directory") and "run_dir=/writable/path/RUN" in lines[3]
    ok = subprocess.run([sys.executable, "-m", "fsdp_workflow", *args, f"run_dir={tmp_path / 'run'}"],
                        capture_output=True, text=True, cwd=read_only_fs,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]  # the fix: a run_dir elsewhere, from the same directory
