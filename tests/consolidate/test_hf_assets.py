"""The shippable extras the consolidator writes beside the weights: licence files, the index's metadata.

(The model card is the report stage's: tests/report/test_card.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_workflow.consolidate.hf_assets import (
    copy_licenses,
    front_matter,
    index_metadata,
    index_text,
    licence_metadata,
)
from fsdp_workflow.core.modeldir import CARD_FILE
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
