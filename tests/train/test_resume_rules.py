"""Resume rules (issue 36, item 1): the state comes from the checkpoint, the schedule from the config.

In process, through the real parts and ``DcpCheckpointer`` (DCP without a process
group): a checkpoint written under one config, loaded under another. The
learning rates expected are computed here from the formula of docs/training.md,
not with the trainer's ``lr_lambda``. The 2-rank runs that follow the tool's own
advice are in ``test_resume_advice.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_workflow.config.schema import OptimizerConfig, OptimizerName, SchedulerName
from fsdp_workflow.core import rundir
from fsdp_workflow.train.checkpoint import CheckpointDir
from fsdp_workflow.train.checkpointers import DcpCheckpointer
from fsdp_workflow.train.optim import build_optimizer, build_scheduler
from fsdp_workflow.train.resume import ResumeError
from fsdp_workflow.train.state import ModelState, OptimizerState, ScheduleState
from tests.train.runner import cosine_lr


class _Net(torch.nn.Module):
    """A matrix and a vector: the optimizer's two param groups (decay, no decay)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width, bias=False)
        self.norm = torch.nn.LayerNorm(width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _trainee(cfg: OptimizerConfig, max_steps: int, width: int = 4):
    torch.manual_seed(0)
    net = _Net(width)
    opt = build_optimizer(net.parameters(), cfg, "cpu")
    sched = build_scheduler(opt, cfg, max_steps)
    parts = {"model": ModelState(net), "optimizer": OptimizerState(net, opt, cfg.name), "scheduler": ScheduleState(sched)}
    return net, opt, sched, parts


def _train(net, opt, sched, steps: int) -> list[float]:
    lrs = []
    for i in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        net(torch.full((2, net.lin.in_features), float(i + 1))).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return lrs


def _checkpointer(root: Path) -> DcpCheckpointer:
    return DcpCheckpointer(CheckpointDir(rundir.RunDir.of(root), keep_last=0, rank=0))


OLD = OptimizerConfig(lr=1e-2, warmup_steps=2, betas=[0.9, 0.95], weight_decay=0.0)


@pytest.fixture
def step6(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint at step 6 of a run planned for 6 steps at lr 1e-2 (its schedule has ended: lr 0)."""
    net, opt, sched, parts = _trainee(OLD, 6)
    _train(net, opt, sched, 6)
    assert opt.param_groups[0]["lr"] == 0.0  # the old schedule's end
    _checkpointer(tmp_path / "old").save(6, parts, blocking=True)
    moments = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in net.named_parameters()}
    return tmp_path / "old" / "checkpoints" / "step-6", {"weights": {k: v.clone() for k, v in net.state_dict().items()},
                                                         "moments": moments}


def test_a_resume_takes_the_new_schedule_and_hyperparameters_and_keeps_the_state(step6, tmp_path: Path) -> None:
    """lr 1e-2 -> 1e-4, max_steps 6 -> 10, warmup, betas and weight decay changed: the first resumed
    step runs at the new schedule's lr at step 6, the groups hold the new values, and weights,
    moments and step counts are the checkpoint's."""
    path, saved = step6
    new = OptimizerConfig(lr=1e-4, warmup_steps=3, betas=[0.8, 0.9], weight_decay=0.05, eps=1e-6)
    net, opt, sched, parts = _trainee(new, 10)
    _checkpointer(tmp_path / "new").load(path, parts)

    assert opt.param_groups[0]["lr"] == pytest.approx(cosine_lr(1e-4, 3, 10, 6), rel=1e-12)
    assert sched.get_last_lr() == [pytest.approx(cosine_lr(1e-4, 3, 10, 6), rel=1e-12)] * 2
    decay, no_decay = opt.param_groups
    assert (decay["initial_lr"], decay["betas"], decay["weight_decay"], decay["eps"]) == (1e-4, (0.8, 0.9), 0.05, 1e-6)
    assert (no_decay["initial_lr"], no_decay["betas"], no_decay["weight_decay"]) == (1e-4, (0.8, 0.9), 0.0)
    assert sched.base_lrs == [1e-4, 1e-4] and sched.last_epoch == 6
    for k, v in saved["weights"].items():
        assert torch.equal(net.state_dict()[k], v), k
    for n, p in net.named_parameters():
        for k, v in saved["moments"][n].items():
            assert torch.equal(opt.state[p][k], v), (n, k)
    assert float(opt.state[net.lin.weight]["step"]) == 6.0

    # Steps 7-10 at the new schedule, the last just above 0.
    rest = _train(net, opt, sched, 4)
    assert rest == pytest.approx([cosine_lr(1e-4, 3, 10, s) for s in range(6, 10)], rel=1e-12)
    assert rest[0] > 0


def test_the_same_config_resumes_the_same_sequence_bit_for_bit(tmp_path: Path) -> None:
    """Nothing changed: the resumed steps use the lrs, and end at the weights, of the uninterrupted run."""
    net, opt, sched, parts = _trainee(OLD, 10)
    _train(net, opt, sched, 6)
    _checkpointer(tmp_path / "a").save(6, parts, blocking=True)
    straight = _train(net, opt, sched, 4)
    net2, opt2, sched2, parts2 = _trainee(OLD, 10)
    _checkpointer(tmp_path / "b").load(tmp_path / "a" / "checkpoints" / "step-6", parts2)
    assert _train(net2, opt2, sched2, 4) == straight
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), net2.state_dict().values()))


def test_another_optimizer_is_refused_naming_the_key_and_the_one_it_holds(step6, tmp_path: Path) -> None:
    path, _ = step6
    net, opt, sched, parts = _trainee(OptimizerConfig(name=OptimizerName.sgd, lr=1e-3,
                                                      scheduler=SchedulerName.constant), 10)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ResumeError) as err:
        _checkpointer(tmp_path / "sgd").load(path, parts)
    msg = str(err.value)
    assert msg.startswith("optimizer.name=sgd: the checkpoint holds optimizer.name=adamw's state"), msg
    assert "exp_avg, exp_avg_sq, step" in msg and "momentum_buffer" in msg, msg
    assert "Fix: optimizer.name=adamw" in msg, msg
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())  # nothing loaded


def test_another_model_shape_is_refused_naming_the_weights(step6, tmp_path: Path) -> None:
    path, _ = step6
    net, opt, sched, parts = _trainee(OLD, 6, width=8)
    with pytest.raises(ResumeError) as err:
        _checkpointer(tmp_path / "wide").load(path, parts)
    msg = str(err.value)
    assert msg.startswith("model: the checkpoint's weights do not fit"), msg
    assert "lin.weight is [4, 4] in the checkpoint, [8, 8] here" in msg, msg
