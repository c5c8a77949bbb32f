"""An override Hydra's grammar cannot read is named with the quoting that reads it (issue 49, item 7).

    python -m pytest tests/cli/test_hydra_quoting.py

A run directory with a non-ASCII name (``run_dir=/runs/é``), or brackets in a path,
stopped Hydra's lexer: ``LexerNoViableAltException`` and a link to the grammar, no
hint. The message now names the character and gives the override quoted for Hydra and
for the shell; pasted into bash, that plans the run where it was meant to go.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.core.exit_codes import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "dry_run=true", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("name,said", [("résumé run", "'é' is not one of them"), ("日本", "'日' is not one of them"),
                                       ("run(1)", "its grammar stops at '('"),
                                       ("a$b'c", "\"'c\" is not one of them")])
def test_a_value_hydra_cannot_read_is_named_with_the_quoting_that_reads_it(tmp_path: Path, name: str,
                                                                            said: str) -> None:
    run = tmp_path / name
    res = cli(f"run_dir={run}")
    assert res.returncode == EXIT_USAGE, res.stdout + res.stderr
    assert said in res.stderr, res.stderr
    assert "LexerNoViableAltException" not in res.stderr and not run.exists()
    (fix,) = [ln.split("those quotes for the shell: ", 1)[1] for ln in res.stderr.splitlines() if "fix: quote" in ln]
    (override,) = shlex.split(fix)  # what bash passes when the fix is pasted: one argument
    ok = cli(override)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (run / "config.yaml").is_file(), list(tmp_path.iterdir())


def test_the_plain_form_is_shown_where_the_shell_allows_it(tmp_path: Path) -> None:
    res = cli(f"run_dir={tmp_path}/é")
    assert f"fix: quote the value for Hydra, and those quotes for the shell: \"run_dir='{tmp_path}/é'\"" in res.stderr
