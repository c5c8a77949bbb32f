"""The environment Accelerate reads, built from a validated config.

``accelerate launch`` turns its flags into environment variables
(``accelerate/utils/launch.py``) and every rank rebuilds its plugins from them
(``FullyShardedDataParallelPlugin.__post_init__``, ``DeepSpeedPlugin.__post_init__``,
``AcceleratorState``). We launch with ``torchrun`` instead (it keeps FSDP even
with one process), so we write those same variables ourselves, in the formats
Accelerate's parsers accept:

* booleans as lowercase ``true``/``false``: ``str_to_bool`` takes them, and
  ``AcceleratorState`` compares ``FSDP_OFFLOAD_PARAMS`` and the ``*_USE_*``
  flags against the literal ``"true"``;
* enums by their upper-case names (``FSDP_STATE_DICT_TYPE`` is also compared
  literally against ``"FULL_STATE_DICT"``);
* lists comma-separated (``FSDP_TRANSFORMER_CLS_TO_WRAP``).

Only the variables the chosen strategy reads are written, so ``launch.env``
says exactly what takes effect. The file is sourced by the job scripts and
parsed back by Python with :func:`read_launch_env`; the planner renders it
(:func:`fsdp_workflow.plan.render.render_launch_env`: only the plan stage writes shell).

No torch or accelerate import here: planning must stay fast.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Dict

from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    AutoWrapPolicy,
    Device,
    OffloadDevice,
    StrategyName,
    WorkflowConfig,
    deepspeed_stage,
    mesh_shape,
)
from fsdp_workflow.core.envnames import is_env_name

FSDP_STRATEGIES = (StrategyName.fsdp1, StrategyName.fsdp2)
DEEPSPEED_STRATEGIES = (
    StrategyName.deepspeed_zero1,
    StrategyName.deepspeed_zero2,
    StrategyName.deepspeed_zero3,
)



def _flag(value: bool) -> str:
    return "true" if value else "false"


def is_fsdp(name: StrategyName) -> bool:
    """Whether the strategy is one of the FSDP versions."""
    return name in FSDP_STRATEGIES


def is_deepspeed(name: StrategyName) -> bool:
    """Whether the strategy is one of the DeepSpeed ZeRO stages."""
    return name in DEEPSPEED_STRATEGIES


def accelerate_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """Turn a validated config into the variables Accelerate reads.

    Args:
        cfg: a typed config that :func:`fsdp_workflow.config.validate.validate`
            accepted (the function trusts the cross-field rules checked there).

    Returns:
        An ordered ``name -> value`` mapping of strings, ready for
        :func:`fsdp_workflow.plan.render.render_launch_env` or ``os.environ.update``.
    """
    s = cfg.strategy
    env: Dict[str, str] = {
        "ACCELERATE_USE_CPU": _flag(cfg.cluster.device == Device.cpu),
        "ACCELERATE_MIXED_PRECISION": cfg.train.mixed_precision.value,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(cfg.train.grad_accum_steps),
        "ACCELERATE_USE_FSDP": _flag(is_fsdp(s.name)),
        "ACCELERATE_USE_DEEPSPEED": _flag(is_deepspeed(s.name)),
    }
    if is_fsdp(s.name):
        env.update(_fsdp_env(cfg))
        env.update(_mesh_env(cfg))
    elif is_deepspeed(s.name):
        env.update(_deepspeed_env(cfg))
    return env


def _fsdp_env(cfg: WorkflowConfig) -> Dict[str, str]:
    s = cfg.strategy
    version = 2 if s.name == StrategyName.fsdp2 else 1
    env: Dict[str, str] = {
        "FSDP_VERSION": str(version),
        "FSDP_AUTO_WRAP_POLICY": s.auto_wrap_policy.value,
    }
    if s.auto_wrap_policy == AutoWrapPolicy.TRANSFORMER_BASED_WRAP:
        # Accelerate splits on ",": several layer classes may be given that way.
        env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(
            c.strip() for c in cfg.model.decoder_layer_cls.split(",") if c.strip()
        )
    elif s.auto_wrap_policy == AutoWrapPolicy.SIZE_BASED_WRAP:
        env["FSDP_MIN_NUM_PARAMS"] = str(s.min_num_params or 0)
    # Not a knob: the trainer always writes sharded DCP checkpoints (get_state_dict +
    # dcp.save) and the consolidation step writes the full model; this only keeps
    # Accelerate's plugin from defaulting FSDP1 to FULL_STATE_DICT.
    env["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT"
    if version == 2:
        # FSDP2 expresses the sharding strategy as a bool; the FSDP1-only
        # knobs below are ignored or rejected by the FSDP2 plugin.
        env["FSDP_RESHARD_AFTER_FORWARD"] = _flag(s.reshard_after_forward)
    else:
        env["FSDP_SHARDING_STRATEGY"] = s.sharding_strategy.value
        env["FSDP_BACKWARD_PREFETCH"] = s.backward_prefetch.value
        env["FSDP_FORWARD_PREFETCH"] = _flag(s.forward_prefetch)
        env["FSDP_USE_ORIG_PARAMS"] = _flag(s.use_orig_params)
        env["FSDP_SYNC_MODULE_STATES"] = _flag(s.sync_module_states)
    env["FSDP_OFFLOAD_PARAMS"] = _flag(s.offload_params)
    # Accelerate's plugin knows only "every layer": the selective modes are applied by the trainer
    # itself, from the config (fsdp_workflow.train.activation_checkpointing), so Accelerate must not add its own.
    env["FSDP_ACTIVATION_CHECKPOINTING"] = _flag(s.activation_checkpointing == ActivationCheckpointing.full)
    # transformers reads this one too: non-zero ranks load on the meta device.
    env["FSDP_CPU_RAM_EFFICIENT_LOADING"] = _flag(s.cpu_ram_efficient_loading)
    return env


def _mesh_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """The device mesh in ``ParallelismConfig``'s variable names, when it has more than one dimension.

    For Accelerate only: the trainer builds its mesh from the typed config
    (``fsdp_workflow.train.mesh``, the same :func:`mesh_shape`). ``ACCELERATE_USE_PARALLELISM_CONFIG``
    is deliberately not set, so Accelerate does not build a ``ParallelismConfig`` of its
    own: it refuses one on CPU, and its FSDP2 + TP preparation (accelerate 1.15)
    imports ``ReplicateParallel``, which transformers 5 no longer has. The trainer
    applies TP and FSDP2 on this mesh itself, on CPU and GPU alike (docs/parallelism.md).
    Context parallelism is refused by validation, so no ``CP_SIZE`` is written.
    """
    s = cfg.strategy
    if s.name != StrategyName.fsdp2 or (s.dp_replicate_size == 1 and s.tensor_parallel_size == 1):
        return {}
    shape = mesh_shape(cfg)
    return {
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(shape["dp_replicate"]),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(shape["dp_shard"]),
        "PARALLELISM_CONFIG_TP_SIZE": str(shape["tp"]),
    }


def _deepspeed_env(cfg: WorkflowConfig) -> Dict[str, str]:
    s = cfg.strategy
    stage = s.zero_stage if s.zero_stage is not None else deepspeed_stage(s.name)
    env: Dict[str, str] = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": s.offload_optimizer_device.value,
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": s.offload_param_device.value,
    }
    if s.offload_optimizer_device == OffloadDevice.nvme:
        env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] = str(s.offload_nvme_path)
    if s.offload_param_device == OffloadDevice.nvme:
        env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] = str(s.offload_nvme_path)
    # Accelerate warns and resets the flag below stage 3; write what takes effect.
    env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = _flag(s.zero3_init_flag and stage == 3)
    # "0.0" is falsy after float(): DeepSpeed's config then carries no clipping.
    clip = cfg.optimizer.max_grad_norm
    env["ACCELERATE_GRADIENT_CLIPPING"] = repr(float(clip)) if clip else "0.0"
    return env


def read_launch_env(path: str | os.PathLike[str]) -> Dict[str, str]:
    """Parse ``launch.env`` (:func:`fsdp_workflow.plan.render.render_launch_env`) back into a dict.

    Uses the same POSIX quoting rules bash applies, so a value spanning lines
    (a quoted newline) comes back intact. ``export`` is optional.

    Raises:
        ValueError: a token is not ``NAME=value``.
    """
    text = Path(path).read_text(encoding="utf-8")
    env: Dict[str, str] = {}
    for token in shlex.split(text, comments=True, posix=True):
        if token == "export":
            continue
        key, sep, value = token.partition("=")
        if not sep or not is_env_name(key):
            raise ValueError(f"{path}: expected NAME=value, found {token!r}")
        env[key] = value
    return env
