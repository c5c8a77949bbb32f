"""The trainer's state as a set of ``Stateful`` parts, as torchtitan's checkpointer keeps it.

A checkpoint is the mapping :func:`trainer_parts` returns, one part per key::

    "model"      ModelState       get_model_state_dict: FQNs, FSDP2 DTensor shards (reshardable)
    "optimizer"  OptimizerState   get_optimizer_state_dict: the same FQNs, sharded like the model
    "scheduler"  ScheduleState    the LambdaLR's state dict: only numbers (its multiplier is a plain function)
    "trainer"    FlatParts(StepRng, RankBatches)
                                  {"step", "seed", "samples_consumed", "data_seed"}: plain ints
    "ema"        EmaState         only with train.ema_decay: fp32 EMA of "model", same FQNs and shards (:mod:`.ema`)

DCP calls ``state_dict()`` on each part when it saves and ``load_state_dict()``
after it loaded in place, so the parts stay ignorant of files; DeepSpeed's
engine writes ``model`` and ``optimizer`` in its own format and the other parts
ride in its ``client_state`` (:mod:`.checkpointers`). These keys and contents
are the checkpoint format the consolidator and earlier runs depend on: a new
piece of state is a new part, never a change to an existing one.

What a resume takes from each part, and what from the config, is :mod:`.resume`'s
rule: the optimizer part keeps the config's hyperparameters, the scheduler part only
the step count. A part may refuse a checkpoint before anything loads
(``check_loadable(saved)``, given the checkpoint's entries under its key).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_workflow.config.schema import OptimizerName
from fsdp_workflow.core.rundir import EMA_KEY
from fsdp_workflow.train import resume
from fsdp_workflow.train.data import RankBatches


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``step`` on ``rank``: reseeding each step makes resume exact without saving RNG state."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


class ModelState(Stateful):
    """The model's weights by fully qualified name (``model.layers.0...``), sharded as trained.

    Args:
        model: the wrapped model (FSDP2, FSDP1 or DDP); wrappers do not show in the names.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)

    def check_loadable(self, saved: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose weights do not fit this model (names, global shapes).

        Raises:
            ResumeError: on key ``model``, naming the first differing weights.
        """
        problem = resume.model_problem(saved, self.state_dict())
        if problem is not None:
            raise resume.ResumeError(problem)


class OptimizerState(Stateful):
    """The optimizer's state and param groups keyed by parameter FQN (not by position).

    On load the moments and step counts come from the checkpoint and every param
    group's hyperparameters stay the config's (:func:`.resume.keep_hyperparameters`).

    Args:
        model: the wrapped model the optimizer steps.
        optimizer: the underlying ``torch.optim.Optimizer``.
        name: ``optimizer.name``, for the refusal of another optimizer's state.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 name: OptimizerName = OptimizerName.adamw) -> None:
        self.model = model
        self.optimizer = optimizer
        self.name = name

    def state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # Initialises empty state on a fresh optimizer, so DCP has tensors to load into.
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        # Read now, not at construction: the scheduler part may have set this step's lr already.
        config = resume.hyperparameters(self.optimizer)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        resume.keep_hyperparameters(self.optimizer, config)

    def check_loadable(self, saved: Mapping[str, Any]) -> None:
        """Refuse another optimizer's state (its per-parameter state or group keys differ).

        Raises:
            ResumeError: on key ``optimizer.name``, naming the checkpoint's optimizer when it is one of ours.
        """
        problem = resume.optimizer_problem(resume.saved_signature(saved),
                                           resume.live_signature(self.state_dict()), self.name)
        if problem is not None:
            raise resume.ResumeError(problem)


class ScheduleState(Stateful):
    """The learning-rate schedule: the config's, at the checkpoint's step.

    Saved as the ``LambdaLR``'s own state dict (the format of every checkpoint so
    far). Loaded, only ``last_epoch`` (the optimizer steps taken) is kept: the base
    learning rates, warmup, decay and ``train.max_steps`` are the config's, and every
    param group's lr is set to its value at that step at once, so the first resumed
    step runs at the new schedule, not at the old one's last lr.

    Args:
        scheduler: the ``LambdaLR`` built from the config (:func:`~.optim.build_scheduler`).
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch = int(state_dict["last_epoch"])
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs  # what get_last_lr() reports, as LambdaLR.step() would have set it


class StepRng(Stateful):
    """The optimizer step count and the seed: together, the whole RNG state.

    Every step reseeds from ``(seed, step, rank)`` (:func:`step_seed`), so nothing
    of torch's generators needs saving and a resume on any number of ranks
    continues exactly. The seed is saved as a record; a resume keeps the
    configured one (``train.seed``) and restores only the step.

    Args:
        seed: ``train.seed``.
        rank: this process's rank.
    """

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank
        self.step = 0

    def reseed(self) -> None:
        """Seed torch for the step about to run."""
        torch.manual_seed(step_seed(self.seed, self.step, self.rank))

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class FlatParts(Stateful):
    """Several parts saved side by side in one flat dict (their keys must not collide).

    The ``trainer`` key of the checkpoint has always been one flat dict of ints;
    this keeps that format while the step/RNG and the data position stay separate parts.

    Args:
        parts: the parts, e.g. ``StepRng`` and ``RankBatches``.
    """

    def __init__(self, *parts: Stateful) -> None:
        self.parts = parts

    def state_dict(self) -> Dict[str, Any]:
        merged: Dict[str, Any] = {}
        for part in self.parts:
            sd = part.state_dict()
            assert not merged.keys() & sd.keys(), f"colliding keys {sorted(merged.keys() & sd.keys())}"
            merged.update(sd)
        return merged

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict({k: state_dict[k] for k in part.state_dict()})


def trainer_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LambdaLR, rng: StepRng, batches: RankBatches,
                  ema: Optional[Stateful] = None,
                  optimizer_name: OptimizerName = OptimizerName.adamw) -> Mapping[str, Stateful]:
    """Everything a checkpoint holds, by its key in the checkpoint (see the module docstring).

    Args:
        model: the wrapped model.
        optimizer: the underlying ``torch.optim.Optimizer`` (``Prepared.torch_optimizer``).
        scheduler: the learning-rate schedule built from the config (:class:`ScheduleState` wraps it).
        rng: the step and seed.
        batches: this rank's data position.
        ema: the EMA of the weights (:class:`~.ema.EmaState`), or None.
        optimizer_name: ``optimizer.name`` (named when a checkpoint holds another optimizer's state).

    Returns:
        ``{"model", "optimizer", "scheduler", "trainer"}`` (and ``"ema"``) mapped to their parts.
    """
    parts: Dict[str, Stateful] = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer, optimizer_name),
        "scheduler": ScheduleState(scheduler),
        "trainer": FlatParts(rng, batches),
    }
    if ema is not None:
        parts[EMA_KEY] = ema
    return parts


def after_optimizer_step(parts: Mapping[str, Stateful], step: int) -> None:
    """Let every part that follows the weights (the EMA) see optimizer step ``step`` (1-based)."""
    for part in parts.values():
        hook = getattr(part, "after_optimizer_step", None)
        if hook is not None:
            hook(step)
