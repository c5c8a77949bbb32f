"""Resuming never runs code from a checkpoint's pickles (checkpoint.resume may name any directory)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_workflow.core import rundir
from fsdp_workflow.core.safe_pickle import UnsafePickleError
from fsdp_workflow.train.checkpoint import CheckpointDir, CheckpointError
from fsdp_workflow.train.checkpointers import DcpCheckpointer
from fsdp_workflow.train.safe_load import SafeFileSystemReader, check_deepspeed_pickles


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class _Part:
    """A minimal ``Stateful`` part: what DCP hands back is what it loads."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state_dict: dict) -> None:
        self.state = state_dict


def _checkpointer(tmp_path: Path) -> DcpCheckpointer:
    return DcpCheckpointer(CheckpointDir(rundir.RunDir.of(tmp_path / "run"), keep_last=0, rank=0))


def test_real_metadata_loads_and_resumes_values(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "trainer": {"step": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    meta = SafeFileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert "model.w" in meta.state_dict_metadata
    model, trainer = _Part({"w": torch.zeros(2, 3)}), _Part({"step": 0})
    _checkpointer(tmp_path).load(tmp_path / "ck", {"model": model, "trainer": trainer})
    assert torch.equal(model.state["w"], state["model"]["w"]) and trainer.state["step"] == 7


def test_crafted_metadata_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ck"))
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / rundir.DCP_METADATA).write_bytes(pickle.dumps(_Payload(marker)))

    # The reader itself: core.safe_pickle's allow-list refuses the global before importing it.
    with pytest.raises(UnsafePickleError, match=r"refusing to unpickle global 'posix\.system'"):
        SafeFileSystemReader(str(tmp_path / "ck")).read_metadata()
    # A resume: a clean CheckpointError (exit code 2 with the message), not DCP's traceback.
    with pytest.raises(CheckpointError, match=r"refusing to resume from .*'posix\.system'"):
        _checkpointer(tmp_path).load(tmp_path / "ck", {"model": _Part({"w": torch.zeros(2)})})
    assert not marker.exists()


def test_truncated_metadata_is_a_clean_error(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ck"))
    meta = tmp_path / "ck" / rundir.DCP_METADATA
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _checkpointer(tmp_path).load(tmp_path / "ck", {"model": _Part({"w": torch.zeros(2)})})


FIXTURES = Path(__file__).resolve().parents[1] / "consolidate" / "fixtures"


def test_deepspeed_checkpoint_is_checked_before_deepspeed_unpickles_it(tmp_path: Path) -> None:
    """DeepSpeed's own loader uses weights_only=False: resume refuses a crafted file first."""
    import shutil

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
