"""Run rules: model and data paths, optimizer numbers, checkpoints, consolidation, containers.

Paths are checked on this machine. A path may exist only on the cluster, so a
missing one is an error only for a real local run (``cluster=local``, not a
dry run); otherwise it is a warning.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import List, Optional

from fsdp_workflow.config.schema import (
    ClusterKind,
    DataFormat,
    DataSource,
    Device,
    ModelInit,
    WorkflowConfig,
)
from fsdp_workflow.config.path_keys import is_url
from fsdp_workflow.core.paths import output_overlap
from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, HF_MODEL_DIR, STEP_PREFIX, RunDir, parse_step
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
    if not path or _exists(path) or is_url(path):
        return  # a URL: refused by name with the data rules (fsdp_workflow/data/rules_path.py)
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
    if d.source != DataSource.synthetic and d.format == DataFormat.text and not d.text_field.strip():
        r.error("data.text_field", d.text_field, "data.format=text reads each record's text from this field, "
                "and an empty name matches none", "data.text_field=text (the field holding each document)")
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
    resume = (ck.resume or "").strip()
    if resume.lower() in ("auto", "none"):
        return
    fix = "checkpoint.resume=auto (the newest complete checkpoint), none, or a path to a checkpoints/step-N directory"
    if not resume:
        r.error("checkpoint.resume", ck.resume, "expected auto, none or a checkpoint directory", fix)
    elif _exists(resume):
        return  # a checkpoint on this machine; the trainer checks that it is complete
    elif not _looks_like_checkpoint_path(resume):
        # a word, not a path: `maybe`, `latest`, `true` would fail only once the job runs
        r.error("checkpoint.resume", ck.resume, "neither auto, none, nor a path to a checkpoint (a path holds a "
                f"/ or ends in {STEP_PREFIX}N)", fix)
    else:
        _check_path(cfg, r, "checkpoint.resume", ck.resume,
                    "the checkpoint to resume from (expected auto, none or a checkpoints/step-N directory)")


def _looks_like_checkpoint_path(value: str) -> bool:
    """A path (``/``, ``~``, ``.``) or a ``step-N`` name: what the trainer resumes from."""
    return "/" in value or value.startswith(("~", ".")) or parse_step(os.path.basename(value)) is not None


# What the installed transformers accepts as ``attn_implementation`` for training
# (``AttentionInterface``'s keys and eager), read without importing it (it imports torch);
# tests/config/test_three_values.py checks this list against the installed transformers.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                        "flash_attention_4")
# The package each flash implementation imports, looked up without importing it.
_FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface",
                   "flash_attention_4": "flash_attn"}


def check_attention(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """``model.attn_implementation`` is one transformers knows; flash kernels need a GPU and their package."""
    impl = cfg.model.attn_implementation
    if impl not in ATTN_IMPLEMENTATIONS:
        why = ("paged attention serves generation with a paged KV cache, not training" if impl.startswith("paged|")
               else "not an attention implementation transformers accepts (it would fail only once the job runs)")
        r.error("model.attn_implementation", impl, why, f"one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        return
    package = _FLASH_PACKAGES.get(impl)
    if package is None:
        return
    if cfg.cluster.device != Device.cuda:
        r.error("model.attn_implementation", impl, f"flash attention kernels run on CUDA GPUs only "
                f"(cluster.device={cfg.cluster.device.value})", "model.attn_implementation=sdpa")
    elif importlib.util.find_spec(package) is None:
        r.warn("model.attn_implementation", impl, f"needs the {package} package, which is not installed here "
               "(fine if the cluster's environment has it)", "pip install flash-attn on the nodes, or "
               "model.attn_implementation=sdpa")


def _check_output_dir(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The consolidated model must not land where the trainer or pruning writes."""
    out = cfg.consolidate.output_dir
    if out is None or not cfg.consolidate.enabled:
        return
    checkpoints = str(RunDir.of(str(cfg.run_dir)).checkpoints)
    overlap = output_overlap(out, checkpoints)  # the consolidation CLI applies the same rule to OUT
    path = os.path.expanduser(out)
    if overlap:
        why = overlap
    elif os.path.isdir(path) and not os.listdir(path):
        return  # an empty directory (a container's bind-mounted /output): the job writes into it in place
    elif os.path.exists(path):
        why = ("already exists and is not empty: the consolidation job would refuse a directory it did not write, "
               "after training; choose a new or empty directory")
    else:
        return
    r.error("consolidate.output_dir", out, why,
            f"consolidate.output_dir=null (RUN_DIR/{HF_MODEL_DIR}), or a new or empty directory outside "
            f"RUN_DIR/{CHECKPOINTS_DIR}")


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


RULES: List[Rule] = [
    check_model,
    check_data,
    check_optimizer,
    check_train_misc,
    check_checkpoint,
    check_attention,
    check_consolidate,
]
