"""Bad inputs fail cleanly, nothing is half-written, and pickles never run code."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_workflow.consolidate import ConsolidationError, UnsafeCheckpointError, consolidate

from . import layouts
from .conftest import expected

pytestmark = pytest.mark.slow


def _copy_run(trained: Path, tmp_path: Path, kind: str = "llama") -> Path:
    dst = tmp_path / kind
    shutil.copytree(trained / kind, dst)
    return dst


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


class _Payload:
    """Unpickling this calls exec(), which would create MARKER."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_malicious_metadata_is_refused_and_never_runs(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    marker = tmp_path / "PWNED"
    step = run / "checkpoints" / "step-4"
    meta = pickle.load(open(step / ".metadata", "rb"))  # our own file: plain pickle is fine here
    meta.planner_data = _Payload(marker)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to unpickle global 'builtins.exec'"):
        consolidate(run, tmp_path / "out", progress=False)
    assert not marker.exists()
    _assert_nothing_written(tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "builtins.exec" in proc.stderr
    assert not marker.exists()
    # The same file runs its payload in torch's own reader: the risk is real.
    import torch.distributed.checkpoint as dcp

    dcp.FileSystemReader(str(step)).read_metadata()
    assert marker.exists()


def test_malicious_meta_pt_payload_never_runs(trained, tmp_path):
    marker = tmp_path / "PWNED"
    want = expected(trained / "llama", 4)
    layouts.lightning(want, tmp_path / "pl", {"global_step": 4, "evil": _Payload(marker)})
    res = consolidate(tmp_path / "pl", tmp_path / "out", reference=trained / "llama" / "hf_assets", progress=False)
    assert res.verification["meta_pt"]["global_step"] == 4
    assert not marker.exists()


def test_malicious_chunk_pickle_is_refused(tmp_path):
    import zipfile

    from fsdp_workflow.consolidate.synthetic import write_dcp

    marker = tmp_path / "PWNED"
    path = tmp_path / "evil"
    write_dcp(path, [("model.w", (4,), torch.float32)], lambda *a: torch.zeros(4), dp=1)
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    with zipfile.ZipFile(shard, "w", zipfile.ZIP_STORED) as z:  # same name, same metadata entry
        z.writestr("archive/data.pkl", pickle.dumps(_Payload(marker), protocol=2))
        z.writestr("archive/data/0", bytes(16))
    with open(shard, "ab") as f:  # keep the length the metadata expects
        f.write(bytes(max(0, size - shard.stat().st_size)))
    meta = pickle.load(open(path / ".metadata", "rb"))
    info = next(iter(meta.storage_data.values()))
    info.length = shard.stat().st_size if size <= shard.stat().st_size else info.length
    pickle.dump(meta, open(path / ".metadata", "wb"))
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle global 'builtins.exec'"):
        consolidate(path, tmp_path / "out", progress=False)
    assert not marker.exists()
    _assert_nothing_written(tmp_path / "out")


def test_missing_shard(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "step-4" / "__1_0.distcp").unlink()
    with pytest.raises(ConsolidationError, match=r"__1_0\.distcp: shard file is missing"):
        consolidate(run / "checkpoints" / "step-4", tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_truncated_shard(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    shard = run / "checkpoints" / "step-4" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ConsolidationError, match=r"__0_0\.distcp: shard file is truncated"):
        consolidate(run, tmp_path / "out", step=4, progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_the_default_step_skips_a_corrupt_newest_checkpoint_with_a_note(trained, tmp_path):
    """As resume does: a truncated newest shard or garbled .metadata sends the default choice to an older step."""
    run = _copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    shard = ckpts / "step-4" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    before = sorted((p.name, p.stat().st_size) for p in (ckpts / "step-4").iterdir())
    result = consolidate(run, tmp_path / "out", progress=False)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] is True and report.get("step") in (2, None)
    notes = " ".join(report["notes"])
    assert f"{ckpts / 'step-4'}: skipped, it fails verification (shard {shard} is truncated" in notes
    assert "using step 2, the newest complete step" in notes
    assert sorted((p.name, p.stat().st_size) for p in (ckpts / "step-4").iterdir()) == before  # left alone
    assert result.num_tensors > 0

    (ckpts / "step-2" / ".metadata").write_bytes(b"garbled")
    with pytest.raises(ConsolidationError, match=r"no checkpoint that verifies: step 2: .*cannot be parsed.*step 4: "):
        consolidate(run, tmp_path / "out2", progress=False)
    _assert_nothing_written(tmp_path / "out2")


def test_missing_metadata(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "step-4" / ".metadata").unlink()
    with pytest.raises(ConsolidationError, match=r"step-4/\.metadata: missing DCP metadata file"):
        consolidate(run / "checkpoints" / "step-4", tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_config_shape_mismatch_leaves_nothing_and_keeps_source(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    cfg = json.loads((run / "hf_assets" / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (run / "hf_assets" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConsolidationError, match=r"mlp\.down_proj\.weight: checkpoint \[32, 64\] vs config \[32, 48\]"):
        consolidate(run, tmp_path / "out", remove_sharded=True, progress=False)
    _assert_nothing_written(tmp_path / "out")
    assert (run / "checkpoints" / "step-4" / ".metadata").is_file()


def test_unresolvable_architecture(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    cfg = json.loads((run / "hf_assets" / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (run / "hf_assets" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConsolidationError, match="'NoSuchModelForCausalLM'.*does not resolve"):
        consolidate(run, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_existing_output_is_never_touched(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(trained / "llama"), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "OUT exists and is not a model written by this tool" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_remove_sharded_after_success(trained, tmp_path):
    run = _copy_run(trained, tmp_path, "qwen2")
    consolidate(run, tmp_path / "out", remove_sharded=True, progress=False)
    assert not (run / "checkpoints" / "step-4").exists()
    assert (run / "checkpoints" / "step-2" / ".metadata").is_file()
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_bad_option_values(trained, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(trained / "llama"), str(tmp_path / "o"),
                           "--step", "3"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--step 3: not found" in proc.stderr and "[2, 4]" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def _files(run: Path) -> dict:
    return {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}


def test_too_little_space_is_refused_before_anything_is_written(trained, tmp_path, small_fs):
    run = _copy_run(trained, tmp_path)
    shards = _files(run)
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run), str(small_fs / "out"),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{small_fs / 'out'}: [Errno 28] No space left on device: {small_fs} has" in proc.stderr, proc.stderr
    assert "nothing was written" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in small_fs.iterdir()] == [".out.consolidate.lock"]  # the output's lock file (empty, released) stays
    assert (small_fs / ".out.consolidate.lock").read_text() == ""
    assert _files(run) == shards


def test_a_disk_that_fills_during_the_copy_leaves_no_partial_model(trained, tmp_path, small_fs, monkeypatch):
    """The free-space check passes (a quota it cannot see, or another writer): ENOSPC mid-copy, cleaned up."""
    from fsdp_workflow.consolidate import consolidation as api

    run = _copy_run(trained, tmp_path)
    shards = _files(run)
    monkeypatch.setattr(api, "check_space", lambda out, need: None)
    with pytest.raises(ConsolidationError, match=r"out: the disk filled while writing the model \(\[Errno 28\] No "
                                                 r"space left on device\); the partial output was removed"):
        consolidate(run, small_fs / "out", progress=False)
    assert [p.name for p in small_fs.iterdir()] == [".out.consolidate.lock"]
    assert _files(run) == shards
