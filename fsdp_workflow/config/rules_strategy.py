"""Strategy rules: FSDP1/FSDP2, DeepSpeed, DDP, and what they allow together.

Most of these mirror checks Accelerate or torch make only once the model is
being wrapped on every rank, or things they silently ignore (an FSDP knob
under DeepSpeed). Catching them here saves a queue wait.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.accelerate_env import is_deepspeed, is_fsdp
from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    AutoWrapPolicy,
    Device,
    MixedPrecision,
    OffloadDevice,
    StrategyConfig,
    StrategyName,
    TrainConfig,
    WorkflowConfig,
    deepspeed_stage,
)
from fsdp_workflow.config.errors import Rule, ValidationReport


# Knobs only FSDP reads (Accelerate ignores them under DeepSpeed and DDP).
FSDP_ONLY = (
    "auto_wrap_policy", "min_num_params", "reshard_after_forward",
    "sharding_strategy", "backward_prefetch", "forward_prefetch", "cpu_ram_efficient_loading",
    "sync_module_states", "use_orig_params",
)
FSDP1_ONLY = ("sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states")
DEEPSPEED_ONLY = ("zero3_init_flag",)
_DEFAULTS = StrategyConfig(name=StrategyName.fsdp2)
_TRAIN_DEFAULTS = TrainConfig()


def _changed(s: StrategyConfig, names: tuple) -> List[str]:
    """Fields set away from the schema default (so the user asked for them)."""
    return [n for n in names if getattr(s, n) != getattr(_DEFAULTS, n)]


def check_fsdp_version(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """FSDP1 is deprecated; FSDP2 rejects what only FSDP1 had."""
    s, o = cfg.strategy, cfg.optimizer
    if s.name == StrategyName.fsdp1:
        r.warn(
            "strategy.name", s.name,
            "FSDP1 (FlatParameter) is deprecated in PyTorch and Accelerate; FSDP2 (fully_shard, "
            "DTensor) is maintained, composes with TP and saves DCP checkpoints directly",
            "strategy=fsdp2",
        )
    if s.name != StrategyName.fsdp2:
        return
    if o.name.is_bitsandbytes:
        r.error(
            "optimizer.name", o.name,
            "bitsandbytes 8-bit AdamW cannot step FSDP2's DTensor parameters",
            "optimizer=adamw_torch_8bit (torchao's 8-bit AdamW works with DTensors)",
        )
    for name in _changed(s, FSDP1_ONLY):
        if name == "forward_prefetch":
            continue  # an error below: Accelerate raises on it
        r.warn(
            f"strategy.{name}", getattr(s, name),
            "an FSDP1-only setting: FSDP2 ignores it",
            f"drop the override of strategy.{name}, or strategy=fsdp1",
        )
    if s.forward_prefetch:
        r.error(
            "strategy.forward_prefetch", True,
            "Accelerate raises: forward_prefetch is not implemented for FSDP2",
            "strategy.forward_prefetch=false",
        )
    if cfg.train.mixed_precision == MixedPrecision.fp16:
        r.warn(
            "train.mixed_precision", "fp16",
            "fp16 under FSDP2 needs a sharded grad scaler and overflows more easily; bf16 is the tested path",
            "train.mixed_precision=bf16",
        )


def check_fsdp_knobs(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Wrapping, offload, RAM-efficient loading and 4-bit weights under FSDP."""
    s, m, o = cfg.strategy, cfg.model, cfg.optimizer
    if not is_fsdp(s.name):
        return
    if s.auto_wrap_policy == AutoWrapPolicy.SIZE_BASED_WRAP and not (s.min_num_params and s.min_num_params > 0):
        r.error(
            "strategy.min_num_params", s.min_num_params,
            "SIZE_BASED_WRAP wraps modules above this many parameters; unset (0) wraps every leaf",
            "strategy.min_num_params=100000000",
        )
    if s.auto_wrap_policy != AutoWrapPolicy.SIZE_BASED_WRAP and s.min_num_params is not None:
        r.warn(
            "strategy.min_num_params", s.min_num_params,
            f"only SIZE_BASED_WRAP reads it; auto_wrap_policy is {s.auto_wrap_policy.value}",
            "strategy.auto_wrap_policy=SIZE_BASED_WRAP, or strategy.min_num_params=null",
        )
    if s.auto_wrap_policy == AutoWrapPolicy.TRANSFORMER_BASED_WRAP and not m.decoder_layer_cls.strip():
        r.error(
            "model.decoder_layer_cls", m.decoder_layer_cls,
            "TRANSFORMER_BASED_WRAP needs the decoder layer class to wrap",
            "model.decoder_layer_cls=LlamaDecoderLayer (the model's layer class)",
        )
    if s.auto_wrap_policy == AutoWrapPolicy.NO_WRAP:
        r.warn(
            "strategy.auto_wrap_policy", s.auto_wrap_policy,
            "the whole model becomes one FSDP unit: every forward gathers all parameters at once",
            "strategy.auto_wrap_policy=TRANSFORMER_BASED_WRAP",
        )
    if s.name == StrategyName.fsdp1 and s.sharding_strategy.value.startswith("HYBRID") and cfg.cluster.nodes == 1:
        r.warn(
            "strategy.sharding_strategy", s.sharding_strategy,
            "hybrid sharding shards within a node and replicates across nodes; on one node it is plain sharding",
            "strategy.sharding_strategy=FULL_SHARD",
        )
    if s.name == StrategyName.fsdp1 and s.offload_params and o.name.is_8bit:
        r.error(
            "strategy.offload_params", True,
            f"FSDP1 parameter offload runs the optimizer step on CPU tensors; the 8-bit optimizer "
            f"{o.name.value} needs its state on the GPU",
            "optimizer=adamw (or strategy.offload_params=false)",
        )
    if s.name == StrategyName.fsdp1 and s.cpu_ram_efficient_loading and not s.sync_module_states:
        r.error(
            "strategy.sync_module_states", False,
            "with cpu_ram_efficient_loading only rank 0 loads weights; FSDP1 must broadcast them to the others",
            "strategy.sync_module_states=true (or strategy.cpu_ram_efficient_loading=false)",
        )
    if s.name == StrategyName.fsdp1 and cfg.cluster.device == Device.cpu:
        # Whatever sync_module_states says: Accelerate enables FSDP1 only on accelerators, and the
        # trainer stops every rank at start ("needs CUDA"). Its sync flags are not a way out.
        r.error(
            "strategy.name", s.name,
            "FSDP1 needs CUDA: Accelerate only enables FSDP1 on accelerators (its sync_module_states raises "
            "'no available devices' on a CPU host), and this trainer shards on CPU with FSDP2 only",
            "strategy=fsdp2 for CPU runs (same checkpoint layout), strategy=ddp, or cluster.device=cuda",
        )


