"""Round trip through real FSDP2 training: project layout -> HF model, exact tensors and logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fsdp_workflow.consolidate import consolidate

from .conftest import KINDS, assert_same_tensors, expected, load_out, logits_equal

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", KINDS)
def test_project_run_dir_roundtrip(trained, tmp_path, kind):
    run = trained / kind
    out = tmp_path / "hf"
    res = consolidate(run, out, progress=False)
    want = expected(run, 4)
    tied = kind == "qwen2"
    assert_same_tensors(load_out(out), want, skip=("lm_head.weight",) if tied else ())
    logits_equal(out, want, run / "hf_assets")
    v = json.loads((out / "verification.json").read_text())
    assert v["ok"] and v["from_pretrained"]["ok"]
    assert all(t["equal_to_source"] for t in v["tensors"].values())
    assert res.layout == "project" and res.sources[0].name == "step-4"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == ("bfloat16" if kind == "mistral" else "float32")
    assert cfg["architectures"][0].endswith("ForCausalLM") and not cfg["architectures"][0].startswith("FSDP")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    if tied:
        assert v["tied_lm_head"] == {"dropped": "lm_head.weight", "kept": "model.embed_tokens.weight", "identical": True}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=False).strip() == "w1 w2"


def test_cli_step_and_dtype(trained, tmp_path):
    run = trained / "llama"
    out = tmp_path / "bf16"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run / "checkpoints"), str(out),
                           "--step", "2", "--dtype", "bf16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # stderr is a pipe here, as in a Slurm log: progress is a log line per quarter, no bar's carriage returns
    assert [f"consolidate: {q}%" in proc.stderr for q in (25, 50, 75, 100)] == [True] * 4, proc.stderr
    assert "B/s" not in proc.stderr and "consolidate:" not in "".join(
        line for line in proc.stderr.split("\n") if "\r" in line), proc.stderr
    got = load_out(out)
    want = {k: v.to(torch.bfloat16) for k, v in expected(run, 2).items()}
    assert_same_tensors(got, want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True and summary["sources"][0].endswith("step-2")


def test_step_dir_and_sharded_output(trained, tmp_path):
    run = trained / "mistral"
    out = tmp_path / "sharded"
    res = consolidate(run / "checkpoints" / "step-4", out, max_shard_size="20KB", progress=False)
    assert len(res.files) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected(run, 4))
    assert_same_tensors(load_out(out), expected(run, 4))
    logits_equal(out, expected(run, 4), run / "hf_assets")


def test_architecture_cache_gives_the_same_verification(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_WORKFLOW_CACHE", str(tmp_path / "cache"))
    # Llama is answered by the torch-free config rules, which need no cache: take them away.
    monkeypatch.setattr("fsdp_workflow.consolidate.verify.architecture_rules.FAMILIES", {})
    run = trained / "llama"
    first = consolidate(run, tmp_path / "a", progress=False).verification
    second = consolidate(run, tmp_path / "b", progress=False).verification
    assert "expected keys taken from the architecture cache" not in first["architecture"]["notes"]
    assert "expected keys taken from the architecture cache" in second["architecture"]["notes"]
    assert first["keys"] == second["keys"] and first["tensors"] == second["tensors"]
    monkeypatch.setenv("FSDP_WORKFLOW_NO_CACHE", "1")
    third = consolidate(run, tmp_path / "c", progress=False).verification
    assert "expected keys taken from the architecture cache" not in third["architecture"]["notes"]
