"""Shared fixtures: one real 2-process FSDP2 training run for the whole session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
KINDS = ("llama", "qwen2", "mistral")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _arch_cache(tmp_path_factory, monkeypatch):
    """Keep the architecture cache inside the test session, never in ~/.cache."""
    monkeypatch.setenv("FSDP_WORKFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "arch-cache"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """Train tiny Llama, Qwen2 (tied) and Mistral (bf16) in ONE torchrun and save the project layout."""
    root = tmp_path_factory.mktemp("fsdp2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "fsdp2_train.py"), str(root), *KINDS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = []
    for _attempt in range(2):  # gloo on a loaded shared machine occasionally aborts at start-up
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode == 0:
            return root
        logs.append(f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        shutil.rmtree(root)
        root.mkdir()
    raise AssertionError("torchrun failed twice:\n" + "\n-----\n".join(logs))


def expected(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "expected" / f"step-{step}.safetensors"))


def load_out(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], skip: tuple = ()) -> None:
    want = {k: v for k, v in want.items() if k not in skip}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


def logits_equal(out: Path, want: dict[str, torch.Tensor], reference: Path) -> None:
    """Load OUT with from_pretrained and compare logits with a model holding ``want``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").eval()
    cfg = AutoConfig.from_pretrained(str(reference))
    ref = AutoModelForCausalLM.from_config(cfg, dtype=next(iter(want.values())).dtype).eval()
    ref.load_state_dict(want, strict=False)
    if cfg.tie_word_embeddings:
        ref.tie_weights()
    ids = torch.arange(1, 17).reshape(2, 8) % cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
