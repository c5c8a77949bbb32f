"""Validate a hand-edited run directory's config.yaml and record it as the config that was planned.

    python -m fsdp_workflow.replan RUN_DIR
    bash RUN_DIR/submit.sh          # then submit, as before

Every job checks ``config.yaml`` against the sha256 planning recorded
(:mod:`fsdp_workflow.core.config_hash`) and stops when the file was edited since.
To run an edited file on purpose, this command loads it through the schema (an
unknown key such as ``train.max_stepz`` is refused), runs every rule the planner
runs, then plans the run directory again from it: scripts, code snapshot and
``provenance.json`` with the new hash, plus ``replanned_from`` (the hash it
replaced) so the record says the config changed after the first planning. It
refuses while a chain of the directory is still queued or running.

Exit codes: 0 recorded (nothing submitted), 2 the edited config is invalid, RUN_DIR
is not a run directory, or a chain of it is live.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

from fsdp_workflow.config.errors import ConfigError
from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.core.config_hash import PROVENANCE_KEY, file_sha256
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.rundir import SUBMIT_SCRIPT, RunDir, atomic_write_json
from fsdp_workflow.backends.registry import backend_for, live_problem
from fsdp_workflow.plan.checks import check
from fsdp_workflow.plan.run_dir import write_run_dir


def _fail(message: str) -> int:
    print(f"fsdp_workflow.replan: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.replan", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory whose config.yaml was edited")
    args = p.parse_args(argv)
    layout = RunDir.recorded(args.run_dir)
    try:
        old = json.loads(layout.provenance.read_text())
    except (OSError, ValueError):
        old = {}
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = load_run_config(layout.root)
    except FileNotFoundError as err:  # its message names the path and what to pass instead
        return _fail(f"{err} Nothing changed.")
    except (ValueError, OmegaConfBaseException) as err:  # an unknown key, a bad value
        return _fail(f"{layout.config}: {' '.join(str(err).split())}; nothing changed")
    if layout.root.resolve() != Path(cfg.run_dir).expanduser().resolve():
        return _fail(f"{layout.config} says run_dir={cfg.run_dir}, not {layout.root}: edit run_dir back, or plan "
                     "the other directory with python -m fsdp_workflow; nothing changed")
    try:
        check(cfg).raise_if_errors()
    except ConfigError as err:
        return _fail(f"invalid config in {layout.config}\n{err}\nnothing changed: fix the file and run this again")
    problem = live_problem(layout.root)
    if problem:
        return _fail(problem)
    try:
        plan = write_run_dir(cfg, backend_for(cfg))
    except (ConfigError, ValueError) as err:
        return _fail(f"{err}")
    prov = json.loads(layout.provenance.read_text())
    # the planning command stays the record of how the run was made; this one is recorded beside it
    prov["replanned_from"] = {PROVENANCE_KEY: old.get(PROVENANCE_KEY), "command": prov.get("command"),
                              "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if old.get("command"):
        prov["command"] = old["command"]
    atomic_write_json(layout.provenance, prov)
    assert file_sha256(layout.config) == plan.config_sha256, "write_run_dir wrote the config it hashed"
    print(f"recorded {layout.config} (sha256 {plan.config_sha256[:12]}) as the config of {layout.root}; "
          f"submit it with: {shlex.join(['bash', str(layout.script(SUBMIT_SCRIPT))])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
