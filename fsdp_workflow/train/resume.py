"""What a resume takes from the checkpoint, and what from the config.

The rule (docs/training.md, "Resuming"):

* from the checkpoint: the weights, the optimizer's moments and step counts, the
  data position and the step (hence the RNG: every step reseeds from
  ``(train.seed, step, rank)``), and the EMA;
* from the config: every hyperparameter of the optimizer's param groups
  (``optimizer.lr`` as ``initial_lr``, ``betas``, ``eps``, ``weight_decay``,
  fused/foreach) and the whole schedule (``optimizer.lr``, ``scheduler``,
  ``warmup_steps``, ``min_lr_ratio``, ``train.max_steps``), evaluated at the resumed
  step, so the first resumed step already runs at the new schedule's learning rate.

A saved ``LambdaLR`` holds ``base_lrs`` and ``_last_lr`` and an optimizer's state
dict holds its param groups' ``lr``/``initial_lr``/``betas``: loaded as they are,
they replay the old run's schedule (a lowered ``optimizer.lr`` ignored, a longer
``train.max_steps`` first stepping at the old schedule's final lr 0). So the
``optimizer`` part puts the config's values back after loading
(:func:`keep_hyperparameters`) and the ``scheduler`` part restores only the step
count (:class:`~.state.ScheduleState`).

A change that cannot apply on resume is refused before anything is loaded
(:class:`ResumeError`, exit 2, naming the key): another optimizer, whose state the
checkpoint does not hold (:func:`optimizer_problem`), or a model of another shape.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from fsdp_workflow.config.schema import OptimizerConfig, OptimizerName

# Param-group keys that are not hyperparameters.
_NOT_HYPER = ("params", "param_names")
# Group keys a scheduler adds (LambdaLR's initial_lr): not part of what identifies an optimizer.
_SCHEDULER_KEYS = ("initial_lr",)


class ResumeError(ValueError):
    """The config asks for something the checkpoint cannot give: refused before loading (exit 2)."""


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters (all but its parameters), as they are now."""
    return [{k: v for k, v in group.items() if k not in _NOT_HYPER} for group in optimizer.param_groups]


def keep_hyperparameters(optimizer: torch.optim.Optimizer, kept: Sequence[Mapping[str, Any]]) -> None:
    """Put ``kept`` (:func:`hyperparameters` before loading: the config's) back into the loaded param groups.

    The moments and step counts stay as loaded. A step count whose placement follows the
    group's flags (fused or capturable AdamW keeps it on the parameter's device in
    fp32, as ``Optimizer.load_state_dict`` places it) is placed again for the config's flags.
    """
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if on_device and isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(dtype=torch.float32, device=p.device)


def state_signature(state_keys: Iterable[str], group_keys: Iterable[str]) -> tuple[frozenset, frozenset]:
    """What identifies an optimizer's kind: the names of its per-parameter state and of its group keys."""
    return frozenset(state_keys), frozenset(k for k in group_keys if k not in _NOT_HYPER + _SCHEDULER_KEYS)


def saved_signature(saved: Iterable[str]) -> tuple[frozenset, frozenset]:
    """:func:`state_signature` of an optimizer part in a DCP checkpoint, from its flattened keys.

    Args:
        saved: the keys under ``optimizer.`` (``state.<fqn>.exp_avg``, ``param_groups.0.lr``, ...).
    """
    saved = list(saved)
    state = {k.rsplit(".", 1)[1] for k in saved if k.startswith("state.")}
    groups = {k.split(".")[2] for k in saved if k.startswith("param_groups.") and k.count(".") >= 2}
    return state_signature(state, groups)


def live_signature(state_dict: Mapping[str, Any]) -> tuple[frozenset, frozenset]:
    """:func:`state_signature` of ``get_optimizer_state_dict``'s output (state initialised)."""
    state = {k for per_param in state_dict.get("state", {}).values() for k in per_param}
    groups = {k for group in state_dict.get("param_groups", []) for k in group}
    return state_signature(state, groups)


def optimizer_problem(saved: tuple[frozenset, frozenset], wanted: tuple[frozenset, frozenset],
                      name: OptimizerName) -> Optional[str]:
    """Why the checkpoint's optimizer state cannot load into ``optimizer.name=name``, or None.

    Args:
        saved: :func:`saved_signature` of the checkpoint.
        wanted: :func:`live_signature` of the optimizer the config builds.
        name: ``optimizer.name``.
    """
    if saved == wanted:
        return None
    was = _name_of(saved)
    held = f"optimizer.name={was.value}'s" if was is not None else "another optimizer's"
    fix = (f"optimizer.name={was.value} (the optimizer it was trained with) to resume from it"
           if was is not None else "the optimizer it was trained with to resume from it")
    return (f"optimizer.name={name.value}: the checkpoint holds {held} state (per parameter: "
            f"{', '.join(sorted(saved[0])) or 'none'}), which {name.value} cannot load (it keeps "
            f"{', '.join(sorted(wanted[0])) or 'none'}); the optimizer state comes from the checkpoint on "
            f"resume. Fix: {fix}, or train with {name.value} from the start in a new run_dir")


def _name_of(signature: tuple[frozenset, frozenset]) -> Optional[OptimizerName]:
    """The optimizer of the schema whose state looks like ``signature`` (those installed), or None."""
    for name in OptimizerName:
        if name.is_bitsandbytes:  # CUDA only: never built here, and its import is noisy
            continue
        try:
            if _probe_signature(name) == signature:
                return name
        except Exception:  # noqa: BLE001 - a package not installed, or CUDA-only: not a candidate
            continue
    return None


def _probe_signature(name: OptimizerName) -> tuple[frozenset, frozenset]:
    """The signature of ``name`` built on two small CPU parameters (a matrix and a vector) after one step."""
    from fsdp_workflow.train.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    opt = build_optimizer(params, OptimizerConfig(name=name), "cpu")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = {k for per_param in opt.state.values() for k in per_param}
    return state_signature(state, {k for g in opt.param_groups for k in g})


def model_problem(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> Optional[str]:
    """Why the checkpoint's weights do not fit the model the config builds, or None.

    Args:
        saved: the checkpoint's model entries (name under ``model.`` -> DCP storage metadata with ``size``).
        wanted: ``get_model_state_dict`` of the model built now (global shapes).
    """
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k not in wanted]
    shapes = [(k, tuple(saved[k].size), tuple(v.shape)) for k, v in wanted.items()
              if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)]
    if not (missing or extra or shapes):
        return None
    found = ([f"{k} is {list(a)} in the checkpoint, {list(b)} here" for k, a, b in shapes[:3]]
             + [f"{k} is not in the checkpoint" for k in missing[:3]]
             + [f"the checkpoint's {k} has no place here" for k in extra[:3]])
    return ("model: the checkpoint's weights do not fit the model this config builds ("
            + "; ".join(found) + "); the weights come from the checkpoint on resume. Fix: the model keys it "
            "was trained with (model.name_or_path, model.hidden_size, model.num_hidden_layers, model.vocab_size, "
            "model.tie_word_embeddings, ...), or a new run_dir for a new model")
