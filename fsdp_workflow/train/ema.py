"""The exponential moving average of the weights: one more ``Stateful`` part, saved as ``ema``.

``train.ema_decay`` turns it on. With ``s`` the optimizer steps done so far
(``StepRng.step``), after each optimizer step::

    s <= train.ema_start_step                            ema = weights           (copied)
    s >  train.ema_start_step and s % ema_every_steps == 0  ema = decay * ema + (1 - decay) * weights
    otherwise                                            ema unchanged

so the EMA starts as the initial weights and tracks them exactly through the warmup.

Layout: one fp32 tensor per entry of the model part's state dict
(``get_model_state_dict``: the same FQNs, tied weights sharing one tensor), so the
checkpoint holds ``ema.model.layers.0.self_attn.q_proj.weight`` beside
``model.model.layers.0...`` and ``python -m fsdp_workflow.consolidate SRC OUT --subtree ema``
takes it. Under FSDP2 each EMA tensor is a DTensor with its parameter's mesh and
placements (each rank averages its own shards: no collective, resharded by DCP on
resume); under DDP every rank holds a full copy. DeepSpeed (its engine partitions and
casts the parameters) and FSDP1 (FlatParameter views) are refused at validation
(``config/rules_strategy.py``) and here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from fsdp_workflow.config.schema import StrategyName, TrainConfig
from fsdp_workflow.config.strategies import STRATEGIES
from fsdp_workflow.train.mesh import StrategyError

EMA_STRATEGIES = tuple(name for name, spec in STRATEGIES.items() if spec.ema is None)  # fsdp2, ddp
# Name components wrappers insert; get_model_state_dict drops them (and DDP's leading "module").
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (asked each time: FSDP2's lazy init may re-point it), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_dict_name(name: str, ddp: bool) -> str:
    """``named_parameters()``'s name as ``get_model_state_dict`` spells it (wrapper components removed)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    if ddp and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


class EmaState(Stateful):
    """fp32 EMA of every floating tensor of the model's state dict, placed like it.

    Args:
        model: the wrapped model (FSDP2 or DDP), its tensors where training keeps them.
        decay: ``train.ema_decay``, in (0, 1).
        every_steps: ``train.ema_every_steps``.
        start_step: ``train.ema_start_step``.

    Raises:
        RuntimeError: the model's tensors and its state dict's names disagree (a wrapper this does not know).
    """

    def __init__(self, model: torch.nn.Module, decay: float, every_steps: int = 1, start_step: int = 0) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.nn.parallel import DistributedDataParallel

        self.decay, self.every_steps, self.start_step = float(decay), int(every_steps), int(start_step)
        ddp = isinstance(model, DistributedDataParallel)
        wanted = {k for k, v in get_model_state_dict(model).items() if torch.is_floating_point(v)}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        self._tensors: List[torch.Tensor] = []  # the model's own tensors, each once (tied weights share one)
        self._ema: List[torch.Tensor] = []  # the EMA of each, same placement, fp32
        self._by_name: Dict[str, torch.Tensor] = {}
        index: Dict[int, int] = {}
        with torch.no_grad():
            for raw, t in named:
                name = state_dict_name(raw, ddp)
                if name not in wanted:
                    continue  # a non-persistent buffer (rotary tables)
                if id(t) not in index:
                    index[id(t)] = len(self._tensors)
                    self._tensors.append(t)
                    self._ema.append(t.detach().to(dtype=torch.float32, copy=True))
                self._by_name[name] = self._ema[index[id(t)]]
        if set(self._by_name) != wanted:
            raise RuntimeError(f"EMA: the model's state dict names {sorted(wanted - set(self._by_name))} match no "
                               f"parameter or buffer of {type(model).__name__}; a wrapper renamed them")

    @classmethod
    def maybe(cls, cfg: TrainConfig, model: torch.nn.Module, strategy: StrategyName) -> Optional["EmaState"]:
        """The EMA ``cfg`` asks for (None when ``train.ema_decay`` is null).

        Raises:
            StrategyError: an EMA under a strategy it is not built for (validation refuses it first).
        """
        if cfg.ema_decay is None:
            return None
        if strategy not in EMA_STRATEGIES:
            first, *others = (name.value for name in EMA_STRATEGIES)
            raise StrategyError(f"train.ema_decay={cfg.ema_decay}: the EMA of the weights is not implemented for "
                                f"{strategy.value}; use strategy={first} (or {' or '.join(others)}), "
                                "or train.ema_decay=null")
        return cls(model, cfg.ema_decay, cfg.ema_every_steps, cfg.ema_start_step)

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        """Apply the rule of the module docstring for optimizer step ``step`` (1-based); no collective."""
        if step > self.start_step and step % self.every_steps:
            return
        ema = [_local(e) for e in self._ema]
        cur = [_local(t) for t in self._tensors]
        cur = [c if c.dtype == torch.float32 else c.float() for c in cur]
        if step <= self.start_step:
            torch._foreach_copy_(ema, cur)
        else:
            torch._foreach_lerp_(ema, cur, 1.0 - self.decay)

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._by_name)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # DCP loads into our own tensors in place; copy anything it handed back as new tensors.
        with torch.no_grad():
            for name, mine in self._by_name.items():
                if state_dict[name] is not mine:
                    mine.copy_(state_dict[name])

    def restart(self) -> None:
        """Set the EMA to the current weights (a checkpoint saved without an EMA was resumed)."""
        with torch.no_grad():
            torch._foreach_copy_([_local(e) for e in self._ema],
                                 [_local(t).float() for t in self._tensors])
