"""The registry of distribution strategies' trainer halves: ``TRAIN_STRATEGIES[name] -> TrainStrategy``.

Each module of this package is one strategy family and lists its
:class:`~.base.TrainStrategy` records in ``SPECS``; the registry gathers them. Its
planning half is :mod:`fsdp_workflow.config.strategies`, under the same name.
The loop asks the functions below, and never branches on the strategy's name.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from fsdp_workflow.config.schema import CheckpointConfig, StrategyName, WorkflowConfig
from fsdp_workflow.config.strategies import STRATEGIES, spec
from fsdp_workflow.train.checkpoint import CheckpointDir, Checkpointer
from fsdp_workflow.train.mesh import StrategyError, TrainMesh
from fsdp_workflow.train.parallel import ModelParts, Prepared
from fsdp_workflow.train.strategies.base import TrainStrategy

__all__ = ["TRAIN_STRATEGIES", "TrainStrategy", "check_strategy_available", "prepare", "make_checkpointer"]

_HELPERS = frozenset({"base"})  # modules of this package that hold no strategy


def _gather() -> Dict[StrategyName, TrainStrategy]:
    found: Dict[StrategyName, TrainStrategy] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name not in _HELPERS:
            for s in importlib.import_module(f"{__name__}.{info.name}").SPECS:
                assert s.name not in found, f"strategy {s.name.value} has two trainer halves"
                found[s.name] = s
    return {name: found[name] for name in StrategyName if name in found}  # StrategyName's order


TRAIN_STRATEGIES: Dict[StrategyName, TrainStrategy] = _gather()


def check_strategy_available(strategy: StrategyName, device_type: str) -> None:
    """Fail early, with the fix, when the configured strategy cannot run here.

    Args:
        strategy: ``cfg.strategy.name``.
        device_type: ``cpu`` or ``cuda``.

    Raises:
        StrategyError: e.g. DeepSpeed not installed, or FSDP1 without an accelerator.
    """
    TRAIN_STRATEGIES[strategy].check_available(strategy, device_type)


def prepare(
    accelerator: Any,
    cfg: WorkflowConfig,
    build_model: Callable[[bool], nn.Module],
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    install_forward: Callable[[nn.Module], None],
    mesh: Optional[TrainMesh] = None,
) -> Prepared:
    """Build, wrap and pair the model with its optimizer under ``cfg.strategy``.

    Args:
        accelerator: constructed from the environment (its device; the wrapping for Accelerate's paths).
        cfg: the run's typed config: strategy, wrapping options, ``train.float8``, micro-batch size.
        build_model: ``build_model(meta)`` returns the CPU (or meta) model.
        build_optimizer: makes the optimizer over the (wrapped) model's parameters.
        install_forward: installs the loss forward on the bare model.
        mesh: the run's device mesh (:meth:`..mesh.TrainMesh.of`); beyond plain FSDP2 our own path applies it.

    Returns:
        The prepared model and optimizer.

    Raises:
        StrategyError: a mesh beyond plain FSDP2 under a strategy that builds none, or no process group.
    """
    parts = ModelParts(accelerator, cfg, build_model, build_optimizer, install_forward, mesh)
    strategy = cfg.strategy.name
    if parts.own_mesh and not spec(strategy).builds_mesh:
        builders = " or ".join(f"strategy={n.value}" for n, s in STRATEGIES.items() if s.builds_mesh)
        raise StrategyError(f"the mesh {mesh.dims.describe()} is built for {builders} only, and this run "
                            f"has strategy={strategy.value}")
    return TRAIN_STRATEGIES[strategy].prepare(parts)


def make_checkpointer(directory: CheckpointDir, cfg: CheckpointConfig, prepared: Prepared,
                      timeout_s: float) -> Checkpointer:
    """The checkpointer ``prepared.strategy``'s trainer half names (DeepSpeed's engine, or DCP).

    Args:
        directory: ``RUN_DIR/checkpoints`` for this rank.
        cfg: the ``checkpoint`` group.
        prepared: the wrapped model and how it was wrapped.
        timeout_s: the collective timeout (``cluster.rdzv_timeout_s``) for a background-save group.

    Returns:
        A :class:`~..checkpoint.Checkpointer`. Every rank must call this (it may create a process group).
    """
    return TRAIN_STRATEGIES[prepared.strategy].checkpointer(directory, cfg, prepared, timeout_s)
