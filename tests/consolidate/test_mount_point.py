"""OUT that cannot be renamed (docs/consolidation.md, "An OUT that cannot be renamed").

A container's bind-mounted ``/output`` is a mount point: ``os.rename`` of it fails with EBUSY,
and its parent may be read-only. ``consolidate SRC /output --overwrite`` (the command the tool
itself tells the user to paste) failed there after all the work, with a traceback, a stray
lock file in the parent and nothing written. Each test mounts a real filesystem (tmpfs, or a
bind mount of a directory on the same disk, which ``os.path.ismount`` does not see) on a
temporary directory, runs the real CLI on a real DCP checkpoint (``dcp.save``), and unmounts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file

from fsdp_workflow.consolidate.in_place import LOCK_NAME, OLD_PREFIX, STAGING_PREFIX, cannot_rename
from fsdp_workflow.core.exit_codes import EXIT_NONFINITE, EXIT_USAGE

from . import layouts

CMD = [sys.executable, "-m", "fsdp_workflow.consolidate"]


def _run_dir(root: Path, nan: bool = False) -> Path:
    """RUN_DIR/checkpoints/step-1, written by dcp.save: three 64 KiB tensors."""
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(128, 128) for i in range(3)}
    if nan:
        state["layer1.weight"][2, 3] = float("inf")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": state}, root / "checkpoints" / "step-1")
    return root


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *argv, "--no-progress"], capture_output=True, text=True, timeout=300)


@pytest.fixture(params=["tmpfs", "bind"])
def mounted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/output``, a real mount point holding a file of the user's (as root; CI runs as root)."""
    out = tmp_path / "output"
    out.mkdir()
    if request.param == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(out)]
    else:  # the same disk: st_dev equals the parent's, so only /proc/self/mountinfo tells
        (tmp_path / "host-dir").mkdir()
        cmd = ["mount", "--bind", str(tmp_path / "host-dir"), str(out)]
    subprocess.run(cmd, check=True)
    try:
        (out / "old.txt").write_text("from before")
        yield out
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def _beside(out: Path) -> list[str]:
    """What is in OUT's parent besides OUT (and the bind mount's source directory)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name not in (out.name, "host-dir", "run"))


def test_overwrite_into_a_mount_point_replaces_its_contents(mounted: Path, tmp_path: Path) -> None:
    """The pasted ``--overwrite`` works: the model is written into the mount point, nothing left beside it or in it."""
    run = _run_dir(tmp_path / "run")
    assert cannot_rename(mounted) == "it is a mount point"
    proc = _cli(str(run), str(mounted))
    assert proc.returncode == EXIT_USAGE and "pass --overwrite" in proc.stderr, proc.stderr  # as before: it exists
    hint = proc.stderr.split("to replace it: ", 1)[1].strip()
    proc = subprocess.run(["bash", "-c", hint], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["verified"] is True
    assert "written into it in place" in proc.stderr  # the note saying how OUT was replaced
    assert sorted(p.name for p in mounted.iterdir()) == ["model.safetensors", "verification.json"]  # no reference
    assert not (mounted / "old.txt").exists() and not (mounted / LOCK_NAME).exists()
    assert _beside(mounted) == []  # no lock file, no staging directory in the parent
    got = load_file(str(mounted / "model.safetensors"))
    assert sorted(got) == ["layer0.weight", "layer1.weight", "layer2.weight"]
    report = json.loads((mounted / "verification.json").read_text())
    assert report["ok"] and any("in place" in n for n in report["notes"]), report["notes"]
    # Again, over its own earlier output: the same model, still nothing left over.
    before = (mounted / "model.safetensors").read_bytes()
    again = _cli(str(run), str(mounted), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert (mounted / "model.safetensors").read_bytes() == before and _beside(mounted) == []
    assert not [p for p in mounted.iterdir() if p.name.startswith(".")]


def test_an_empty_mount_point_is_written_without_overwrite(tmp_path: Path) -> None:
    """A fresh ``-v HOST_DIR:/output`` is empty: nothing to lose, so no --overwrite is asked for."""
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "output"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(out)], check=True)
    try:
        proc = _cli(str(run), str(out))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "verification.json"]
        assert json.loads((out / "verification.json").read_text())["ok"] and _beside(out) == []
        proc = _cli(str(run), str(out))  # no longer empty: an earlier consolidation, replaced only with --overwrite
        assert proc.returncode == EXIT_USAGE and "OUT holds an earlier consolidation" in proc.stderr, proc.stderr
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def test_refused_in_place_keeps_the_earlier_model(mounted: Path, tmp_path: Path) -> None:
    """A consolidation refused after the copy (inf weights, exit 65) leaves the mount point as it was."""
    run = _run_dir(tmp_path / "run", nan=True)
    proc = _cli(str(run), str(mounted), "--overwrite")
    assert proc.returncode == EXIT_NONFINITE and "Traceback" not in proc.stderr, proc.stderr
    assert [p.name for p in mounted.iterdir()] == ["old.txt"] and (mounted / "old.txt").read_text() == "from before"
    assert _beside(mounted) == []


def test_leftovers_of_a_killed_in_place_consolidation_are_removed(mounted: Path, tmp_path: Path) -> None:
    """kill -9 leaves ``OUT/.consolidate-tmp-PID`` (and, mid-commit, the old files under ``.consolidate-old-PID``)."""
    run = _run_dir(tmp_path / "run")
    dead = subprocess.Popen(["true"])
    dead.wait()
    for prefix in (STAGING_PREFIX, OLD_PREFIX):
        (mounted / f"{prefix}{dead.pid}").mkdir()
        (mounted / f"{prefix}{dead.pid}" / "model.safetensors").write_bytes(b"x" * 100)
    live = mounted / f"{STAGING_PREFIX}{os.getpid()}"  # a live process's: kept
    live.mkdir()
    proc = _cli(str(run), str(mounted), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert f"removed {mounted / (STAGING_PREFIX + str(dead.pid))}" in proc.stderr, proc.stderr
    names = sorted(p.name for p in mounted.iterdir())
    assert names == sorted(["model.safetensors", "verification.json", live.name]), names


def test_read_only_mount_point_is_refused_before_any_work(tmp_path: Path) -> None:
    """A mount point this user cannot write: exit 2 at once, naming OUT and why; nothing written anywhere."""
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "output"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(out)], check=True)
    try:
        proc = _cli(str(run), str(out), "--overwrite")
        assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
        assert f"{out}: OUT is a mount point" in proc.stderr and "cannot write into it" in proc.stderr, proc.stderr
        assert list(out.iterdir()) == [] and _beside(out) == []
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def test_a_deepspeed_checkpoint_into_a_mount_point_under_a_read_only_parent(tmp_path: Path) -> None:
    """A container's read-only root with a writable ``/output``: nothing may be written beside OUT.

    The parent is a tmpfs remounted read-only after OUT is mounted on it, so a lock file or a
    staging directory beside OUT (the model's, or DeepSpeed's rebuilt tensors') fails with EROFS.
    """
    fixture = Path(__file__).parent / "fixtures" / "deepspeed_zero2" / "tiny_qwen2"
    root, out = tmp_path / "root", tmp_path / "root" / "output"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        out.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)], check=True)
        (out / "old.txt").write_text("from before")
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        proc = _cli(str(fixture / "checkpoints"), str(out), "--overwrite")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert json.loads((out / "verification.json").read_text())["layout"] == "deepspeed"
        want = load_file(str(fixture / "expected.safetensors"))
        got = load_file(str(out / "model.safetensors"))
        assert got and all(torch.equal(v, want[k]) for k, v in got.items())
        assert not (out / "old.txt").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]
        assert [p.name for p in root.iterdir()] == ["output"]
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)
        subprocess.run(["umount", "-l", str(root)], check=False)
