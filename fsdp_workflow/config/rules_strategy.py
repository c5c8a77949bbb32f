"""Strategy rules: the chosen strategy's own (its spec's), and the knobs strategies share or ignore.

A rule that concerns one strategy alone lives in its spec
(``fsdp_workflow/config/strategies/``); these are the ones that ask a spec a question
(does it read the FSDP knobs? which activation checkpointing modes does it apply?).
Most of them mirror checks Accelerate or torch make only once the model is
being wrapped on every rank, or things they silently ignore (an FSDP knob
under DeepSpeed). Catching them here saves a queue wait.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    AutoWrapPolicy,
    OffloadDevice,
    TrainConfig,
    WorkflowConfig,
)
from fsdp_workflow.config.strategies import STRATEGIES, is_deepspeed, is_fsdp, spec_of
from fsdp_workflow.config.strategies.base import changed as _changed


# Knobs only FSDP reads (Accelerate ignores them under DeepSpeed and DDP).
FSDP_ONLY = (
    "auto_wrap_policy", "min_num_params", "reshard_after_forward",
    "sharding_strategy", "backward_prefetch", "forward_prefetch", "cpu_ram_efficient_loading",
    "sync_module_states", "use_orig_params",
)
DEEPSPEED_ONLY = ("zero3_init_flag",)
_TRAIN_DEFAULTS = TrainConfig()


def check_strategy(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The chosen strategy's own rules (:attr:`~fsdp_workflow.config.strategies.StrategySpec.rules`)."""
    for rule in spec_of(cfg).rules:
        rule(cfg, r)


def check_fsdp_knobs(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Wrapping under FSDP (both versions; the version's own knobs are its spec's rules)."""
    s, m = cfg.strategy, cfg.model
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


def check_activation_checkpointing(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Activation checkpointing: asked once, under a strategy that applies the mode, with a layer count that fits."""
    s, m = cfg.strategy, cfg.model
    mode, every = s.activation_checkpointing, s.activation_checkpointing_every_n_layers
    every_changed = _changed(s, ("activation_checkpointing_every_n_layers",))
    if mode != ActivationCheckpointing.every_n_layers and every_changed:
        r.error(
            "strategy.activation_checkpointing_every_n_layers", every,
            f"only activation_checkpointing=every_n_layers reads it; activation_checkpointing is {mode.value}",
            "strategy.activation_checkpointing=every_n_layers, or drop strategy.activation_checkpointing_every_n_layers",
        )
    if mode == ActivationCheckpointing.none:
        return
    applies = spec_of(cfg).activation_checkpointing
    if not applies:
        r.error(
            "strategy.activation_checkpointing", mode,
            f"an FSDP-only knob: {s.name.value} does not apply it",
            "strategy.activation_checkpointing=none model.gradient_checkpointing=true",
        )
    elif mode not in applies:
        pass  # the strategy's own rule says why and what to use instead
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
                   if spec_of(cfg).zero_stage == 3 else "strategy.offload_params=false")
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


# Strategies whose parameters train.ema_decay can average shard by shard (train/ema.py): fsdp2, ddp.
EMA_STRATEGIES = tuple(name for name, spec in STRATEGIES.items() if spec.ema is None)


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
    why = spec_of(cfg).ema
    if why is not None:
        first, *others = (f"strategy={n.value}" for n in EMA_STRATEGIES)
        r.error("train.ema_decay", t.ema_decay, f"the EMA of the weights is {why}",
                f"{first} (or {' or '.join(others)}), or train.ema_decay=null")


RULES: List[Rule] = [
    check_strategy,
    check_fsdp_knobs,
    check_activation_checkpointing,
    check_foreign_knobs,
    check_ema,
]
