"""The shippable extras of a consolidation: model card, licence files, the index's metadata.

A run directory is built in tmp the way the planner and the trainer leave it (config.yaml,
metrics.jsonl, evals.jsonl, hf_assets/, checkpoints/step-N/ saved by DCP from a real tiny
Llama), consolidated with :func:`consolidate`, and the card and licences are added as the
consolidator's commit step adds them.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_workflow.consolidate import consolidate
from fsdp_workflow.consolidate.card import CURVE_FILE, read_run_facts, write_model_card
from fsdp_workflow.consolidate.hf_assets import (
    CARD_FILE,
    copy_licenses,
    front_matter,
    index_metadata,
    index_text,
    licence_files,
    licence_metadata,
)
from fsdp_workflow.consolidate.source import Selection, resolve_source
from fsdp_workflow.consolidate.steps import plan_output
from fsdp_workflow.core.rundir import RunDir

from .layouts import save

LLAMA31 = "LLAMA 3.1 COMMUNITY LICENSE AGREEMENT\nLlama 3.1 Version Release Date: July 23, 2024\n\n\"Agreement\" means...\n"
APACHE = "\n                                 Apache License\n                           Version 2.0, January 2004\n"
MIT = "MIT License\n\nCopyright (c) Someone\n\nPermission is hereby granted, free of charge, to any person...\n"
QWEN = "Qwen LICENSE AGREEMENT\n\nQwen LICENSE AGREEMENT Release Date: September 19, 2024\n"


def tiny_model(tied: bool) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def run_config(base: str, **data: object) -> dict:
    """The sections of config.yaml the card reads, as the planner writes them."""
    return {
        "model": {"name": "tiny", "init": "pretrained", "name_or_path": base},
        "data": {"source": "jsonl", "path": "/data/sft.jsonl", "format": "conversation", "train_on": "assistant",
                 "eval_path": None, "eval_fraction": 0.05, **data},
        "strategy": {"name": "fsdp2"},
        "optimizer": {"name": "adamw", "lr": 1e-5, "scheduler": "cosine", "warmup_steps": 2},
        "cluster": {"nodes": 2, "processes_per_node": 8, "log_dir": None},
        "train": {"max_steps": 5, "seq_len": 64, "global_batch_size": 8, "mixed_precision": "bf16"},
        "consolidate": {"output_dir": None},
        "name": "tiny-sft",
    }


def metric(step: int, loss: float, tokens: int, **extra: object) -> str:
    return json.dumps({"time": 1.0, "step": step, "loss": loss, "lr": 1e-5, "trained_tokens": tokens, **extra})


def make_run(root: Path, model: LlamaForCausalLM, *, base: str = "/nonexistent/base", licence: str | None = LLAMA31,
             metrics: list[str] | None = None, step: int = 4) -> RunDir:
    """A run directory as the trainer leaves it after step ``step`` (plus a later step, not consolidated)."""
    run = RunDir(root)
    root.mkdir(parents=True)
    run.config.write_text(yaml.safe_dump(run_config(base)))
    run.provenance.write_text(json.dumps({"git_revision": "abc123", "command": ["x"]}))
    lines = metrics if metrics is not None else [
        metric(1, 3.0, 100), metric(2, 2.5, 110), metric(3, 9.9, 999),
        "{\"step\": 4, \"lo",  # torn by a crash, then the resume redid step 3
        metric(3, 2.25, 120, eval_loss=2.4), metric(4, 2.125, 130), metric(5, 1.5, 140),
    ]
    run.metrics.write_text("\n".join(lines) + "\n")
    run.evals_file.write_text(json.dumps({"step": 4, "status": "ok", "perplexity": 8.5, "loss": 2.14,
                                          "num_tokens": 512}) + "\n")
    model.config.save_pretrained(run.hf_assets)
    (run.hf_assets / "tokenizer_config.json").write_text("{}")
    if licence is not None:
        (run.hf_assets / "LICENSE").write_text(licence)
        (run.hf_assets / "USE_POLICY.md").write_text("# Acceptable use\n")
    save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, run.step_dir(step))
    return run


def ship(run_or_src: Path, out: Path, **kwargs: object) -> Path:
    """consolidate() as the CLI and the chain run it: the card and the licences come with the model."""
    consolidate(run_or_src, out, progress=False, **kwargs)  # type: ignore[arg-type]
    return out / CARD_FILE


# ---------------------------------------------------------------- the card of a project run
def test_card_of_a_project_run(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=True))
    card_path = ship(run.root, tmp_path / "out")
    card = ModelCard.load(card_path)  # huggingface_hub parses and checks the front matter
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["license"] == "llama3.1" and "license_name" not in data
    assert data["tags"] == ["fsdp_workflow"]
    assert "base_model" not in data  # a local directory is not a Hub id
    assert sorted(p.name for p in licence_files(tmp_path / "out")) == ["LICENSE", "USE_POLICY.md"]
    text = card.text
    assert "| steps trained | 4 of `train.max_steps=5` |" in text
    assert "| tokens trained | 460 " in text  # 100 + 110 + 120 (the redone step 3) + 130; step 5 not consolidated
    assert "| final training loss | 2.1250 (step 4) |" in text
    assert "| held-out loss during training | 2.4000 (step 3) |" in text
    assert "| held-out perplexity | 8.500 (loss 2.1400, 512 tokens; evals.jsonl, step 4) |" in text
    assert f"`{run.config}`" in text
    assert "`/nonexistent/base`" in text and "fsdp2, 2 node(s) x 8 processes" in text
    assert "loss on `assistant` tokens" in text and "`abc123`" in text
    assert "[LICENSE](LICENSE), [USE_POLICY.md](USE_POLICY.md)" in text
    assert f"| parameters | {tiny_model(tied=True).num_parameters():,} " in text
    assert f'AutoTokenizer.from_pretrained("{tmp_path / "out"}")' in text
    # the loss curve beside the card, steps 1-4 only: 640x360 pixels
    png = (tmp_path / "out" / CURVE_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (640, 360)
    assert f"![Training loss by step (eval loss as dots)]({CURVE_FILE})" in text


def test_the_curve_needs_no_matplotlib(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it fails: it is not used
    assert write_model_card(out, [run.step_dir(4)], run.hf_assets, {}) is None
    png = (out / CURVE_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and zlib.crc32(png[12:29]) == struct.unpack(">I", png[29:33])[0]
    assert CURVE_FILE in (out / CARD_FILE).read_text()


def test_no_metrics_no_image(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    run.metrics.unlink()
    out = tmp_path / "out"
    out.mkdir()
    assert write_model_card(out, [run.step_dir(4)], run.hf_assets, {}) is None
    assert sorted(p.name for p in out.iterdir()) == [CARD_FILE]


def test_facts_stop_at_the_consolidated_step_and_need_every_step_for_tokens(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False),
                   metrics=[metric(1, 3.0, 100), metric(3, 2.0, 120), metric(4, 1.75, 130)])
    facts = read_run_facts(run.root, [4])
    assert facts.final_loss == 1.75 and facts.steps_logged == 3
    assert facts.trained_tokens is None  # step 2 has no line: no total rather than a wrong one
    card = ship(run.root, tmp_path / "out").read_text()
    assert "| tokens trained | unknown (metrics.jsonl records 3 of steps 1-4) |" in card
    two = read_run_facts(run.root, [1, 3])
    assert two.final_loss == 2.0 and two.trained_tokens is None


def test_averaged_steps_report_the_last_one(tmp_path):
    model = tiny_model(tied=False)
    run = make_run(tmp_path / "run", model)
    save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, run.step_dir(3))
    card = ship(run.root, tmp_path / "out", steps=[3, 4]).read_text()
    assert "weights averaged over steps 3, 4" in card and "| final training loss | 2.1250 (step 4) |" in card


def test_licences_from_the_base_model_directory(tmp_path):
    """hf_assets/ without licence files: they and the declared licence come from model.name_or_path."""
    base = tmp_path / "hub" / "models--Qwen--Qwen2.5-3B" / "snapshots" / "0123abc"
    base.mkdir(parents=True)
    (base / "LICENSE").write_text(QWEN)
    (base / CARD_FILE).write_text("---\nlicense: other\nlicense_name: qwen-research\nlicense_link: "
                                  "https://huggingface.co/Qwen/Qwen2.5-3B/blob/main/LICENSE\n---\n# Qwen\n")
    run = make_run(tmp_path / "run", tiny_model(tied=True), base=str(base), licence=None)
    data = ModelCard.load(ship(run.root, tmp_path / "out")).data.to_dict()
    assert data["base_model"] == "Qwen/Qwen2.5-3B"  # read from the huggingface_hub cache path
    assert data["license"] == "other" and data["license_name"] == "qwen-research"  # the base card wins
    assert data["license_link"].startswith("https://")
    assert (tmp_path / "out" / "LICENSE").read_text() == QWEN


def test_random_init_has_no_base_model(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False), licence=None)
    cfg = yaml.safe_load(run.config.read_text())
    cfg["model"]["init"] = "random"
    run.config.write_text(yaml.safe_dump(cfg))
    card = ModelCard.load(ship(run.root, tmp_path / "out"))
    assert "base_model" not in card.data.to_dict() and "license" not in card.data.to_dict()
    assert "random initialisation" in card.text and "Unknown: no licence was found" in card.text


# ---------------------------------------------------------------- not a project run
def test_card_of_a_plain_dcp_checkpoint_invents_nothing(tmp_path):
    model = tiny_model(tied=False)
    ref = tmp_path / "base"
    model.config.save_pretrained(ref)
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    (ref / "LICENSE.txt").write_text(APACHE)
    src = save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, tmp_path / "ckpt" / "step-7")
    card = ModelCard.load(ship(src, tmp_path / "out", reference=ref))
    data = card.data.to_dict()
    assert data["base_model"] == "meta-llama/Llama-3.1-8B" and data["license"] == "apache-2.0"
    assert f"`{src}`" in card.text
    assert "| training facts | unknown (the checkpoint is not in an fsdp_workflow run directory) |" in card.text
    assert "loss" not in card.text and "tokens trained" not in card.text
    assert "AutoModelForCausalLM.from_pretrained" in card.text and "AutoTokenizer" not in card.text


def test_card_without_reference_or_run(tmp_path):
    """Weights only (no config.json): no library_name, nothing but the source."""
    out = tmp_path / "out"
    out.mkdir()
    assert write_model_card(out, [tmp_path / "x" / "checkpoint-3"], None, {"ok": True, "layout": "dcp"}) is None
    card = ModelCard.load(out / CARD_FILE)
    assert card.data.to_dict() == {"tags": ["fsdp_workflow"]}
    assert "| base model | unknown |" in card.text and "| checkpoint | step 3 |" in card.text
    assert "## Use" not in card.text


def test_a_broken_run_directory_still_gives_a_card(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    run.config.write_text("model: [unclosed\n")  # not YAML
    run.metrics.write_text("\x00garbage\n[1, 2]\n{\"step\": \"four\"}\n")
    run.evals_file.mkdir() if not run.evals_file.exists() else run.evals_file.unlink()
    out = tmp_path / "out"
    out.mkdir()
    assert write_model_card(out, [run.step_dir(4)], run.hf_assets, {}) is None
    text = (out / CARD_FILE).read_text()
    assert "| final training loss | unknown |" in text and "| tokens trained | unknown (metrics.jsonl records 0" in text


def test_write_model_card_reports_instead_of_raising(tmp_path):
    note = write_model_card(tmp_path / "missing" / "out", [], None, {})
    assert note is not None and note.startswith("model card not written: FileNotFoundError")


# ---------------------------------------------------------------- licences
@pytest.mark.parametrize("text, want", [
    (LLAMA31, {"license": "llama3.1"}),
    ("META LLAMA 3 COMMUNITY LICENSE AGREEMENT\nMeta Llama 3 Version Release Date: April 18, 2024", {"license": "llama3"}),
    ("LLAMA 2 COMMUNITY LICENSE AGREEMENT\t\nLlama 2 Version Release Date: July 18, 2023", {"license": "llama2"}),
    ("LLAMA 3.2 COMMUNITY LICENSE AGREEMENT\n\nLlama 3.2 Version Release Date: September 25, 2024", {"license": "llama3.2"}),
    (APACHE, {"license": "apache-2.0"}),
    (MIT, {"license": "mit"}),
    (QWEN, {"license": "other", "license_name": "qwen", "license_link": "LICENSE"}),
    ("Some Lab Model Licence v1\nYou may ...", {"license": "other", "license_link": "LICENSE"}),
])
def test_licence_recognised_by_title(tmp_path, text, want):
    (tmp_path / "LICENSE").write_text(text)
    assert licence_metadata(tmp_path, []) == want


def test_conflicting_licence_files_give_no_licence(tmp_path):
    (tmp_path / "LICENSE").write_text(APACHE)
    (tmp_path / "LICENSE-MODEL").write_text(LLAMA31)
    assert licence_metadata(tmp_path, []) == {}
    assert licence_metadata(tmp_path / "none", []) == {}


def test_declared_licence_link_to_a_missing_file_is_dropped(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / CARD_FILE).write_text("---\nlicense: other\nlicense_name: acme\nlicense_link: LICENSE.md\n---\n")
    assert front_matter(base / CARD_FILE)["license_name"] == "acme"
    assert licence_metadata(tmp_path, [base]) == {"license": "other", "license_name": "acme"}


def test_copy_licenses_takes_one_source_and_only_licence_names(tmp_path):
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for d in (first, second, out):
        d.mkdir()
    names = ["LICENSE.txt", "USE_POLICY.md", "NOTICE", "notice.txt", "LICENSE-MODEL", "Licence.md", "COPYING"]
    for n in names + ["license_utils.py", "README.md", "config.json", "LICENSE.json"]:
        (second / n).write_text(n)
    (second / "LICENSE").mkdir()  # not a file
    (first / "tokenizer.json").write_text("{}")
    (out / "NOTICE").write_text("kept")
    copied = copy_licenses([None, tmp_path / "missing", first, second], out)
    assert sorted(copied) == sorted(set(names) - {"NOTICE"})
    assert (out / "NOTICE").read_text() == "kept"
    assert copy_licenses(first, tmp_path) == [] and copy_licenses(None, out) == []


# ---------------------------------------------------------------- model.safetensors.index.json
@pytest.mark.parametrize("tied", [True, False])
def test_index_metadata_is_what_save_pretrained_writes(tmp_path, tied):
    """transformers 5: total_size = bytes of the tensors written (tied alias dropped), total_parameters alongside."""
    model = tiny_model(tied)
    hf = tmp_path / "hf"
    model.save_pretrained(hf, max_shard_size="8KB")
    index_file = hf / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert len(set(index["weight_map"].values())) > 1
    written = []
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(hf / name), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                written.append((t.numel(), t.nbytes))
    meta = index_metadata(written)
    assert meta == index["metadata"]
    assert index_text(meta, index["weight_map"]) == index_file.read_text()  # byte for byte

    # The consolidator's plan of the same weights (tied lm_head dropped by config.json) gives the same numbers.
    run = tmp_path / "run"
    model.config.save_pretrained(RunDir(run).hf_assets)
    save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, RunDir(run).step_dir(1))
    source = resolve_source(run, tmp_path / "out", Selection())
    try:
        plan = plan_output(source, out_dtype=None, weights=None, max_shard_bytes=8 << 10)
    finally:
        source.close()
    assert sorted(t.name for t in plan.tensors) == sorted(index["weight_map"])
    assert index_metadata((t.sources[0].numel, t.nbytes) for t in plan.tensors) == index["metadata"]
    assert plan.total_bytes == index["metadata"]["total_size"]
