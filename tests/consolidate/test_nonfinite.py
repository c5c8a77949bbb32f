"""Non-finite weights are refused by default (exit 65, each tensor named, nothing written), and written on purpose only with --allow-nonfinite.

The checkpoints are real DCP: ``dcp.save`` of tensors holding NaN and inf (bf16, fp16, fp32),
and a copy of the session's 2-rank FSDP2 checkpoint with a NaN and an inf written into rank
1's shard bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fsdp_workflow.consolidate.nonfinite import NonFiniteScan
from fsdp_workflow.consolidate.reader import ChunkHandle, DcpCheckpoint
from fsdp_workflow.core.exit_codes import EXIT_NONFINITE
from fsdp_workflow.report.card import main as card_main

from . import layouts
from .conftest import load_out

BIG = 1 << 20  # elements: 2-4 MiB, several writer slabs and far more than fast verification compares


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e5m2, torch.float8_e4m3fn])
def test_scan_counts_nan_and_inf_like_torch(dtype: torch.dtype) -> None:
    """Every NaN bit pattern (signs, payloads) and both infinities counted; max finite, subnormals and zeros not."""
    info = torch.finfo(dtype)
    specials = [0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 4, 1.0, float("nan"),
                float("inf"), float("-inf"), -float("nan")]
    base = torch.tensor(specials * 50, dtype=torch.float32).to(dtype)
    raw = bytearray(_bits(base))
    item = base.element_size()
    if dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):  # NaNs with payloads, either sign
        exp_all = {2: 0x7F80 if dtype == torch.bfloat16 else 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}[item]
        fmt = {2: "<H", 4: "<I", 8: "<Q"}[item]
        for i, payload in enumerate((1, 3, 0x15)):
            struct.pack_into(fmt, raw, i * item, exp_all | payload | (1 << (8 * item - 1) if i % 2 else 0))
    got_t = torch.frombuffer(bytearray(raw), dtype=dtype).float()
    want = {"nan": int(torch.isnan(got_t).sum()), "inf": int(torch.isinf(got_t).sum())}
    assert want["nan"] > 0
    scan = NonFiniteScan()
    half = len(raw) // item // 2 * item  # two calls, as two slabs: counts add up
    scan.scan("w", str(dtype).split(".")[-1], memoryview(raw)[:half])
    scan.scan("w", str(dtype).split(".")[-1], memoryview(raw)[half:])
    scan.scan("ids", "int64", _bits(torch.full((8,), -1, dtype=torch.int64)))  # all ones, but not a float
    assert scan.found() == {"w": want}


def test_scan_of_finite_values_finds_nothing() -> None:
    scan = NonFiniteScan()
    scan.scan("w", "bfloat16", _bits(torch.randn(BIG).to(torch.bfloat16) * 1e30))
    assert scan.found() == {}


def _ckpt(root: Path, dtype: torch.dtype) -> tuple[Path, dict[str, dict[str, int]]]:
    """A real DCP checkpoint (dcp.save) of three tensors; two hold NaN/inf, far from any chunk boundary."""
    big = torch.randn(BIG, dtype=torch.float32).to(dtype).reshape(1024, -1)
    big[517, 33] = float("nan")
    big[700, 5] = float("inf")
    big[701, 6] = float("-inf")
    small = torch.ones(16, dtype=dtype)
    small[3] = float("nan")
    state = {"model": {"big.weight": big, "small.bias": small, "ok.weight": torch.zeros(8, 8, dtype=dtype)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save(state, root / "checkpoints" / "step-1")
    return root, {"big.weight": {"nan": 1, "inf": 2}, "small.bias": {"nan": 1, "inf": 0}}


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", *argv, "--no-progress"],
                          capture_output=True, text=True, timeout=300)


def _assert_no_output(out: Path) -> None:
    assert not out.exists()
    left = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}") and not p.name.endswith(".lock"))
    assert left == [], left  # no staging directory either


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["fast", "--full-verify", "--no-verify"])
def test_nonfinite_checkpoint_is_refused(tmp_path: Path, dtype: torch.dtype, mode: str) -> None:
    run, bad = _ckpt(tmp_path / "run", dtype)
    out = tmp_path / "out"
    proc = _cli(str(run), str(out), *([mode] if mode != "fast" else []))
    assert proc.returncode == EXIT_NONFINITE, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    err = proc.stderr
    assert "(2 NaN, 2 inf)" in err and "in 2 tensor(s)" in err, err
    assert "'big.weight' (1 NaN, 2 inf)" in err and "'small.bias' (1 NaN)" in err and "ok.weight" not in err
    assert "--allow-nonfinite" in err
    _assert_no_output(out)


def test_cast_that_overflows_is_refused_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": {"w": torch.full((4, 4), 1e6)}}, root / "checkpoints" / "step-1")
    proc = _cli(str(root), str(tmp_path / "out"), "--dtype", "fp16")
    assert proc.returncode == EXIT_NONFINITE and "'w' (16 inf)" in proc.stderr
    assert "values beyond float16's range become inf" in proc.stderr
    assert _cli(str(root), str(tmp_path / "out")).returncode == 0  # kept as fp32 it is finite


def test_allow_nonfinite_writes_them_and_says_so(tmp_path: Path) -> None:
    run, bad = _ckpt(tmp_path / "run", torch.bfloat16)
    out = tmp_path / "out"
    proc = _cli(str(run), str(out), "--allow-nonfinite")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True and summary["nonfinite"] == bad
    report = json.loads((out / "verification.json").read_text())
    assert report["nonfinite"]["allowed"] is True and report["nonfinite"]["tensors"] == bad
    assert any("--allow-nonfinite" in n and "'big.weight' (1 NaN, 2 inf)" in n for n in report["notes"])
    assert card_main([str(out)]) == 0  # the report stage's card, as the consolidation job runs it next
    card = (out / "README.md").read_text()
    assert "non-finite weights" in card and "'big.weight' (1 NaN, 2 inf)" in card and "'small.bias' (1 NaN)" in card
    got = load_out(out)
    assert int(torch.isnan(got["big.weight"].float()).sum()) == 1 and int(torch.isinf(got["big.weight"].float()).sum()) == 2


def test_finite_model_records_the_scan(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": {"w": torch.randn(64, 64).to(torch.bfloat16)}}, root / "checkpoints" / "step-1")
    assert _cli(str(root), str(tmp_path / "out")).returncode == 0
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["nonfinite"]["tensors"] == {} and report["nonfinite"]["allowed"] is False
    assert card_main([str(tmp_path / "out")]) == 0
    assert "non-finite" not in (tmp_path / "out" / "README.md").read_text()


def test_fsdp2_checkpoint_with_nan_in_one_ranks_shard(trained: Path, tmp_path: Path) -> None:
    """The 2-rank FSDP2 checkpoint of the session, a NaN and an inf written into rank 1's bytes of one tensor."""
    run = tmp_path / "llama"
    shutil.copytree(trained / "llama", run)
    step = run / "checkpoints" / "step-4"
    ckpt = DcpCheckpoint(step)
    fqn, src = max(((k, t) for k, t in ckpt.tensors.items() if len(t.chunks) > 1), key=lambda kv: kv[1].nbytes)
    chunk = max(src.chunks, key=lambda c: c.offsets[0])  # the last rank's rows
    handle = ChunkHandle(chunk, src.dtype)
    item = torch.empty(0, dtype=getattr(torch, src.dtype)).element_size()
    nan, inf = (_bits(torch.tensor([v], dtype=getattr(torch, src.dtype))) for v in (float("nan"), float("inf")))
    fd = os.open(chunk.file, os.O_WRONLY)
    try:
        os.pwrite(fd, nan, handle.raw_offset + 5 * item)
        os.pwrite(fd, inf, handle.raw_offset + 9 * item)
    finally:
        os.close(fd)
        handle.close()
    proc = _cli(str(run), str(tmp_path / "out"))
    assert proc.returncode == EXIT_NONFINITE, proc.stderr
    assert "in 1 tensor(s)" in proc.stderr and "(1 NaN, 1 inf)" in proc.stderr
    _assert_no_output(tmp_path / "out")
    proc = _cli(str(run), str(tmp_path / "out"), "--allow-nonfinite")
    assert proc.returncode == 0, proc.stderr
    [(name, counts)] = json.loads((tmp_path / "out" / "verification.json").read_text())["nonfinite"]["tensors"].items()
    assert counts == {"nan": 1, "inf": 1} and name.endswith(fqn.split(".", 1)[-1].split("model.", 1)[-1])
