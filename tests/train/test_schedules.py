"""The learning-rate schedules are Hugging Face's, step for step, and resume exactly."""

from __future__ import annotations

import io
import math
from typing import Callable

import pytest
import torch
import transformers

from fsdp_workflow.config.schema import OptimizerConfig, SchedulerName
from fsdp_workflow.train.optim import build_scheduler

LR = 3.0e-4
# (warmup_steps, max_steps): no warmup, one step, a short and a long run, warmup near the end
SHAPES = [(0, 1), (0, 10), (1, 2), (3, 10), (10, 100), (7, 8), (50, 1000)]


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=LR)


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, max_steps: int) -> list[float]:
    """The lr an optimizer step sees after 0..max_steps completed steps, as the loop drives it."""
    out = []
    for _ in range(max_steps + 1):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _ours(scheduler: SchedulerName, warmup: int, max_steps: int, floor: float) -> list[float]:
    cfg = OptimizerConfig(lr=LR, scheduler=scheduler, warmup_steps=warmup, min_lr_ratio=floor)
    return _lrs(build_scheduler(_optimizer(), cfg, max_steps), max_steps)


def _hf(make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler], max_steps: int) -> list[float]:
    return _lrs(make(_optimizer()), max_steps)


def _assert_same(ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0), f"step {step}: ours {a!r}, transformers {b!r}"


HF_NO_FLOOR = {
    SchedulerName.cosine: transformers.get_cosine_schedule_with_warmup,
    SchedulerName.linear: transformers.get_linear_schedule_with_warmup,
}


@pytest.mark.parametrize("name", list(HF_NO_FLOOR), ids=lambda n: n.value)
@pytest.mark.parametrize("warmup,max_steps", SHAPES)
def test_no_floor_is_hf(name: SchedulerName, warmup: int, max_steps: int) -> None:
    ref = _hf(lambda o: HF_NO_FLOOR[name](o, warmup, max_steps), max_steps)
    _assert_same(_ours(name, warmup, max_steps, 0.0), ref)


@pytest.mark.parametrize("floor", [0.1, 0.05, 0.5])
@pytest.mark.parametrize("warmup,max_steps", SHAPES)
def test_cosine_with_floor_is_hf_cosine_with_min_lr(warmup: int, max_steps: int, floor: float) -> None:
    ref = _hf(lambda o: transformers.get_cosine_with_min_lr_schedule_with_warmup(
        o, warmup, max_steps, min_lr_rate=floor), max_steps)
    ours = _ours(SchedulerName.cosine, warmup, max_steps, floor)
    _assert_same(ours, ref)
    assert math.isclose(ours[-1], floor * LR, rel_tol=1e-12)


@pytest.mark.parametrize("floor", [0.1, 0.05, 0.5])
@pytest.mark.parametrize("warmup,max_steps", SHAPES)
def test_linear_with_floor_is_hf_linear_lifted_onto_the_floor(warmup: int, max_steps: int, floor: float) -> None:
    # transformers has no linear-with-floor; ours is HF's warmup, then r + (1 - r) * HF's decay
    hf = _hf(lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, max_steps), max_steps)
    ref = [lr if step < warmup else (floor + (1.0 - floor) * lr / LR) * LR for step, lr in enumerate(hf)]
    ours = _ours(SchedulerName.linear, warmup, max_steps, floor)
    _assert_same(ours, ref)
    assert math.isclose(ours[-1], floor * LR, rel_tol=1e-12)


@pytest.mark.parametrize("floor", [0.0, 0.1])
@pytest.mark.parametrize("warmup,max_steps", SHAPES)
def test_constant_is_hf_constant(warmup: int, max_steps: int, floor: float) -> None:
    if warmup:
        ref = _hf(lambda o: transformers.get_constant_schedule_with_warmup(o, warmup), max_steps)
    else:
        ref = _hf(transformers.get_constant_schedule, max_steps)
    _assert_same(_ours(SchedulerName.constant, warmup, max_steps, floor), ref)


def test_warmup_follows_hf_convention() -> None:
    """Step 0 runs at lr 0 and the peak is reached at step == warmup_steps, as in HF."""
    lrs = _ours(SchedulerName.cosine, 4, 20, 0.0)
    assert lrs[:5] == [0.0, LR / 4, LR / 2, 3 * LR / 4, LR]


@pytest.mark.parametrize("scheduler", list(SchedulerName))
def test_state_dict_round_trips(scheduler: SchedulerName) -> None:
    """A new scheduler that loads a saved state (weights_only) continues with the same lrs."""
    cfg = OptimizerConfig(lr=LR, scheduler=scheduler, warmup_steps=3, min_lr_ratio=0.1)
    max_steps, cut = 20, 7
    full = _lrs(build_scheduler(_optimizer(), cfg, max_steps), max_steps)

    first = build_scheduler(_optimizer(), cfg, max_steps)
    for _ in range(cut):
        first.optimizer.step()
        first.step()
    buf = io.BytesIO()
    torch.save({"optimizer": first.optimizer.state_dict(), "scheduler": first.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["scheduler"]["lr_lambdas"] == [None]  # nothing but numbers: no pickled callables

    # as the loop resumes: build both afresh, load the optimizer, then the scheduler
    resumed = build_scheduler(_optimizer(), cfg, max_steps)
    resumed.optimizer.load_state_dict(state["optimizer"])
    resumed.load_state_dict(state["scheduler"])
    assert resumed.get_last_lr()[0] == full[cut]
    assert resumed.optimizer.param_groups[0]["lr"] == full[cut]
    rest = _lrs(resumed, max_steps - cut)
    assert rest == full[cut:]


def test_default_schedule_is_hf_cosine_without_floor() -> None:
    """The schema's defaults give transformers' default: cosine down to 0."""
    cfg = OptimizerConfig(lr=LR, warmup_steps=5)
    assert cfg.min_lr_ratio == 0.0
    ref = _hf(lambda o: transformers.get_cosine_schedule_with_warmup(o, 5, 50), 50)
    _assert_same(_lrs(build_scheduler(_optimizer(), cfg, 50), 50), ref)
