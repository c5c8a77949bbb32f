"""One run per run directory, and only a run directory (issue 24, items 4, 5, 6).

- ``run_dir`` is a new directory, an empty one, or a run of this tool (its
  ``config.yaml`` and ``provenance.json``); ``/``, any other non-empty directory
  and a file are refused with exit 2 before anything is written.
- The planner takes ``RUN_DIR/.lock`` before it writes: a second command on
  the same run directory is refused at once, naming the holder.
- The submit hint a dry run prints is shell-quoted: pasted into bash with a
  run directory named ``x$(touch PWNED)y'"``, nothing runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ("+experiment=smoke", "dry_run=true")
HOSTILE = "x$(touch PWNED)y'\""


def cli(*args: str, cwd: Path = ROOT, env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", *args], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {})), timeout=120)


def hydra_quoted(path: Path) -> str:
    """``run_dir="..."`` as Hydra's override grammar reads it back to ``path`` exactly."""
    return 'run_dir="' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


def snapshot(root: Path) -> Dict[str, Tuple[bytes, int]]:
    """Every entry under ``root`` (files with bytes and mtime), to prove nothing changed or appeared."""
    return {str(p.relative_to(root)): ((p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else (b"", 0))
            for p in sorted(root.rglob("*"))}


# ------------------------------------------------------------------ what run_dir may be
def test_root_is_refused_by_name(tmp_path: Path) -> None:
    # train.max_steps=0 is refused too, so even a broken run_dir rule cannot write into /.
    res = cli(*SMOKE, "run_dir=/", "train.max_steps=0")
    assert res.returncode == 2, res.stderr
    assert "run_dir = '/'" in res.stderr and "holds no run of this tool" in res.stderr, res.stderr
    assert "train.max_steps" in res.stderr  # every problem in one report


def test_a_non_empty_directory_that_is_not_a_run_is_refused_and_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "src").mkdir(parents=True)
    (home / "notes.txt").write_text("mine\n")
    (home / "config.yaml").write_text("not: ours\n")  # a config.yaml alone is not a run of this tool
    before = snapshot(home)
    res = cli(*SMOKE, f"run_dir={home}")
    assert res.returncode == 2, res.stderr
    assert "holds no run of this tool" in res.stderr and "notes.txt" in res.stderr
    assert "Traceback" not in res.stderr
    assert snapshot(home) == before  # no config, scripts, code/, logs/ or .lock


