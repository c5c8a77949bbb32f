"""The one command: compose, validate, plan, then run locally or submit to Slurm.

    python -m fsdp_workflow                              # the smoke run, on this machine
    python -m fsdp_workflow +experiment=llama8b_fft cluster.partition=gpu
    python -m fsdp_workflow +experiment=smoke dry_run=true run_dir=/tmp/plan
    python -m fsdp_workflow --help | --cfg job | -m train.micro_batch_size=1,2

Exit codes: 0 success, 2 invalid config (nothing was written or submitted),
75 stopped on a signal after checkpointing, anything else a failure.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import hydra
from omegaconf import DictConfig

from fsdp_workflow.config import CONF_DIR, register_configs, register_resolvers
from fsdp_workflow.exit_codes import EXIT_USAGE

register_configs()
register_resolvers()

_task_started = False


def _fail_config(message: str) -> None:
    print(f"fsdp_workflow: invalid config\n{message}", file=sys.stderr)
    try:  # Hydra made the run dir before we ran; leave nothing behind
        from hydra.core.hydra_config import HydraConfig

        os.rmdir(HydraConfig.get().runtime.output_dir)
    except (OSError, ValueError):
        pass  # not empty (an existing run) or no Hydra runtime
    raise SystemExit(EXIT_USAGE)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_workflow.config.load import to_typed
    from fsdp_workflow.config.validate import ConfigError, validate

    try:
        cfg = to_typed(dcfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        _fail_config(f"  {key}: {err}" if key else f"  {err}")
    report = validate(cfg)
    for warning in report.warnings:
        print("fsdp_workflow: warning: " + warning.format(), file=sys.stderr)
    try:
        report.raise_if_errors()
    except ConfigError as err:
        _fail_config(str(err))
    rc = _plan_and_launch(cfg)
    if rc:  # success returns, so a multirun sweep goes on to its next job
        raise SystemExit(rc)


def _plan_and_launch(cfg) -> int:
    from fsdp_workflow.plan.estimate import memory_warning, summary_lines
    from fsdp_workflow.plan.run_dir import write_run_dir
    from fsdp_workflow.plan.spec import is_slurm

    try:
        plan = write_run_dir(cfg)
    except ValueError as err:  # an unrenderable value, named by the renderer
        _fail_config(f"  {err}")
    print("\n".join("  " + line for line in summary_lines(cfg)), file=sys.stderr)
    warning = memory_warning(cfg)
    if warning:
        print("fsdp_workflow: warning: " + warning, file=sys.stderr)
    if cfg.dry_run:
        print(f"dry run: wrote {plan.run_dir} (config.yaml, launch.env, train.sbatch, "
              f"train_node.sh, consolidate.sbatch, submit.sh); nothing submitted.")
        print(f"submit the same chain later with: bash {plan.run_dir / 'submit.sh'}")
        return 0
    if is_slurm(cfg):
        from fsdp_workflow.launch.slurm import submit

        return submit(cfg, plan)
    from fsdp_workflow.launch.local import run_local

    return run_local(plan, consolidate=cfg.consolidate.enabled)


def _with_run_dir_as_hydra_dir(argv: List[str]) -> List[str]:
    """``run_dir=X`` also becomes Hydra's own run dir, so no stray ``runs/...`` appears."""
    run_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
    if run_dirs and not any(a.startswith("hydra.run.dir=") for a in argv) and "-m" not in argv \
            and "--multirun" not in argv:
        argv = argv + [f"hydra.run.dir={run_dirs[-1]}"]
    return argv


def main(argv: Optional[List[str]] = None) -> None:
    from fsdp_workflow.config.load import normalize_overrides

    args = _with_run_dir_as_hydra_dir(normalize_overrides(list(sys.argv[1:] if argv is None else argv)))
    sys.argv = [sys.argv[0]] + args
    try:
        _hydra_main()
    except SystemExit as exc:
        # Hydra reports composition errors (unknown key, wrong type) itself and exits 1
        # before our task runs; those are config errors too.
        if exc.code == 1 and not _task_started:
            raise SystemExit(EXIT_USAGE) from None
        raise


if __name__ == "__main__":
    main()
