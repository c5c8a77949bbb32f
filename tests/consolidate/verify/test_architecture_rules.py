"""The torch-free architecture rules agree with transformers' own meta-device instantiation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.consolidate.verify import architecture_rules as arch_rules
from fsdp_workflow.consolidate.verify.architecture import _expected_from_config, cached_expected
from fsdp_workflow.consolidate.verify.architecture_rules import class_resolves, expected_from_rules

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

GRID = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    ("llama", {"head_dim": 32, "num_key_value_heads": 1}),
    ("llama", {"attention_bias": True}),
    ("llama", {"mlp_bias": True, "attention_bias": True, "head_dim": 8, "tie_word_embeddings": True}),
    ("llama", {"head_dim": None, "num_key_value_heads": None, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    ("qwen2", {"num_key_value_heads": 4}),
    ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    ("qwen2", {"num_key_value_heads": 2, "head_dim": 24, "use_sliding_window": True, "sliding_window": 8,
               "max_window_layers": 1}),
    ("mistral", {"num_key_value_heads": 2, "sliding_window": 16}),
    ("mistral", {"num_key_value_heads": 1, "head_dim": 24, "tie_word_embeddings": True}),
    ("mistral", {"num_key_value_heads": 4, "head_dim": None, "sliding_window": None}),
]


def _write(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _assert_same(tmp_path: Path, cfg: dict, archs: list[str], wrapper: bool = False) -> None:
    ruled, why = expected_from_rules(cfg, archs, wrapper)
    assert ruled is not None, why
    ref = _expected_from_config(_write(tmp_path, cfg), archs)
    assert ref.error is None
    assert ruled.architecture == ref.architecture
    assert ruled.expected == ref.expected
    assert ruled.optional == ref.optional


@pytest.mark.parametrize("model_type,extra", GRID, ids=[f"{m}-{i}" for i, (m, _) in enumerate(GRID)])
def test_rules_match_transformers(tmp_path, model_type, extra):
    cfg = {**BASE, "model_type": model_type, "architectures": [ARCH[model_type]], **extra}
    _assert_same(tmp_path, cfg, [ARCH[model_type]])


@pytest.mark.parametrize("model_type", sorted(ARCH))
def test_rules_answer_for_configs_transformers_writes(tmp_path, model_type):
    """A config.json from save_pretrained (every default written out) is understood, not deferred."""
    from transformers import CONFIG_MAPPING

    kw = {**BASE, "num_key_value_heads": 2, "tie_word_embeddings": model_type == "qwen2"}
    CONFIG_MAPPING[model_type](**kw, architectures=[ARCH[model_type]]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    _assert_same(tmp_path, cfg, [ARCH[model_type]])


def test_wrapper_architecture_resolved_from_model_type(tmp_path):
    cfg = {**BASE, "model_type": "qwen2", "num_key_value_heads": 2, "architectures": ["FullyShardedDataParallel"]}
    _assert_same(tmp_path, cfg, ["FullyShardedDataParallel"], wrapper=True)


def test_class_resolves_reads_modeling_file():
    for model_type, name in ARCH.items():
        assert class_resolves(model_type, name)
    assert not class_resolves("llama", "LlamaForCausalLMX")
    assert not class_resolves("llama", "LlamaRMSNorm")  # a class, but not exported in __all__
    assert not class_resolves("no_such_model", "NoSuchForCausalLM")


@pytest.mark.parametrize("model_type,extra,archs", [
    ("mixtral", {"num_local_experts": 8}, ["MixtralForCausalLM"]),  # no rule for the model type
    ("llama", {"num_experts": 8}, None),  # MoE key the rules do not know
    ("qwen2", {"layer_norm_eps": 1e-6, "num_key_value_heads": 2}, None),  # any unknown key
    ("mistral", {"num_key_value_heads": 3}, None),  # does not divide the heads
    ("llama", {"hidden_size": 66}, None),  # hidden not divisible by heads
    ("qwen2", {}, None),  # num_key_value_heads absent: class default is 32, not the heads
    ("qwen2", {"num_key_value_heads": 2, "head_dim": None}, None),  # Qwen2 reads head_dim as given
    ("llama", {"attention_bias": "yes"}, None),
    ("llama", {"hidden_act": "my_act"}, None),
    ("llama", {"rope_scaling": {"rope_type": "new_kind"}}, None),
    ("llama", {}, ["MistralForCausalLM"]),  # architecture and model_type disagree
    ("llama", {}, ["LlamaForCausalLM", "LlamaForSequenceClassification"]),
])
def test_rules_unsure(model_type, extra, archs):
    archs = archs or [ARCH[model_type]]
    cfg = {**BASE, "model_type": model_type, "architectures": archs, **extra}
    ruled, why = expected_from_rules(cfg, archs, False)
    assert ruled is None and why


def test_rules_unsure_for_another_transformers_major(monkeypatch):
    monkeypatch.setattr(arch_rules, "SUPPORTED_TRANSFORMERS_MAJOR", 99)
    ruled, why = expected_from_rules({**BASE, "model_type": "llama"}, ["LlamaForCausalLM"], False)
    assert ruled is None and "transformers 99.x" in why


def test_transformers_major_read_from_the_package_agrees_with_its_metadata(tmp_path, monkeypatch):
    import importlib.metadata

    assert arch_rules.transformers_major() == int(importlib.metadata.version("transformers").split(".")[0])
    (tmp_path / "__init__.py").write_text('"""doc"""\n__version__ = "7.0.1.dev0"\n')
    monkeypatch.setattr(arch_rules, "_transformers_files", lambda: tmp_path)
    assert arch_rules.transformers_major() == 7
    (tmp_path / "__init__.py").write_text("from .version import __version__\n")
    assert arch_rules.transformers_major() is None
    ruled, why = expected_from_rules({**BASE, "model_type": "llama"}, ["LlamaForCausalLM"], False)
    assert ruled is None and why == "transformers version unknown"


def test_unknown_architecture_falls_back_to_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_WORKFLOW_NO_CACHE", "1")
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 1, "n_head": 2,
           "vocab_size": 50, "n_positions": 16}
    res = cached_expected(_write(tmp_path, cfg), ["GPT2LMHeadModel"])
    assert res.error is None and "transformer.h.0.attn.c_attn.weight" in res.expected
    assert any("config rules unsure (no rule for model_type 'gpt2')" in n for n in res.notes)


def test_unsure_rule_falls_back_and_fallback_still_catches_bad_names(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_WORKFLOW_NO_CACHE", "1")
    cfg = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "some_new_field": 1}
    res = cached_expected(_write(tmp_path, cfg), ["LlamaForCausalLM"])
    assert res.error is None and "model.layers.1.mlp.up_proj.weight" in res.expected
    assert any("config keys the rules do not know: ['some_new_field']" in n for n in res.notes)
    cfg["architectures"] = ["LlamaForCausalLMX"]
    bad = cached_expected(_write(tmp_path, cfg), ["LlamaForCausalLMX"])
    assert bad.error and "does not resolve" in bad.error


def test_rule_path_imports_neither_torch_nor_transformers(tmp_path):
    cfg = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    _write(tmp_path, cfg)
    code = ("import sys; from pathlib import Path; from fsdp_workflow.consolidate.verify.architecture import cached_expected; "
            f"r = cached_expected(Path({str(tmp_path)!r}), ['LlamaForCausalLM']); "
            "assert r.error is None and len(r.expected) == 21, r; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"FSDP_WORKFLOW_NO_CACHE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
