"""GPU: FSDP2 through Accelerate on one GPU under torchrun, bf16, checkpoint, resume, consolidate.

Skipped without CUDA. Run on a GPU machine with ``python -m pytest tests/train/test_gpu.py -s``.

The versions it needs are the GPU lock's, ``requirements/cuda.txt`` (``bash tools/install.sh`` installs
them where ``nvidia-smi`` answers): torch 2.11.0 (CUDA 13.0 build), the libraries of
``requirements/common.txt``, inside pyproject.toml's ranges. It last passed on one H100 with torch
2.11.0+cu130, transformers 5.17 and accelerate 1.15 (docs/training.md); with the lock's transformers 5.25
and accelerate 1.16 it is owed. The first test fails, naming each library, when the machine has others.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.train.conftest import copy_run
from tests.train.runner import launched, log_text, losses, make_run_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = ["cluster.device=cuda", "cluster.processes_per_node=1", "train.mixed_precision=bf16",
       "train.max_steps=20", "checkpoint.every_steps=10", "checkpoint.keep_last=0", "optimizer.lr=3e-3"]


def test_the_gpu_machine_runs_the_tested_set() -> None:
    from fsdp_workflow.core.versions import installed, outside_tested

    print("GPU check with:", ", ".join(f"{k} {v}" for k, v in installed().items() if v))
    assert outside_tested() == [], "install the GPU lock: bash tools/install.sh (requirements/cuda.txt)"


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launched(make_run_dir(tmp_path_factory.mktemp("gpu") / "run", GPU), nproc=1, timeout_s=600)


def test_accelerate_keeps_fsdp2_on_one_gpu(gpu_run: Path) -> None:
    text = log_text(gpu_run)
    assert "strategy fsdp2 (DistributedType.FSDP)" in text, text
    recs = [json.loads(line) for line in (gpu_run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    assert all(math.isfinite(r["loss"]) and r["max_memory_gib"] > 0 for r in recs)
    files = sorted(p.name for p in (gpu_run / "checkpoints" / "step-20").iterdir())
    assert files == [".metadata", "__0_0.distcp"]
    md = FileSystemReader(str(gpu_run / "checkpoints" / "step-20")).read_metadata()
    w = md.state_dict_metadata["model.model.layers.0.self_attn.q_proj.weight"]
    assert w.properties.dtype == torch.float32  # fp32 master weights, bf16 compute


def test_resume_on_gpu(gpu_run: Path, tmp_path: Path) -> None:
    run = copy_run(gpu_run, tmp_path / "resumed", checkpoints=(10,))
    launched(run, nproc=1, timeout_s=600)
    ref, got = losses(gpu_run), losses(run)
    diffs = [abs(got[s] - ref[s]) for s in range(11, 21)]
    print(f"GPU resume: max |loss difference| over steps 11-20 = {max(diffs):.3g} (exact: {max(diffs) == 0})")
    assert max(diffs) < 2e-2


def test_consolidate_gpu_checkpoint(gpu_run: Path) -> None:
    pytest.importorskip("fsdp_workflow.consolidate.consolidation")
    out = gpu_run / "hf_model"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(gpu_run), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.architectures == ["LlamaForCausalLM"]
