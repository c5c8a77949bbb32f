"""The Accelerate variables both FSDP versions write (``FullyShardedDataParallelPlugin``'s names).

Formats as :mod:`fsdp_workflow.config.accelerate_env` says: lowercase booleans, enums
by their upper-case names, lists comma-separated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from fsdp_workflow.config.choices import ActivationCheckpointing, AutoWrapPolicy

if TYPE_CHECKING:  # the schema lists the specs: its types only
    from fsdp_workflow.config.schema import WorkflowConfig


def flag(value: bool) -> str:
    """A boolean as Accelerate's parsers compare it (``"true"``/``"false"``)."""
    return "true" if value else "false"


def fsdp_env(cfg: WorkflowConfig, version: int, own: Dict[str, str]) -> Dict[str, str]:
    """The FSDP plugin's variables, with ``own`` (what only this version reads) in its place in the order.

    Args:
        cfg: the validated config.
        version: ``FSDP_VERSION`` (1 or 2).
        own: the version's own variables, written after ``FSDP_STATE_DICT_TYPE``.
    """
    s = cfg.strategy
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
    env.update(own)
    env["FSDP_OFFLOAD_PARAMS"] = flag(s.offload_params)
    # Accelerate's plugin knows only "every layer": the selective modes are applied by the trainer
    # itself, from the config (fsdp_workflow.train.activation_checkpointing), so Accelerate must not add its own.
    env["FSDP_ACTIVATION_CHECKPOINTING"] = flag(s.activation_checkpointing == ActivationCheckpointing.full)
    # transformers reads this one too: non-zero ranks load on the meta device.
    env["FSDP_CPU_RAM_EFFICIENT_LOADING"] = flag(s.cpu_ram_efficient_loading)
    return env
