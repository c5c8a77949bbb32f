"""Every command the consolidator prints for a user to paste is shell-quoted (shlex.join).

The directories are named ``x$(touch PWNED)y'"``: pasting an unquoted command into bash
would create ``PWNED``. Each printed command is run with ``bash -c`` and must do what it
says (consolidate) without running anything else.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from . import layouts

EVIL = "x$(touch PWNED)y'\""


def _ckpt(root: Path, nan: bool = False) -> Path:
    w = torch.randn(16, 16)
    if nan:
        w[1, 2] = float("nan")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": {"w": w}}, root / "checkpoints" / "step-1")
    return root


def _printed_command(stderr: str, marker: str) -> str:
    assert marker in stderr, stderr
    return stderr.split(marker, 1)[1].strip().splitlines()[0]


def _paste(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300)


def _no_pwned(tmp_path: Path) -> None:
    assert not [p for p in tmp_path.rglob("PWNED")], "a pasted command ran $(touch PWNED)"


def test_overwrite_hint_is_quoted(tmp_path: Path) -> None:
    run = _ckpt(tmp_path / EVIL / "run")
    out = tmp_path / EVIL / "out"
    cmd = [sys.executable, "-m", "fsdp_workflow.consolidate", str(run), str(out), "--no-progress"]
    assert subprocess.run(cmd, capture_output=True, cwd=tmp_path).returncode == 0
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    pasted = _paste(_printed_command(proc.stderr, "to replace it: "), tmp_path)
    assert pasted.returncode == 0, pasted.stderr
    assert json.loads(pasted.stdout)["output"] == str(out)
    _no_pwned(tmp_path)


def test_allow_nonfinite_hint_is_quoted(tmp_path: Path) -> None:
    run = _ckpt(tmp_path / EVIL / "run", nan=True)
    out = tmp_path / EVIL / "out"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run), str(out), "--no-progress"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 65
    pasted = _paste(_printed_command(proc.stderr, "to write them anyway: "), tmp_path)
    assert pasted.returncode == 0, pasted.stderr
    assert json.loads((out / "verification.json").read_text())["nonfinite"]["tensors"] == {"w": {"nan": 1, "inf": 0}}
    _no_pwned(tmp_path)
