"""Optimizers the schema offers and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import importlib.util
import math
from typing import Iterable

import torch

from fsdp_workflow.config.schema import OptimizerConfig, OptimizerName, SchedulerName


class OptimizerError(RuntimeError):
    """The configured optimizer cannot be built here."""


def _param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), the usual convention."""
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """Build the optimizer named by ``optimizer.name``.

    Args:
        params: the (sharded) model parameters.
        cfg: the ``optimizer`` group.
        device_type: ``cuda`` or ``cpu``; AdamW is fused on CUDA unless ``optimizer.fused=false``.

    Raises:
        OptimizerError: an 8-bit optimizer whose package is not installed.
    """
    groups = _param_groups(params, cfg.weight_decay)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == OptimizerName.adamw:
        fused = cfg.fused if cfg.fused is not None else device_type == "cuda"
        kwargs = {"fused": True} if fused else {"foreach": True}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **kwargs)
    if cfg.name == OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=betas[0])
    if cfg.name == OptimizerName.adamw_torch_8bit:
        if importlib.util.find_spec("torchao") is None:
            raise OptimizerError(
                "optimizer.name=adamw_torch_8bit needs torchao (`pip install torchao`), which is not "
                "installed. Use optimizer=adamw, or install torchao."
            )
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name in (OptimizerName.adamw_8bit, OptimizerName.adamw_bnb_8bit):
        if importlib.util.find_spec("bitsandbytes") is None:
            raise OptimizerError(
                f"optimizer.name={cfg.name.value} needs bitsandbytes (`pip install bitsandbytes`, CUDA only), "
                "which is not installed. It does not work with FSDP2's DTensor parameters either: use "
                "optimizer=adamw_torch_8bit (torchao) or optimizer=adamw."
            )
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise OptimizerError(f"optimizer.name={cfg.name} is not supported")


def lr_lambda(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """Multiplier of ``optimizer.lr`` after ``step`` optimizer steps: linear warmup then cosine/linear/constant."""
    warmup = max(0, cfg.warmup_steps)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == SchedulerName.constant:
        return 1.0
    span = max(1, max_steps - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    floor = cfg.min_lr_ratio
    if cfg.scheduler == SchedulerName.linear:
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_lambda` (its state dict is plain numbers: safe to checkpoint)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, cfg, max_steps))
