"""Every command ``status`` prints for the user to paste runs as exactly its arguments.

The run directory is named ``x$(touch PWNED)y'"``. Each printed command (resume of a
local run, resume of a Slurm run, consolidate, a sweep point's status) is pasted into
``bash -c`` with ``python``, ``python3``, ``sbatch`` and ``bash`` shadowed by shims that
record their arguments and exit 0, while ``touch`` stays real: an unquoted ``$(...)``
would create PWNED. The shims' records prove each command got the path intact.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import List


from fsdp_workflow.launch.sweep import record_planned
from fsdp_workflow.report.status.__main__ import main

from .fixtures import config_yaml, write_heartbeat, write_run
from .test_liveness import _dcp_checkpoint, _dead_pid

EVIL = "x$(touch PWNED)y'\""
_SHIM = '#!/bin/sh\n{ printf "%s\\n" "$(basename "$0")"; for a in "$@"; do printf "%s\\n" "$a"; done; printf "\\036\\n"; } >> "$SHIM_LOG"\nexit 0\n'


def _paste(command: str, base: Path) -> List[List[str]]:
    """Run ``command`` as a user pasting it would (bash), with the shims first on PATH; each shim call's argv."""
    shims = base / "shims"
    if not shims.is_dir():
        shims.mkdir()
        for name in ("python", "python3", "sbatch", "bash"):
            (shims / name).write_text(_SHIM)
            (shims / name).chmod(0o755)
    log = base / "shim.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(["/bin/bash", "-c", command], cwd=base, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{shims}:/usr/bin:/bin", "SHIM_LOG": str(log), "HOME": str(base)})
    assert proc.returncode == 0, (command, proc.stderr)
    assert not list(base.rglob("PWNED")) and not Path("PWNED").exists(), f"pasting ran an injected command: {command}"
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("\x1e\n") if c.strip()]
    return calls


def _printed(run_root: Path, capsys, prefix: str) -> str:
    assert main([str(run_root)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(prefix))
    return line[len(prefix):]


def _stopped_run(root: Path, kind: str):
    run = write_run(root, steps=20, alive=False)
    run.config.write_text(config_yaml(run.root, "name=f", "train.max_steps=100", f"cluster.kind={kind}"))
    _dcp_checkpoint(run.step_dir(20))
    run.train_exit.write_text(json.dumps({"exit_code": 75, "reason": "interrupted (SIGINT)", "step": 20,
                                          "checkpoint": str(run.step_dir(20))}))
    write_heartbeat(run, 0, _dead_pid(), age_s=30.0)
    return run


def test_local_resume_and_consolidate_commands_paste_safely(tmp_path, capsys):
    run = _stopped_run(tmp_path / EVIL, "local")
    run.provenance.write_text(json.dumps({"command": ["/x/__main__.py", "+experiment=smoke", "optimizer.lr=1e-3"]}))
    resume = _printed(run.root, capsys, "resume with: ")
    (call,) = _paste(resume, tmp_path)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert call[:4] == ["python", "-m", "fsdp_workflow", "+experiment=smoke"]
    assert call[-1] == "checkpoint.resume=auto"
    assert OverridesParser.create().parse_override(call[-2]).value() == str(run.root)  # Hydra reads the same path
    consolidate = _printed(run.root, capsys, "consolidate the newest checkpoint with: ")
    (call,) = _paste(consolidate, tmp_path)
    assert call == ["python", "-m", "fsdp_workflow.consolidate", str(run.checkpoints), str(run.hf_model)]


def test_slurm_resume_command_pastes_safely(tmp_path, capsys):
    run = _stopped_run(tmp_path / EVIL, "slurm")
    run.script("submit.sh").write_text("#!/bin/bash\nexit 0\n")
    resume = _printed(run.root, capsys, "resume with: ")
    (call,) = _paste(resume, tmp_path)
    assert call == ["bash", str(run.script("submit.sh"))]


def test_a_sweeps_status_commands_paste_safely(tmp_path, capsys):
    sweep = tmp_path / EVIL
    sweep.mkdir()
    points = [([f"optimizer.lr={lr}"], str(sweep / f"{n} {EVIL}")) for n, lr in enumerate(("1e-3", "2e-3"))]
    record_planned(sweep, points)
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out.splitlines()
    commands = [l.strip() for l in out[out.index("each point's status:") + 1:]]
    assert len(commands) == 2
    for command, (_, run_dir) in zip(commands, points):
        (call,) = _paste(command, tmp_path)
        assert call == ["python", "-m", "fsdp_workflow.status", run_dir]


def test_the_check_itself_catches_an_unquoted_command(tmp_path):
    """The harness is honest: the same path pasted without quoting does create PWNED."""
    (tmp_path / "shims").mkdir()
    proc = subprocess.run(["/bin/bash", "-c", f"true {tmp_path}/x$(touch PWNED)y"], cwd=tmp_path, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and (tmp_path / "PWNED").exists()
    os.remove(tmp_path / "PWNED")
