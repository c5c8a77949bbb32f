"""Check a planned run's Slurm chain against the cluster, on the login node, without submitting.

    python -m fsdp_workflow.check RUN_DIR

Reads ``RUN_DIR/config.yaml`` (what ``dry_run=true`` wrote), rebuilds the chain
from it and judges every job against the partitions, nodes, QoS and
associations the cluster reports (:mod:`fsdp_workflow.backends.slurm.cluster_check`,
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

from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.config.errors import ConfigError
from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.backends.slurm.cluster_check import check_chain
from fsdp_workflow.backends.slurm.cluster_info import ClusterUnreachable, read_cluster
from fsdp_workflow.plan.spec import build_plan


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.check", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory written by python -m fsdp_workflow (dry_run=true)")
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args.run_dir)
    except (FileNotFoundError, ValueError) as err:  # ConfigError and OmegaConf's errors are ValueErrors
        print(f"fsdp_workflow.check: {err}", file=sys.stderr)
        return EXIT_USAGE
    if not backend_for(cfg).queued:
        print(f"fsdp_workflow.check: {args.run_dir} was planned with cluster.kind="
              f"{cfg.cluster.kind.value}; only Slurm runs have cluster limits to check.", file=sys.stderr)
        return EXIT_USAGE
    try:
        limits = read_cluster()
    except ClusterUnreachable as err:
        print(f"fsdp_workflow.check: cannot read the cluster: {err}. Run this on a login node of the cluster "
              "(scontrol and sacctmgr on PATH).", file=sys.stderr)
        return 1
    plan = build_plan(cfg)
    report = check_chain(cfg, plan, limits)
    for warning in report.warnings:
        print(f"fsdp_workflow: warning: {warning.format()}", file=sys.stderr)
    if report.errors:
        print(f"fsdp_workflow: invalid config\n{ConfigError(report.errors)}", file=sys.stderr)
        return EXIT_USAGE
    jobs = ", ".join(j.role for j in plan.chain)
    note = f"; {limits.accounting_note}, QoS and associations not checked" if limits.accounting_note else ""
    print(f"cluster checks passed on {limits.cluster or 'the cluster'} for every job ({jobs}){note}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
