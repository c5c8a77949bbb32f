"""checkpoint_problem: whole checkpoints pass; truncated shards and garbled metadata are named."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_workflow.core.checkpoint_health import checkpoint_problem, dcp_problem
from fsdp_workflow.core.rundir import DCP_METADATA, RunDir

FIXTURES = Path(__file__).resolve().parents[1] / "consolidate" / "fixtures"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints" / "step-4"
    state = {"model": {"w": torch.arange(600.0).view(60, 10), "b": torch.ones(3, dtype=torch.bfloat16)},
             "trainer": {"step": 4}}
    dcp.save(state, checkpoint_id=str(path))
    return path


def test_a_whole_dcp_checkpoint_passes(ckpt: Path) -> None:
    assert checkpoint_problem(ckpt) is None


def test_a_truncated_shard_is_named_with_its_sizes(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    problem = checkpoint_problem(ckpt)
    assert problem is not None and f"shard {shard} is truncated" in problem and "bytes" in problem


def test_a_missing_shard_is_named(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    assert f"shard {shard} named by .metadata is missing" in (checkpoint_problem(ckpt) or "")


@pytest.mark.parametrize("garble", [lambda b: b[:60], lambda b: b[:40] + bytes(len(b) - 80) + b[-40:], lambda b: b"x" * len(b)])
def test_garbled_metadata_is_named(ckpt: Path, garble) -> None:
    meta = ckpt / DCP_METADATA
    meta.write_bytes(garble(meta.read_bytes()))
    assert f"{meta} cannot be parsed" in (checkpoint_problem(ckpt) or "")


def test_metadata_naming_a_foreign_global_is_refused_not_run(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (ckpt / DCP_METADATA).write_bytes(pickle.dumps(Payload()))
    assert "refusing to unpickle global" in (checkpoint_problem(ckpt) or "")
    assert dcp_problem(ckpt, report_unsafe=False) is None  # left to a reader that refuses it loudly
    assert not marker.exists()


def test_deepspeed_checkpoints_pass_and_a_truncated_file_is_named(tmp_path: Path) -> None:
    import shutil

    step = FIXTURES / "deepspeed_zero3" / "tiny_qwen2" / "checkpoints" / "step-4"
    assert checkpoint_problem(step) is None
    bad = tmp_path / "step-4"
    shutil.copytree(step, bad)
    victim = next(bad.rglob("*_model_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-200])
    assert f"{victim} is truncated or corrupt" in (checkpoint_problem(bad) or "")


def test_the_check_imports_no_torch() -> None:
    code = "import sys, fsdp_workflow.core.checkpoint_health; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_quarantine_names_never_collide_and_are_listed(ckpt: Path) -> None:
    run = RunDir.of(ckpt.parents[1])
    first = run.quarantine_path(4)
    assert first.name == "step-4.corrupt"
    ckpt.rename(first)
    (run.checkpoints / "step-4").mkdir()
    second = run.quarantine_path(4)
    assert second.name == "step-4.corrupt-2"
    assert run.quarantined() == [first]
    assert run.list_checkpoints() == []  # neither a quarantined dir nor an empty step-4 is a checkpoint
