"""``fsdp_workflow.submit`` called as a hurried user calls it (issue 36, item 9), in a real interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CALL = """
import sys
import fsdp_workflow
try:
    fsdp_workflow.submit(sys.argv[1])
except fsdp_workflow.SubmitError as err:
    print(err, file=sys.stderr)
    sys.exit(err.exit_code)
"""


def test_a_string_of_overrides_is_refused_with_the_list_to_pass(tmp_path: Path) -> None:
    run = tmp_path / "run"
    text = f"+experiment=smoke cluster=slurm cluster.partition=debug run_dir={run}"
    proc = subprocess.run([sys.executable, "-c", CALL, text], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "takes a list of overrides, one per word, not one string" in proc.stderr, proc.stderr
    wanted = ["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}"]
    assert f"fix: fsdp_workflow.submit({wanted!r})" in proc.stderr, proc.stderr
    assert "run_dir = null" not in proc.stderr and not run.exists() and list(tmp_path.iterdir()) == []
