"""Verification is independent of the write path: it catches the writer's own mistakes.

Each test breaks one piece of the writer (chunk placement, renaming, casting, averaging) on a
real FSDP2 checkpoint written by torch, and checks that verification fails naming the
tensor(s), that ``OUT`` is never created, and that the CLI exits 2. The previous check
(re-reading the bytes just written) passed all of these.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_workflow.consolidate import ConsolidationError, consolidate, reader, steps, writer
from fsdp_workflow.consolidate.__main__ import main
from fsdp_workflow.consolidate.reader import DcpCheckpoint
from fsdp_workflow.consolidate.verify import values as value_check
from fsdp_workflow.consolidate.verify.rounding import badly_rounded, patterns

from .. import layouts
from ..conftest import expected

pytestmark = pytest.mark.slow

GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"  # both [64, 32]
DOWN = "model.layers.0.mlp.down_proj.weight"  # [32, 64]: two 16-row chunks on 2 ranks


def _no_output(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _chunk_of(run: Path, name: str, first: bool = True) -> reader.Chunk:
    dcp = DcpCheckpoint(run / "checkpoints" / "step-4")
    fqn = next(f for f in dcp.tensors if f.endswith(name.removeprefix("model.")))
    chunks = sorted(dcp.tensors[fqn].chunks, key=lambda c: c.offsets)
    assert len(chunks) == 2, "the fixture shards this tensor over 2 ranks"
    return chunks[0 if first else 1]


@pytest.mark.parametrize("during_copy", [True, False], ids=["compared-during-copy", "compared-after-copy"])
def test_wrong_chunk_placement_fails_naming_the_tensor(trained, tmp_path, monkeypatch, during_copy):
    # both schedules: during the copy on machines of OVERLAP_MIN_CPUS or more, after it on smaller ones
    monkeypatch.setattr(steps, "OVERLAP_MIN_CPUS", 1 if during_copy else 10**6)
    built = []
    real_build = steps._build_verifier
    monkeypatch.setattr(steps, "_build_verifier", lambda *a: built.append(real_build(*a)) or built[-1])
    run = trained / "llama"
    target = _chunk_of(run, DOWN)
    real = writer.chunk_runs

    def shifted(shape, chunk):  # the writer puts the first chunk one row (64 elements) too low
        runs = real(shape, chunk)
        if (chunk.file, chunk.offset) == (target.file, target.offset):
            return [(s, d + 64, n) for s, d, n in runs]
        return runs

    monkeypatch.setattr(writer, "chunk_runs", shifted)
    out = tmp_path / "out"
    with pytest.raises(ConsolidationError, match=rf"'{DOWN}' \(first difference at element 0, bytes\)"):
        consolidate(run, out, progress=False)
    _no_output(tmp_path, out)
    assert [v.during_copy for v in built] == [during_copy]


def test_a_write_outside_the_tensors_region_fails(trained, tmp_path, monkeypatch):
    real = writer.StreamingWriter._one

    def stray(self, fd, t):  # the writer reports a write into the header for one tensor
        ranges = real(self, fd, t)
        return ranges + [(0, 8)] if t.name == DOWN else ranges

    monkeypatch.setattr(writer.StreamingWriter, "_one", stray)
    out = tmp_path / "out"
    with pytest.raises(ConsolidationError, match=rf"bytes \[\(0, 8\)\] of model.safetensors for '{DOWN}', outside its region"):
        consolidate(trained / "llama", out, progress=False)
    _no_output(tmp_path, out)


def _swap_sources(monkeypatch, a: str, b: str) -> None:
    """Exchange two same-shape tensors in the writer's plan, as a wrong rename would."""
    real = steps.plan_output

    def swapped(*args, **kwargs):
        plan = real(*args, **kwargs)
        ta, tb = (next(t for t in plan.tensors if t.name == n) for n in (a, b))
        ta.sources, tb.sources = tb.sources, ta.sources
        return plan

    monkeypatch.setattr("fsdp_workflow.consolidate.consolidation.plan_output", swapped)


def test_swapped_rename_fails_naming_both(trained, tmp_path, monkeypatch):
    _swap_sources(monkeypatch, GATE, UP)
    out = tmp_path / "out"
    with pytest.raises(ConsolidationError, match="differs from the source for 2 tensor") as err:
        consolidate(trained / "llama", out, progress=False)
    assert f"'{GATE}'" in str(err.value) and f"'{UP}'" in str(err.value)
    _no_output(tmp_path, out)


