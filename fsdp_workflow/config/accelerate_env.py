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

from fsdp_workflow.config.schema import Device, WorkflowConfig
from fsdp_workflow.config.strategies import spec_of
from fsdp_workflow.config.strategies.fsdp_env import flag as _flag
from fsdp_workflow.core.envnames import is_env_name

__all__ = ["accelerate_env", "read_launch_env"]


def accelerate_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """Turn a validated config into the variables Accelerate reads.

    The five common variables come first, then the strategy's own
    (:attr:`fsdp_workflow.config.strategies.StrategySpec.env`).

    Args:
        cfg: a typed config that :func:`fsdp_workflow.config.validate.validate`
            accepted (the function trusts the cross-field rules checked there).

    Returns:
        An ordered ``name -> value`` mapping of strings, ready for
        :func:`fsdp_workflow.plan.render.render_launch_env` or ``os.environ.update``.
    """
    spec = spec_of(cfg)
    env: Dict[str, str] = {
        "ACCELERATE_USE_CPU": _flag(cfg.cluster.device == Device.cpu),
        "ACCELERATE_MIXED_PRECISION": cfg.train.mixed_precision.value,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(cfg.train.grad_accum_steps),
        "ACCELERATE_USE_FSDP": _flag(spec.accelerate_fsdp),
        "ACCELERATE_USE_DEEPSPEED": _flag(spec.accelerate_deepspeed),
    }
    env.update(spec.env(cfg))
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
