"""Resuming never runs code from a checkpoint's pickles (checkpoint.resume may name any directory)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_workflow.train.checkpoint import Checkpointer, SafeFileSystemReader


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_real_metadata_loads_and_resumes_values(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "trainer": {"step": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    meta = SafeFileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert "model.w" in meta.state_dict_metadata
    into = {"model": {"w": torch.zeros(2, 3)}, "trainer": {"step": 0}}
    Checkpointer.load(tmp_path / "ck", into)
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["trainer"]["step"] == 7


def test_crafted_metadata_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ck"))
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with pytest.raises(CheckpointException, match=r"posix\.system is not allowed in a DCP \.metadata"):
        Checkpointer.load(tmp_path / "ck", {"model": {"w": torch.zeros(2)}})
    assert not marker.exists()


FIXTURES = Path(__file__).resolve().parents[1] / "consolidate" / "fixtures"


def test_deepspeed_checkpoint_is_checked_before_deepspeed_unpickles_it(tmp_path: Path) -> None:
    """DeepSpeed's own loader uses weights_only=False: resume refuses a crafted file first."""
    import shutil

    from fsdp_workflow.train.checkpoint import CheckpointError, check_deepspeed_pickles

    step = FIXTURES / "deepspeed_zero3" / "tiny_qwen2" / "checkpoints" / "step-4"
    check_deepspeed_pickles(step)  # the trainer's own DeepSpeed checkpoint passes
    bad = tmp_path / "step-4"
    shutil.copytree(step, bad)
    victim = next(bad.rglob("*_model_states.pt"))
    marker = tmp_path / "pwned"
    torch.save({"module": {}, "evil": _Payload(marker)}, victim)
    with pytest.raises(CheckpointError, match=r"refusing to resume: .*_model_states\.pt: refused to unpickle"):
        check_deepspeed_pickles(bad)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="no DeepSpeed"):
        check_deepspeed_pickles(tmp_path / "empty")
