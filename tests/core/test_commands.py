"""core.commands: the resume command the launcher and status print is pasted as exactly what was planned."""

from __future__ import annotations

import shlex

from hydra.core.override_parser.overrides_parser import OverridesParser

from fsdp_workflow.core.commands import hydra_value, local_resume_argv, shell


def test_hostile_run_dir_survives_the_shell_and_hydra():
    root = "/runs/x$(touch PWNED)y'\" b"
    line = shell(local_resume_argv(root, ["/x/fsdp_workflow/__main__.py", "+experiment=smoke", "run_dir=/old",
                                          "dry_run=true", "hydra.sweep.dir=/s", "optimizer.lr=1e-4"]))
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "fsdp_workflow"]
    assert argv[3:] == ["+experiment=smoke", "optimizer.lr=1e-4", f"run_dir={hydra_value(root)}",
                        "checkpoint.resume=auto"]
    parsed = OverridesParser.create().parse_overrides([a for a in argv[3:] if a.startswith("run_dir=")])
    assert parsed[0].value() == root


def test_plain_path_stays_bare_and_unknown_command_gives_the_bare_resume():
    assert hydra_value("/scratch/me/run-1") == "/scratch/me/run-1"
    assert local_resume_argv("/r", None) == ["python", "-m", "fsdp_workflow", "run_dir=/r", "checkpoint.resume=auto"]