def check_activation_checkpointing(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Activation checkpointing: asked once, under a strategy that applies the mode, with a layer count that fits."""
    s, m = cfg.strategy, cfg.model
    mode, every = s.activation_checkpointing, s.activation_checkpointing_every_n_layers
    if mode != ActivationCheckpointing.every_n_layers and every != _DEFAULTS.activation_checkpointing_every_n_layers:
        r.error(
            "strategy.activation_checkpointing_every_n_layers", every,
            f"only activation_checkpointing=every_n_layers reads it; activation_checkpointing is {mode.value}",
            "strategy.activation_checkpointing=every_n_layers, or drop strategy.activation_checkpointing_every_n_layers",
        )
    if mode == ActivationCheckpointing.none:
        return
    if not is_fsdp(s.name):
        r.error(
            "strategy.activation_checkpointing", mode,
            f"an FSDP-only knob: {s.name.value} does not apply it",
            "strategy.activation_checkpointing=none model.gradient_checkpointing=true",
        )
    elif s.name == StrategyName.fsdp1 and mode != ActivationCheckpointing.full:
        r.error(
            "strategy.activation_checkpointing", mode,
            "the selective modes are built on the FSDP2 path only (FSDP1 goes through Accelerate's plugin, "
            "which checkpoints every layer or none)",
            "strategy=fsdp2, or strategy.activation_checkpointing=full",
        )
    elif m.gradient_checkpointing:
        r.error(
            "model.gradient_checkpointing", True,
            "activation checkpointing asked twice (HF gradient checkpointing and FSDP's): "
            "layers get wrapped twice and recompute twice",
            f"model.gradient_checkpointing=false (keep strategy.activation_checkpointing={mode.value})",
        )
    if mode == ActivationCheckpointing.every_n_layers and every > m.num_hidden_layers:
        r.error(
            "strategy.activation_checkpointing_every_n_layers", every,
            f"checkpoints every {every}th decoder layer, and {m.name} has only {m.num_hidden_layers}: "
            "no layer would be checkpointed",
            f"strategy.activation_checkpointing_every_n_layers={m.num_hidden_layers} or less"
            if m.num_hidden_layers >= 2 else "strategy.activation_checkpointing=full",
        )


def check_foreign_knobs(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """FSDP knobs under DeepSpeed/DDP and DeepSpeed knobs under FSDP/DDP."""
    s = cfg.strategy
    if not is_fsdp(s.name):
        if s.offload_params:
            fix = ("strategy.offload_params=false strategy.offload_param_device=cpu"
                   if s.name == StrategyName.deepspeed_zero3 else "strategy.offload_params=false")
            r.error("strategy.offload_params", True, f"an FSDP-only knob: {s.name.value} ignores it", fix)
        for name in _changed(s, FSDP_ONLY):
            r.warn(
                f"strategy.{name}", getattr(s, name),
                f"an FSDP-only setting: {s.name.value} ignores it",
                f"drop the override of strategy.{name}",
            )
    if not is_deepspeed(s.name):
        if s.zero_stage is not None:
            r.error(
                "strategy.zero_stage", s.zero_stage,
                f"a DeepSpeed setting, but strategy is {s.name.value}",
                f"strategy=deepspeed_zero{s.zero_stage} (or strategy.zero_stage=null)",
            )
        for name in ("offload_optimizer_device", "offload_param_device"):
            if getattr(s, name) != OffloadDevice.none:
                r.error(
                    f"strategy.{name}", getattr(s, name),
                    f"a DeepSpeed setting, but strategy is {s.name.value}",
                    "strategy.offload_params=true under FSDP" if is_fsdp(s.name) else f"strategy.{name}=none",
                )
        for name in _changed(s, DEEPSPEED_ONLY):
            r.warn(
                f"strategy.{name}", getattr(s, name),
                f"a DeepSpeed ZeRO-3 setting: {s.name.value} ignores it",
                f"drop the override of strategy.{name}",
            )


def check_deepspeed(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Stage named twice must agree; offload targets must exist at that stage."""
    s, o = cfg.strategy, cfg.optimizer
    if not is_deepspeed(s.name):
        return
    named = deepspeed_stage(s.name)
    stage = s.zero_stage if s.zero_stage is not None else named
    if s.zero_stage is not None and s.zero_stage != named:
        r.error(
            "strategy.zero_stage", s.zero_stage,
            f"strategy {s.name.value} means ZeRO stage {named}",
            f"strategy=deepspeed_zero{s.zero_stage} (or strategy.zero_stage={named})"
            if s.zero_stage in (1, 2, 3) else f"strategy.zero_stage={named}",
        )
    if s.offload_param_device != OffloadDevice.none and stage != 3:
        r.error(
            "strategy.offload_param_device", s.offload_param_device,
            f"DeepSpeed offloads parameters only under ZeRO-3 (stage here: {stage})",
            "strategy=deepspeed_zero3 (or strategy.offload_param_device=none)",
        )
    nvme = OffloadDevice.nvme in (s.offload_param_device, s.offload_optimizer_device)
    if nvme and not s.offload_nvme_path:
        r.error(
            "strategy.offload_nvme_path", s.offload_nvme_path,
            "NVMe offload needs a directory on a local NVMe drive",
            "strategy.offload_nvme_path=/local_nvme/ds_offload",
        )
    if o.name.is_8bit:
        r.warn(
            "optimizer.name", o.name,
            "DeepSpeed partitions optimizer state itself; a client 8-bit optimizer is untested with ZeRO",
            "optimizer=adamw",
        )


# Strategies whose parameters train.ema_decay can average shard by shard (train/ema.py).
EMA_STRATEGIES = (StrategyName.fsdp2, StrategyName.ddp)


def check_ema(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The EMA runs under FSDP2 and DDP only; its step knobs need a decay."""
    t, name = cfg.train, cfg.strategy.name
    if t.ema_decay is None:
        for key in ("ema_every_steps", "ema_start_step"):
            value = getattr(t, key)
            if value != getattr(_TRAIN_DEFAULTS, key):
                r.error(f"train.{key}", value, "has no effect without an EMA (train.ema_decay is null)",
                        f"train.ema_decay=0.999 to keep an EMA, or drop train.{key}")
        return
    if name not in EMA_STRATEGIES:
        why = ("not implemented for deepspeed: ZeRO partitions and casts the parameters inside its engine, "
               "so there is no shard to average" if is_deepspeed(name) else
               "not implemented for fsdp1: its FlatParameter shards do not have the checkpoint's layout")
        r.error("train.ema_decay", t.ema_decay, f"the EMA of the weights is {why}",
                "strategy=fsdp2 (or strategy=ddp), or train.ema_decay=null")


RULES: List[Rule] = [
    check_fsdp_version,
    check_fsdp_knobs,
    check_activation_checkpointing,
    check_foreign_knobs,
    check_deepspeed,
    check_ema,
]
