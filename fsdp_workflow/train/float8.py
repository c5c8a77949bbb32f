"""``train.float8``: float8 matmuls in the large ``nn.Linear`` layers, through torchao.

torchao's ``convert_to_float8_training`` swaps chosen ``nn.Linear`` modules for
``Float8Linear``: the weight stays a high-precision parameter (same name, so the
checkpoint and the consolidated model do not change), and each matmul casts its
inputs to float8 with a dynamic per-tensor scale and runs ``torch._scaled_mm`` on
the GPU's FP8 tensor cores. Those exist from compute capability 8.9 (Ada: L4,
L40S; Hopper: H100, H200) on; torch has no float8 training matmul on CPU.

Which layers convert (:func:`keeps_high_precision`), as torchtitan filters them:

* ``lm_head`` stays in bf16: torchtitan leaves its ``output`` projection out by
  default, the logits being where float8's 3-bit mantissa hurts the loss most;
* both dimensions must be multiples of 16 (``_scaled_mm``'s requirement);
* small GEMMs stay in bf16: with ``N`` output and ``K`` input features, a layer
  with ``N <= 1024`` and ``K <= 4096`` spends more on the casts and scales than
  float8 saves (torchao's tensorwise tables on H100, which torchtitan's
  ``auto_filter_small_kn`` follows). In a Llama that is the K/V projections of
  grouped-query attention at hidden sizes up to 4096.

The trainer refuses the key (exit 2, :class:`~.mesh.StrategyError`) on CPU, on
GPUs below 8.9 and without torchao: validation says so first where it can see
the machine (``config/rules_float8.py``). torchao is never imported at module
load: the filter and the refusals work without it.
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional

import torch
from torch import nn

from fsdp_workflow.train.mesh import StrategyError

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on
EXCLUDED_NAMES = ("lm_head",)  # fqn components kept in high precision whatever their size
SMALL_N, SMALL_K = 1024, 4096  # N <= SMALL_N and K <= SMALL_K: slower in float8 than in bf16
INSTALL = "pip install 'fsdp_workflow[float8]'"


def keeps_high_precision(fqn: str, module: nn.Module) -> Optional[str]:
    """Why the module at ``fqn`` stays out of float8, or None when it converts.

    Args:
        fqn: the module's name in the model (``model.layers.0.mlp.up_proj``).
        module: the module.

    Returns:
        A short reason (for the log and the tests), or None for an ``nn.Linear`` that converts.
    """
    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    if any(part in EXCLUDED_NAMES for part in fqn.split(".")):
        return "the output projection (lm_head) stays in bf16"
    n, k = module.weight.shape
    if n % 16 or k % 16:
        return f"{k}x{n} is not a multiple of 16 in both dimensions"
    if n <= SMALL_N and k <= SMALL_K:
        return f"{k}x{n} is too small to gain from float8"
    return None


def converts(module: nn.Module, fqn: str) -> bool:
    """torchao's ``module_filter_fn``: True for the layers :func:`keeps_high_precision` lets through."""
    return keeps_high_precision(fqn, module) is None


def check_available(device: torch.device) -> None:
    """Refuse float8 where it cannot run, with the reason.

    Args:
        device: this rank's device.

    Raises:
        StrategyError: a CPU device, a GPU below compute capability 8.9, or torchao missing.
    """
    if device.type != "cuda":
        raise StrategyError("train.float8=true needs CUDA GPUs with FP8 tensor cores (compute capability >= 8.9: "
                            "L4, L40S, H100, H200); torch has no float8 training matmul on "
                            f"{device.type}. Set train.float8=false.")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise StrategyError(f"train.float8=true: {name} has compute capability {capability[0]}.{capability[1]}, "
                            "below the 8.9 that FP8 tensor cores need (L4, L40S, H100, H200). Set "
                            "train.float8=false on this GPU.")
    if importlib.util.find_spec("torchao") is None:
        raise StrategyError(f"train.float8=true needs torchao, which is not installed: {INSTALL} "
                            "(or set train.float8=false).")


def convert(model: nn.Module) -> List[str]:
    """Swap the layers :func:`converts` chooses for torchao's ``Float8Linear``, in place.

    Call it on the bare model, before tensor parallelism, activation checkpointing and
    FSDP2. It runs on any device (only the matmuls need FP8 hardware), so the
    conversion itself is tested on CPU.

    Args:
        model: the bare model.

    Returns:
        The names of the converted layers.

    Raises:
        StrategyError: torchao is not installed.
    """
    if importlib.util.find_spec("torchao") is None:
        raise StrategyError(f"train.float8=true needs torchao, which is not installed: {INSTALL}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = [fqn for fqn, m in model.named_modules() if converts(m, fqn)]
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=converts)
    return chosen
