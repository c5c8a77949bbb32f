"""Shared fixtures: one real 2-process FSDP2 training run for the whole session."""

from __future__ import annotations

import os
import shutil
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
    """Train tiny Llama, Qwen2 (tied) and Mistral (bf16) on 2 ranks in ONE run and save the project layout.

    The ranks are forked from a preloaded server (tests/forked_ranks.py), not started by torchrun."""
    from tests.consolidate import fsdp2_train
    from tests.forked_ranks import run

    root = tmp_path_factory.mktemp("fsdp2")
    errors = []
    for _attempt in range(2):  # gloo on a loaded shared machine occasionally aborts at start-up
        try:
            run(fsdp2_train.main, (str(root), list(KINDS)), world=2, preload=[fsdp2_train.__name__])
            return root
        except Exception as err:  # noqa: BLE001 - torch.multiprocessing's rank failure, said below
            errors.append(f"{type(err).__name__}: {err}")
            shutil.rmtree(root)
            root.mkdir()
    raise AssertionError("the 2-rank training failed twice:\n" + "\n-----\n".join(errors))


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
