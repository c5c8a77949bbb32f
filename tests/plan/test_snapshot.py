"""The code snapshot (cluster.code_snapshot): what is copied, its hash, and every job's PYTHONPATH."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from fsdp_workflow.config.load import compose
from fsdp_workflow.container.wrap import explicit_env
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import write_run_dir
from fsdp_workflow.plan.snapshot import content_hash, package_files, write_snapshot


def _package(root: Path) -> Path:
    pkg = root / "fsdp_workflow"
    (pkg / "train" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("STEP = 1\n")
    (pkg / "train" / "__pycache__" / "loop.cpython-311.pyc").write_bytes(b"\0bytecode")
    (pkg / "conf").mkdir()
    (pkg / "conf" / "config.yaml").write_text("a: 1\n")
    return pkg


def test_the_snapshot_copies_sources_and_config_not_bytecode_and_hashes_them(tmp_path: Path) -> None:
    pkg = _package(tmp_path / "src")
    rec = write_snapshot(tmp_path / "run" / "code", source=pkg)
    out = tmp_path / "run" / "code" / "fsdp_workflow"
    assert sorted(p.as_posix() for p in package_files(out)) == ["__init__.py", "conf/config.yaml", "train/loop.py"]
    assert not list(out.rglob("*.pyc")) and rec["files"] == 3 and rec["path"] == str(out)
    assert rec["sha256"] == content_hash(pkg) == content_hash(out)
    (pkg / "train" / "loop.py").write_text("STEP = 2\n")  # an edit changes the hash
    assert content_hash(pkg) != rec["sha256"]
    # Replanning replaces the snapshot whole: the edit is in, nothing is left beside it.
    again = write_snapshot(tmp_path / "run" / "code", source=pkg)
    assert (out / "train" / "loop.py").read_text() == "STEP = 2\n" and again["sha256"] == content_hash(pkg)
    assert sorted(p.name for p in (tmp_path / "run" / "code").iterdir()) == ["fsdp_workflow"]


def test_every_job_script_and_the_container_put_the_snapshot_first(weird_dir: Path) -> None:
    run = weird_dir / "run"
    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", "consolidate.every_checkpoint=true"])
    cfg.run_dir = str(run)  # set directly: Hydra's override grammar has no newline escape
    plan = write_run_dir(cfg, backend_for(cfg))
    line = plan.layout.code
    assert (line / "fsdp_workflow" / "train" / "loop.py").is_file()
    for name in ("prepare.sbatch", "train.sbatch", "consolidate.sbatch", "eval.sbatch"):
        script = (run / name).read_text()
        # (a run dir with a newline spans two lines, inside its quotes)
        exports = re.findall(r"^export PYTHONPATH=.*?\$\{PYTHONPATH:\+:\$PYTHONPATH\}", script, re.M | re.S)
        assert len(exports) == 1, (name, script)
        # bash reads the quoted path back exactly, whatever characters the run dir has, before any other
        for before, after in (("", str(line)), ("/site", f"{line}:/site")):
            got = subprocess.run(["bash", "-c", exports[0] + '\nprintf %s "$PYTHONPATH"'], capture_output=True,
                                 text=True, env={"PATH": "/usr/bin:/bin", **({"PYTHONPATH": before} if before else {})})
            assert got.stdout == after, (name, got)
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["code_snapshot"]["path"] == str(line / "fsdp_workflow") and len(prov["code_snapshot"]["sha256"]) == 64
    assert "git_dirty" in prov
    assert explicit_env(cfg)["PYTHONPATH"] == str(line)


def test_a_job_started_in_a_checkout_imports_the_snapshot_not_the_checkout(tmp_path: Path) -> None:
    """`python -m` puts the working directory first: a job submitted from an edited checkout must not import it."""
    from fsdp_workflow.backends.slurm.scripts import site_env_lines

    run = tmp_path / "run"
    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}"])
    plan = write_run_dir(cfg, backend_for(cfg))
    checkout = tmp_path / "checkout"
    (checkout / "fsdp_workflow").mkdir(parents=True)  # the submit directory holds an edited copy of the package
    (checkout / "fsdp_workflow" / "__init__.py").write_text("raise SystemExit('imported the checkout')\n")
    probe = "import fsdp_workflow.core.exit_codes as m; print(m.__file__)"
    script = "\n".join([*site_env_lines(plan), f"cd {checkout}", "python -m fsdp_workflow.core.exit_codes",
                        f"python -c '{probe}'"])
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=checkout)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(plan.layout.code / "fsdp_workflow" / "core" / "exit_codes.py")
    assert explicit_env(compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug",
                                 f"run_dir={run}"]))["PYTHONSAFEPATH"] == "1"


def test_opting_out_writes_no_snapshot_and_no_pythonpath(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}",
                   "cluster.code_snapshot=false"])
    plan = write_run_dir(cfg, backend_for(cfg))
    assert plan.code_dir is None and not (run / "code").exists()
    assert "PYTHONPATH" not in (run / "train.sbatch").read_text() + (run / "consolidate.sbatch").read_text()
    assert json.loads((run / "provenance.json").read_text())["code_snapshot"] is None
    assert "PYTHONPATH" not in explicit_env(cfg)


def _tiny_fs(path: Path, size: str):
    """A real, small filesystem (tmpfs) at ``path``: root only (CI runs the tests as root)."""
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def test_a_full_disk_refuses_the_snapshot_with_the_space_needed_and_freeing_it_works(tmp_path: Path) -> None:
    """The disk-full advice is a path that works: plan onto a full disk (exit 74, no traceback, nothing
    half-written), free what it says, run the same command again (it plans)."""
    import sys

    fs = tmp_path / "fs"
    _tiny_fs(fs, "6m")  # two snapshots of the package (about 2.2 MB each) and room to spare
    try:
        run_dir = fs / "run"
        argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "cluster=slurm", "cluster.partition=debug",
                f"run_dir={run_dir}", "dry_run=true", "data=synthetic"]
        first = subprocess.run(argv, capture_output=True, text=True, timeout=120)  # a run of this tool, re-planned
        assert first.returncode == 0, first.stderr
        old = run_dir / "checkpoints" / "step-10"
        old.mkdir(parents=True)
        free = __import__("shutil").disk_usage(fs).free
        (old / "blob").write_bytes(b"\0" * (free - 300_000))  # leaves about 0.3 MB: less than the code needs
        (run_dir / "submit.sh").unlink()  # so the refused re-plan is seen to write no script
        full = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert full.returncode == 74, full.stdout + full.stderr
        assert "disk full (ENOSPC): the code snapshot needs" in full.stderr and "Traceback" not in full.stderr
        m = re.search(r"Free at least ([\d.]+) MB", full.stderr)
        assert m and float(m.group(1)) > 0, full.stderr
        assert str(run_dir / "checkpoints") in full.stderr
        assert not (run_dir / "code" / ".fsdp_workflow.tmp").exists() and not (run_dir / "submit.sh").exists()
        __import__("shutil").rmtree(old)  # what the message says to free
        again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert (run_dir / "code" / "fsdp_workflow" / "__init__.py").is_file()
    finally:
        subprocess.run(["umount", str(fs)], check=False)


def test_disk_full_while_copying_leaves_no_partial_snapshot(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC in the middle of the copy (the disk filled meanwhile): exit 74, the partial copy removed."""
    import errno

    import pytest

    from fsdp_workflow.plan import snapshot

    pkg = _package(tmp_path / "src")
    calls = []

    def copy_then_fill(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return __import__("shutil").copyfile(src, dst)

    monkeypatch.setattr(snapshot.shutil, "copy2", copy_then_fill)
    with pytest.raises(snapshot.SnapshotDiskFull) as info:
        write_snapshot(tmp_path / "run" / "code", source=pkg)
    assert info.value.code == 74 and "needs" in info.value.message
    assert list((tmp_path / "run" / "code").iterdir()) == []