def test_cli_exits_2_and_writes_nothing(trained, tmp_path, monkeypatch, capsys):
    _swap_sources(monkeypatch, GATE, UP)
    out = tmp_path / "out"
    assert main([str(trained / "llama"), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "\nerror: verification failed" in "\n" + err and GATE in err and "Traceback" not in err
    _no_output(tmp_path, out)


def test_cast_left_on_one_tensor_fails_in_the_header_check(trained, tmp_path, monkeypatch):
    real = steps.plan_files

    def forgot(tensors, max_bytes):  # --dtype bf16 not applied to one tensor
        return real([replace(t, dtype=t.sources[0].dtype) if t.name == UP else t for t in tensors], max_bytes)

    monkeypatch.setattr(steps, "plan_files", forgot)
    with pytest.raises(ConsolidationError, match=rf"'{UP}' is F32\[64, 32\] in model.safetensors, the checkpoint says BF16\[64, 32\]"):
        consolidate(trained / "llama", tmp_path / "out", dtype="bf16", progress=False)


def test_wrong_rounding_fails(trained, tmp_path, monkeypatch):
    def truncating(buf, src, dst):  # float32 -> bfloat16 by dropping the low half: round toward zero
        return (np.frombuffer(buf, "<u4") >> 16).astype("<u2").tobytes()

    monkeypatch.setattr(writer, "cast_bytes", truncating)
    with pytest.raises(ConsolidationError, match=r"rounding\)"):
        consolidate(trained / "llama", tmp_path / "out", dtype="bf16", progress=False)


def test_cast_and_average_are_checked_and_say_how(trained, tmp_path):
    run = trained / "llama"
    cast = consolidate(run, tmp_path / "bf16", dtype="bf16", progress=False).verification
    assert cast["ok"] and {t["check"] for t in cast["tensors"].values()} == {"rounding"}
    avg = consolidate(run, tmp_path / "avg", average_last=2, progress=False).verification
    assert avg["ok"] and {t["check"] for t in avg["tensors"].values()} == {"average"}
    assert set(avg["values"]["checks"]) == {"average"} and avg["values"]["compared"] == len(avg["tensors"])


def test_wrong_average_fails(trained, tmp_path, monkeypatch):
    real = writer.accumulate
    monkeypatch.setattr(writer, "accumulate", lambda sources, weights, dtype: real(sources, weights[::-1], dtype))
    with pytest.raises(ConsolidationError, match=r"average\)"):
        consolidate(trained / "llama", tmp_path / "out", steps=[2, 4], weights=[1, 3], progress=False)


def test_report_names_every_tensor_checked_with_replicas_counted(trained, tmp_path):
    want = expected(trained / "llama", 4)
    layouts.mesh_2d(want, tmp_path / "mesh")  # dp=2 x tp=2, every chunk listed twice
    v = consolidate(tmp_path / "mesh", tmp_path / "out", reference=trained / "llama" / "hf_assets",
                    progress=False).verification
    assert v["ok"] and set(v["tensors"]) == set(want)
    assert all(t["equal_to_source"] is True and t["check"] == "bytes" for t in v["tensors"].values())
    assert v["values"]["chunks_listed"] == 2 * v["values"]["chunks"]
    assert json.loads((tmp_path / "out" / "verification.json").read_text())["values"] == v["values"]


def test_transformed_chunks_are_placed_independently_and_say_so(trained, tmp_path, monkeypatch):
    want = expected(trained / "llama", 4)
    layouts.save({"model": {k: v.clone() for k, v in want.items()}}, tmp_path / "z", [layouts.ZlibTransform()])
    assert all(i.transform_descriptors for i in pickle.load(open(tmp_path / "z" / ".metadata", "rb")).storage_data.values())
    monkeypatch.setattr(reader, "EXTRA_EXTENSIONS", [layouts.ZlibTransform])
    v = consolidate(tmp_path / "z", tmp_path / "out", reference=trained / "llama" / "hf_assets", progress=False).verification
    assert v["ok"] and any("decoded by DCP's own reader" in n for n in v["values"]["notes"])


def test_fast_mode_samples_but_checks_every_chunk_boundary(trained, tmp_path, monkeypatch):
    """Default (fast) mode on tensors of many slabs: a boundary error is still caught; full mode reads every byte."""
    run = trained / "llama"
    monkeypatch.setattr(value_check, "SLAB_BYTES", 256)  # one row of down_proj: its 16-row chunks span 16 slabs each
    fast = consolidate(run, tmp_path / "fast", progress=False).verification
    entry = fast["tensors"][DOWN]
    assert fast["ok"] and fast["values"]["mode"].startswith("fast") and fast["values"]["bytes_compared_fraction"] < 1
    assert 0 < entry["compared_fraction"] < 1 and entry["equal_to_source"] is None and entry["xxh3_128"] == ""
    full = consolidate(run, tmp_path / "full", full_verify=True, progress=False).verification
    assert full["values"]["mode"].startswith("full") and full["tensors"][DOWN]["equal_to_source"] is True
    assert full["values"]["bytes_compared_fraction"] == 1.0

    target, real = _chunk_of(run, DOWN, first=False), writer.chunk_runs

    def misplaced(shape, chunk):  # the second chunk written one row too high: its last row is never written
        runs = real(shape, chunk)
        return [(s, d - 64, n) for s, d, n in runs] if (chunk.file, chunk.offset) == (target.file, target.offset) else runs

    monkeypatch.setattr(writer, "chunk_runs", misplaced)
    with pytest.raises(ConsolidationError, match=rf"'{DOWN}' \(first difference at element"):
        consolidate(run, tmp_path / "out", progress=False)
    _no_output(tmp_path, tmp_path / "out")


def test_remove_sharded_always_compares_every_byte(trained, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(trained / "llama" / "checkpoints" / "step-4", src)
    v = consolidate(src, tmp_path / "out", reference=trained / "llama" / "hf_assets", remove_sharded=True,
                    progress=False).verification
    assert v["values"]["mode"].startswith("full") and not src.exists()


def test_rounding_check_agrees_with_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50000, generator=g) * torch.exp(torch.randn(50000, generator=g) * 20)
    edges = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38,
                          65504.0, 65519.0, 65520.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 3.3961e38])
    ties = torch.arange(0x3F800000, 0x3F800000 + 4096, dtype=torch.int32).view(torch.float32)  # every low-bit pattern
    x = torch.cat([x, edges, ties])
    for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        y = patterns(x.to(dt).view(torch.uint8).numpy(), name)
        assert len(badly_rounded(x.double().numpy(), y, name)) == 0, name
    wrong = patterns((x.view(torch.int32) >> 16).to(torch.int16).view(torch.uint8).numpy(), "bfloat16")
    assert len(badly_rounded(x.double().numpy(), wrong, "bfloat16")) > len(x) // 3  # truncation is not rounding
