"""Check a planned run's Slurm chain against the cluster, on the login node, without submitting.

    python -m fsdp_workflow.check RUN_DIR

Reads ``RUN_DIR/config.yaml`` (what ``dry_run=true`` wrote), rebuilds the chain
from it and judges every job against the partitions, nodes, QoS and
associations the cluster reports (the run's backend: :meth:`~fsdp_workflow.backends.base.Backend.issues`,
:mod:`fsdp_workflow.backends.slurm.cluster_check`,
docs/slurm.md "What is checked before the queue"). Submitting runs the same
checks first; this is for a dry run, or a run directory planned where Slurm was
not reachable.

Exit codes: 0 the chain fits (warnings may be printed), 2 a job could never
start or RUN_DIR holds no usable config, 1 Slurm did not answer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from fsdp_workflow.backends.base import SchedulerUnreachable
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.config.errors import ConfigError
from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import run_layout
from fsdp_workflow.core.exit_codes import EXIT_USAGE


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.check", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory written by python -m fsdp_workflow (dry_run=true)")
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args.run_dir)
    except (FileNotFoundError, ValueError) as err:  # ConfigError and OmegaConf's errors are ValueErrors
        print(f"fsdp_workflow.check: {err}", file=sys.stderr)
        return EXIT_USAGE
    backend = backend_for(cfg)
    if not backend.queued:
        print(f"fsdp_workflow.check: {args.run_dir} was planned with cluster.kind="
              f"{cfg.cluster.kind.value}; only Slurm runs have cluster limits to check.", file=sys.stderr)
        return EXIT_USAGE
    try:  # the backend reads its scheduler's limits and judges the chain against them
        report = backend.issues(cfg, backend.plan(cfg, run_layout(cfg)))
    except SchedulerUnreachable as err:
        print(f"fsdp_workflow.check: cannot read the cluster: {err}", file=sys.stderr)
        return 1
    for warning in report.warnings:
        print(f"fsdp_workflow: warning: {warning.format()}", file=sys.stderr)
    if report.errors:
        print(f"fsdp_workflow: invalid config\n{ConfigError(report.errors)}", file=sys.stderr)
        return EXIT_USAGE
    for note in report.notes:  # what was checked, in the backend's words
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
