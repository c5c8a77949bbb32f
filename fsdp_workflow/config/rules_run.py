"""Run rules: model and data paths, optimizer numbers, checkpoints, consolidation, containers.

Paths are checked on this machine. A path may exist only on the cluster, so a
missing one is an error only for a real local run (``cluster=local``, not a
dry run); otherwise it is a warning.
"""

from __future__ import annotations

import glob
import os
from typing import List, Optional

from fsdp_workflow.config.schema import (
    ClusterKind,
    ContainerRuntime,
    DataSource,
    ModelInit,
    WorkflowConfig,
)
from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, HF_MODEL_DIR, RunDir
from fsdp_workflow.core.sizes import parse_size
from fsdp_workflow.config.errors import Rule, ValidationReport

_GLOB_CHARS = set("*?[")


def _exists(path: str) -> bool:
    path = os.path.expanduser(path)
    if _GLOB_CHARS & set(path):
        return bool(glob.glob(path))
    return os.path.exists(path)


def _check_path(cfg: WorkflowConfig, r: ValidationReport, key: str, path: Optional[str], what: str) -> None:
    """Missing path: error for a real local run, warning otherwise (it may exist on the cluster)."""
    if not path or _exists(path):
        return
    hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    where = "on this machine" if hard else "here (fine if it exists on the cluster's shared filesystem)"
    (r.error if hard else r.warn)(
        key, path,
        f"{what} does not exist {where}",
        f"{key}=/absolute/path/that/exists",
    )