def test_an_empty_run_dir_is_one_problem_and_the_working_directory_is_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    res = cli(*SMOKE, "run_dir=", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "found 1 problem" in res.stderr and "every run needs a directory" in res.stderr, res.stderr
    assert "holds no run of this tool" not in res.stderr  # the working directory is not what was named
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("spelled", ["run_dir=~/runs/r", 'run_dir="~/runs/r"'], ids=["bare", "quoted"])
def test_a_run_dir_under_home_is_planned_there_and_no_directory_named_tilde_appears(spelled: str,
                                                                                  tmp_path: Path) -> None:
    """``~`` is the home directory: before, Hydra refused the bare form and made ``./~/runs/r`` of the quoted one."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    res = cli(*SMOKE, spelled, cwd=cwd, env={"HOME": str(home)})
    assert res.returncode == 0, res.stderr
    assert f"dry run: wrote {home / 'runs' / 'r'} (" in res.stdout, res.stdout
    assert (home / "runs" / "r" / "config.yaml").is_file() and list(cwd.iterdir()) == []
    assert f"run_dir: {home / 'runs' / 'r'}\n" in (home / "runs" / "r" / "config.yaml").read_text()


def test_only_a_single_home_path_is_spelled_out() -> None:
    from fsdp_workflow.config.load import expand_home

    home = os.path.expanduser("~")
    assert expand_home("data.path=~/d.jsonl") == f"data.path={home}/d.jsonl"
    assert expand_home("run_dir='~/a b'") == f"run_dir='{home}/a b'"
    for kept in ("experiment=~", "run_dir=~", "run_dir=~/a,~/b", "hydra.run.dir=~/x", "name=~x", "--cfg",
                 "run_dir=~no_such_user_here/x"):
        assert expand_home(kept) == kept


@pytest.mark.parametrize("below", [False, True], ids=["a file", "below a file"])
def test_a_file_is_refused_without_a_traceback(tmp_path: Path, below: bool) -> None:
    f = tmp_path / "plan.txt"
    f.write_text("x\n")
    res = cli(*SMOKE, f"run_dir={f / 'run' if below else f}")
    assert res.returncode == 2, res.stderr
    assert "run_dir" in res.stderr and ("is a file" in res.stderr or "which is a file" in res.stderr)
    assert "Traceback" not in res.stderr and "FileExistsError" not in res.stderr
    assert f.read_text() == "x\n" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.txt"]


def test_an_empty_directory_is_accepted_and_kept_when_a_config_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    res = cli(*SMOKE, f"run_dir={empty}", "train.max_steps=0")
    assert res.returncode == 2 and empty.is_dir() and not list(empty.iterdir())  # the user's directory stays
    res = cli(*SMOKE, f"run_dir={empty}")
    assert res.returncode == 0, res.stderr
    assert (empty / "config.yaml").is_file() and (empty / "provenance.json").is_file()


def test_an_existing_run_is_accepted_and_wrote_lists_only_what_was_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert cli(*SMOKE, f"run_dir={run}").returncode == 0
    (run / "metrics.jsonl").write_text("{}\n")  # the run's own files, not the planner's
    res = cli(*SMOKE, f"run_dir={run}")
    assert res.returncode == 0, res.stderr
    wrote = re.search(r"wrote .* \((.*)\); nothing submitted", res.stdout).group(1).split(", ")
    assert "metrics.jsonl" not in wrote and ".lock" not in wrote
    assert {"config.yaml", "provenance.json", "submit.sh"} <= set(wrote)


# ------------------------------------------------------------------ the lock
HOLDER = textwrap.dedent("""
    import sys, time
    from fsdp_workflow.core.lock import acquire
    lock = acquire(sys.argv[1], "training (test holder)")
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("existing", [True, False], ids=["an existing run", "a new directory"])
def test_a_second_command_is_refused_naming_the_holder_and_writes_nothing(tmp_path: Path, existing: bool) -> None:
    run = tmp_path / "run"
    if existing:
        assert cli(*SMOKE, f"run_dir={run}").returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run / ".lock")], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(run)
        res = cli(*SMOKE, f"run_dir={run}")
        assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
        assert f"pid {holder.pid}" in res.stderr and "training (test holder)" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()
    res = cli(*SMOKE, f"run_dir={run}")  # the kernel freed the lock with its holder
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------ pasted commands
@pytest.mark.parametrize("name", [HOSTILE, "x$(touch PWNED)y"], ids=["issue's name", "balanced quotes"])
def test_the_printed_submit_hint_runs_nothing_when_pasted(tmp_path: Path, name: str) -> None:
    run = tmp_path / name
    work = tmp_path / "cwd"
    work.mkdir()
    res = cli(*SMOKE, hydra_quoted(run), cwd=work)
    assert res.returncode == 0, res.stderr
    assert run.is_dir() and (run / "submit.sh").is_file()
    hint = [ln for ln in res.stdout.splitlines() if ln.startswith("submit the same chain later with: ")]
    assert len(hint) == 1
    command = hint[0].split(": ", 1)[1]
    shims = tmp_path / "shims"
    shims.mkdir()
    for tool in ("sbatch", "scontrol", "squeue", "scancel"):  # nothing can reach a real cluster
        (shims / tool).write_text(f"#!/bin/sh\necho \"$0\" >> '{shims}/called'\nexit 1\n")
        (shims / tool).chmod(0o755)
    pasted = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}",
                                     SLURM_CONF="/nonexistent/slurm.conf"))
    assert "submit.sh" in command
    # the pasted line ran the real submit.sh, which reached (the shim of) sbatch: bash parsed it whole
    assert (shims / "called").is_file(), (command, pasted.stderr)
    assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists(), (command, pasted.stderr)


PROBE_SBATCH = """#!{python}
import sys
from fsdp_workflow.core.lock import is_locked, read_holder
holder = read_holder({lock!r})
with open({record!r}, "a") as f:
    f.write(f"{{is_locked({lock!r})}} {{holder.what if holder else None}}\\n")
print("4242")  # --parsable: the job id
"""


def test_the_slurm_route_holds_the_lock_while_submitting_and_releases_it(tmp_path: Path) -> None:
    """An sbatch stand-in on PATH records, at each call, whether the run's lock is held; it is, then it is not."""
    from fsdp_workflow.core.lock import is_locked

    run = tmp_path / "run"
    shims = tmp_path / "shims"
    shims.mkdir()
    record = tmp_path / "probe.txt"
    sbatch = shims / "sbatch"
    sbatch.write_text(PROBE_SBATCH.format(python=sys.executable, lock=str(run / ".lock"), record=str(record)))
    sbatch.chmod(0o755)
    res = cli("+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}",
              env={"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    calls = record.read_text().splitlines()
    assert calls and all(c.startswith("True planning") for c in calls), calls  # held by the planner at each sbatch
    assert not is_locked(run / ".lock")  # released once submitted
