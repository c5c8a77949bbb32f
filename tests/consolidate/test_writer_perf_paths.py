"""The writer's fast paths give identical bytes, and verification catches a corrupted output.

Paths: verifying slabs (default) and plain slabs (``--no-verify``), into a preallocated or a
sparse output file, and slabs far smaller than a tensor (runs cut at slab edges, several
chunks interleaved inside one slab, casts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from fsdp_workflow.consolidate import ConsolidationError, consolidate
from fsdp_workflow.consolidate import writer
from fsdp_workflow.consolidate.reader import ChunkHandle, DcpCheckpoint
from fsdp_workflow.consolidate.synthetic import write_dcp

SHAPES = [
    ("model.embed_tokens.weight", (37, 24), torch.bfloat16),  # uneven dim-0 split, dim-1 split: many short runs
    ("model.layers.0.mlp.up_proj.weight", (64, 48), torch.float32),
    ("model.norm.weight", (24,), torch.bfloat16),
    ("step", (), torch.int64),
]


def _full(fqn: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, fqn)))
    if dtype == torch.int64:
        return torch.randint(0, 1 << 40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def _make(fqn: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
    shape = next(s for n, s, _ in SHAPES if n == fqn)
    return _full(fqn, shape, dtype)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    write_dcp(path, SHAPES, _make, dp=2, tp=2, tp_dim=1)
    return path


def _expected() -> dict[str, torch.Tensor]:
    return {n: _full(n, s, d) for n, s, d in SHAPES}


@pytest.mark.parametrize("mode", ["verify", "verify-small-slabs", "no-verify", "no-verify-sparse"])
def test_paths_write_identical_bytes(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    ref = tmp_path / "ref"
    consolidate(ckpt, ref, progress=False, workers=1)
    if mode == "verify-small-slabs":
        monkeypatch.setattr(writer, "SLAB_BYTES", 100)  # not a multiple of any row: runs are cut mid-row
    if mode == "no-verify-sparse":
        monkeypatch.setattr(writer, "_FALLOCATE", False)  # as where fallocate is unsupported
    out = tmp_path / mode
    res = consolidate(ckpt, out, progress=False, verify=mode.startswith("verify"), workers=3)
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    got = load_file(str(out / "model.safetensors"))
    for name, want in _expected().items():
        assert torch.equal(got[name], want), name
    if mode.startswith("verify"):
        reports = res.verification["tensors"]
        assert all(r["equal_to_source"] is True for r in reports.values())
        for name, want in _expected().items():
            raw = want.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert reports[name]["xxh3_128"] == xxhash.xxh3_128(raw).hexdigest(), name


def test_cast_with_small_slabs(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "SLAB_BYTES", 72)
    res = consolidate(ckpt, tmp_path / "out", dtype="fp32", progress=False, workers=2)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, want in _expected().items():
        want = want.float() if want.is_floating_point() else want
        assert torch.equal(got[name], want), name
    assert all(r["equal_to_source"] is True for r in res.verification["tensors"].values())


def _corrupt_first_data_write(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """After the first tensor-data write, flip one byte of it in the file (disk or page-cache corruption)."""
    real = writer._pwrite_all
    done: list[bool] = []

    def corrupting(fd: int, data, off: int) -> None:
        real(fd, data, off)
        if off > 0 and len(data) > at and not done:  # offset 0 is the header
            done.append(True)
            byte = os.pread(fd, 1, off + at)
            os.pwrite(fd, bytes([byte[0] ^ 0x40]), off + at)

    monkeypatch.setattr(writer, "_pwrite_all", corrupting)


def test_corrupted_output_byte_is_reported(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _corrupt_first_data_write(monkeypatch, at=4 * 10 + 1)  # workers=1: the biggest tensor (fp32 up_proj) goes first
    with pytest.raises(ConsolidationError, match=r"'model.layers.0.mlp.up_proj.weight' \(first difference at element 10, bytes\)"):
        consolidate(ckpt, tmp_path / "out", progress=False, workers=1)


def test_corrupted_output_fails_consolidation(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _corrupt_first_data_write(monkeypatch, at=3)
    out = tmp_path / "out"
    with pytest.raises(ConsolidationError, match="differs from the source"):
        consolidate(ckpt, out, progress=False, workers=2)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


def test_read_into_names_a_shard_truncated_after_indexing(ckpt: Path) -> None:
    dcp = DcpCheckpoint(ckpt)
    chunk = max(dcp.tensors["model.layers.0.mlp.up_proj.weight"].chunks, key=lambda c: c.offset)
    h = ChunkHandle(chunk, "float32")
    try:
        os.truncate(chunk.file, h.raw_offset + 8)  # type: ignore[operator]
        with pytest.raises(ConsolidationError, match=str(chunk.file.name)):
            h.read_into(0, memoryview(bytearray(64)))
    finally:
        h.close()


def test_slabs() -> None:
    pieces = [(0, 0, 7, "h0"), (7, 0, 5, "h1"), (12, 7, 7, "h0"), (19, 5, 5, "h1")]
    slabs = list(writer._slabs(pieces, 4))  # type: ignore[arg-type]
    assert [base for base, _ in slabs] == [0, 4, 8, 12, 16, 20]
    covered = [(d, n) for _, slab in slabs for d, _s, n, _h in slab]
    assert sum(n for _, n in covered) == 24
    assert all(sum(n for _d, _s, n, _h in slab) <= 4 for _, slab in slabs)
    assert [d for d, _ in covered] == sorted(d for d, _ in covered)


def test_no_verify_imports_no_torch(ckpt: Path, tmp_path: Path) -> None:
    # numpy is imported: the NaN/inf scan of every written slab (consolidate/nonfinite.py) uses it
    code = ("import sys; from fsdp_workflow.consolidate.__main__ import main; "
            f"assert main([{str(ckpt)!r}, {str(tmp_path / 'out')!r}, '--no-verify', '--no-progress']) == 0; "
            "bad = [m for m in ('torch', 'safetensors', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_default_verification_opens_the_files_with_safetensors_in_a_child(ckpt: Path, tmp_path: Path) -> None:
    # the byte check needs no numpy (the NaN/inf scan of the copy does), and safe_open runs in a child process
    code = ("import json, sys; from fsdp_workflow.consolidate.__main__ import main; "
            f"assert main([{str(ckpt)!r}, {str(tmp_path / 'out')!r}, '--no-progress']) == 0; "
            "bad = [m for m in ('torch', 'safetensors', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and report["files"] == ["model.safetensors"] and report["values"]["compared"] > 0
