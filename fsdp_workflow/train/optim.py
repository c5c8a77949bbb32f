"""Optimizers the schema offers and the warmup + decay learning-rate schedule (Hugging Face's)."""

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
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
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
    if cfg.name.is_8bit and not cfg.name.is_bitsandbytes:  # torchao's AdamW8bit
        if importlib.util.find_spec("torchao") is None:
            raise OptimizerError(
                f"optimizer.name={cfg.name.value} needs torchao (`pip install torchao`), which is not "
                "installed. Use optimizer=adamw, or install torchao."
            )
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name.is_bitsandbytes:
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
    """Multiplier of ``optimizer.lr`` for the optimizer step after ``step`` completed steps.

    The same numbers as Hugging Face's schedulers (``transformers.optimization``), so a
    recipe moved from the ``Trainer`` keeps its learning rate step for step:

    * warmup: ``step / warmup_steps`` while ``step < warmup_steps``, so the first step
      runs at lr 0 and ``lr`` is reached at ``step == warmup_steps`` (HF's convention);
    * ``cosine``: ``get_cosine_schedule_with_warmup``, or with ``min_lr_ratio > 0``
      ``get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=min_lr_ratio)``;
    * ``linear``: ``get_linear_schedule_with_warmup``; with ``min_lr_ratio > 0`` the same
      decay lifted onto the floor, ``r + (1 - r) * f``, reaching ``r * lr`` at
      ``max_steps`` (transformers has no linear schedule with a floor; this is the one
      its cosine uses);
    * ``constant``: ``get_constant_schedule_with_warmup`` (``get_constant_schedule``
      without warmup); ``min_lr_ratio`` does not apply.

    Args:
        step: optimizer steps taken so far (``LambdaLR``'s ``last_epoch``).
        cfg: the ``optimizer`` group.
        max_steps: ``train.max_steps``, where the decay ends.

    Returns:
        The factor ``LambdaLR`` multiplies ``optimizer.lr`` by.
    """
    # Written out rather than delegated to transformers so that the trainer's schedule
    # does not move with a transformers upgrade; the float operations are HF's, in
    # HF's order, so the values are bit-identical (tests/train/test_schedules.py).
    warmup = max(0, cfg.warmup_steps)
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if cfg.scheduler == SchedulerName.constant:
        return 1.0
    floor = cfg.min_lr_ratio
    span = float(max(1, max_steps - warmup))
    if cfg.scheduler == SchedulerName.linear:
        factor = max(0.0, float(max_steps - step) / span)
    else:
        progress = float(step - warmup) / span
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, factor * (1.0 - floor) + floor)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_lambda`.

    The multiplier is a plain function, so ``state_dict()`` holds only numbers
    (``last_epoch``, ``base_lrs``, ``_last_lr``, ...) and ``lr_lambdas == [None]``: it
    loads with ``torch.load(weights_only=True)`` and a resumed run continues exactly.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, cfg, max_steps))