def check_model(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Pretrained weights need a local directory; no hub download at run time."""
    m = cfg.model
    if m.init == ModelInit.pretrained and not m.name_or_path:
        r.error(
            "model.name_or_path", m.name_or_path,
            "model.init=pretrained loads weights from a local model directory",
            "model.name_or_path=/path/to/hf_model_dir (or model.init=random)",
        )
    if m.init == ModelInit.pretrained:
        _check_path(cfg, r, "model.name_or_path", m.name_or_path,
                    "the model directory (hub ids are not downloaded at run time)")
    _check_path(cfg, r, "model.tokenizer", m.tokenizer, "the tokenizer directory")


def check_data(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """File sources need a path; eval split settings must make sense."""
    d = cfg.data
    if d.sources:
        return  # a mixture: fsdp_workflow.data.rules_mixture checks data.path and every source
    if d.source != DataSource.synthetic and not d.path:
        r.error(
            "data.path", d.path,
            f"data.source={d.source.value} reads local files",
            "data.path=/path/to/train.jsonl (a file, directory or glob), or data=synthetic",
        )
    if d.source == DataSource.synthetic and (d.path or d.eval_path):
        r.warn("data.path", d.path or d.eval_path, "synthetic data reads no files", "data.path=null")
    if d.source != DataSource.synthetic:
        _check_path(cfg, r, "data.path", d.path, "the training data")
        _check_path(cfg, r, "data.eval_path", d.eval_path, "the evaluation data")


def check_optimizer(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Warmup within the run, and betas."""
    o, t = cfg.optimizer, cfg.train
    # signs and ranges: rules_bounds (declared beside each field)
    if t.max_steps >= 1 and o.warmup_steps >= t.max_steps:
        r.error(
            "optimizer.warmup_steps", o.warmup_steps,
            f"warmup would last the whole run (train.max_steps={t.max_steps}): the schedule never decays",
            f"optimizer.warmup_steps={max(t.max_steps // 20, 0)} (about 5% of train.max_steps)",
        )
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        r.error("optimizer.betas", o.betas, "AdamW takes two betas, each in [0, 1)", "optimizer.betas=[0.9,0.95]")


def check_train_misc(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Run directory and the rendezvous port window."""
    c = cfg.cluster
    if not str(cfg.run_dir).strip():
        r.error("run_dir", cfg.run_dir, "every run needs a directory for its config, scripts and checkpoints",
                "run_dir=runs/NAME")
    if c.port_range < 1 or c.master_port_base < 1024 or c.master_port_base + c.port_range > 65536:
        r.error(
            "cluster.master_port_base", c.master_port_base,
            f"rendezvous ports base..base+port_range ({c.master_port_base}..{c.master_port_base + c.port_range}) "
            "must lie in 1024..65535",
            "cluster.master_port_base=20000 cluster.port_range=10000",
        )


def check_checkpoint(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Interval, pruning and resume target."""
    ck, t = cfg.checkpoint, cfg.train
    if t.max_steps >= 1 and ck.every_steps > t.max_steps:
        r.error(
            "checkpoint.every_steps", ck.every_steps,
            f"longer than the run (train.max_steps={t.max_steps}): no periodic checkpoint would ever be written",
            f"checkpoint.every_steps={t.max_steps} (or 0 for only the final one)",
        )
    if ck.resume not in ("auto", "none"):
        if not ck.resume.strip():
            r.error("checkpoint.resume", ck.resume, "expected auto, none or a checkpoint directory",
                    "checkpoint.resume=auto")
        else:
            _check_path(cfg, r, "checkpoint.resume", ck.resume,
                        "the checkpoint to resume from (expected auto, none or a checkpoints/step-N directory)")


def _inside(path: str, parent: str) -> bool:
    a, b = os.path.abspath(os.path.expanduser(path)), os.path.abspath(os.path.expanduser(parent))
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _check_output_dir(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The consolidated model must not land where the trainer or pruning writes."""
    out = cfg.consolidate.output_dir
    if out is None or not cfg.consolidate.enabled:
        return
    run_dir = str(cfg.run_dir)
    checkpoints = str(RunDir.of(run_dir).checkpoints)
    if not out.strip():
        why = "an empty path"
    elif _inside(out, checkpoints):
        why = f"inside the checkpoint directory {checkpoints}: pruning and resume read every entry there"
    elif _inside(run_dir, out):
        why = "the run directory itself (or a parent of it): the consolidator refuses an existing output directory"
    elif os.path.exists(os.path.expanduser(out)):
        why = "already exists: the consolidator never overwrites a model directory, so the job would fail after training"
    else:
        return
    r.error("consolidate.output_dir", out, why,
            f"consolidate.output_dir=null (RUN_DIR/{HF_MODEL_DIR}), or a new directory outside RUN_DIR/{CHECKPOINTS_DIR}")


def check_consolidate(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Consolidation needs a sharded checkpoint it can read, and a parseable shard size."""
    cs, ck = cfg.consolidate, cfg.checkpoint
    try:
        parse_size(cs.max_shard_size)
    except ValueError as err:
        r.error("consolidate.max_shard_size", cs.max_shard_size, str(err), "consolidate.max_shard_size=5GB")
    _check_output_dir(cfg, r)
    if not cs.enabled:
        return
    if ck.every_steps == 0 and not ck.save_final:
        r.error(
            "checkpoint.save_final", False,
            "consolidation is on but no checkpoint is ever written (every_steps=0 and no final save)",
            "checkpoint.save_final=true (or consolidate.enabled=false)",
        )
    elif not ck.save_final and ck.every_steps > 0 and cfg.train.max_steps % ck.every_steps:
        r.warn(
            "checkpoint.save_final", False,
            f"the last {cfg.train.max_steps % ck.every_steps} steps are never checkpointed, so not consolidated",
            "checkpoint.save_final=true",
        )
    if cs.remove_sharded and not cs.verify:
        r.error(
            "consolidate.remove_sharded", True,
            "would delete the only copy of the weights without verifying the consolidated model",
            "consolidate.verify=true (or consolidate.remove_sharded=false)",
        )
    if cs.every_checkpoint and cfg.cluster.kind != ClusterKind.slurm:
        r.warn(
            "consolidate.every_checkpoint", True,
            "per-checkpoint consolidation runs as Slurm jobs; a local run consolidates only the last checkpoint",
            "consolidate.every_checkpoint=false (or cluster=slurm)",
        )


def check_container(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """A runtime needs an image; pyxis exists only inside Slurm's srun."""
    k = cfg.container
    if k.runtime != ContainerRuntime.none and not k.image:
        example = (
            "/path/fsdp_workflow.sif"
            if k.runtime == ContainerRuntime.apptainer
            else "'nvcr.io#nvidia/pytorch:25.01-py3' (quoted: Hydra reads # as a comment)"
        )
        r.error("container.image", k.image, f"container.runtime={k.runtime.value} needs an image",
                f"container.image={example}")
    if k.runtime == ContainerRuntime.none and k.image:
        r.warn("container.image", k.image, "container.runtime=none ignores the image",
               "container=apptainer (or container.image=null)")
    if k.runtime == ContainerRuntime.pyxis and cfg.cluster.kind != ClusterKind.slurm:
        r.error("container.runtime", "pyxis", "pyxis is a Slurm srun plugin; a local run cannot use it",
                "container=apptainer (or cluster=slurm cluster.partition=NAME)")
    # image existence, binds and --nv: fsdp_workflow.container.checks


RULES: List[Rule] = [
    check_model,
    check_data,
    check_optimizer,
    check_train_misc,
    check_checkpoint,
    check_consolidate,
    check_container,
]
