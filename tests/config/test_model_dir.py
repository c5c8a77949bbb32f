"""Planning from a model directory: the planner's torch-free reading agrees with transformers itself.

Every family is built here with transformers (tiny sizes, CPU) and compared with
what :mod:`fsdp_workflow.config.hf_source` and :mod:`fsdp_workflow.config.model_size`
read from source files and JSON alone: the causal LM class, the decoder layer
class FSDP wraps, SDPA support, and the parameter count (total and, for MoE,
active) — exactly, and again from a ``config.json`` stripped of every key equal
to the class default (hub files written by other versions leave such keys out).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from fsdp_workflow.config import hf_source
from fsdp_workflow.config.model_dir import experts
from fsdp_workflow.config.model_size import count_config

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
# model_type -> what a real model of the family sets beyond TINY (tie, head_dim, experts, soft-capping).
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      mlp_only_layers=[0]),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=16),
    "phi3": dict(),
    "olmo2": dict(),
    "smollm3": dict(tie_word_embeddings=True),
    "granite": dict(),
}


def _built(kind: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **{**TINY, **FAMILIES[kind]})
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def built() -> Dict[str, Any]:
    return {kind: _built(kind) for kind in FAMILIES}


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_family_is_read_as_transformers_builds_it(built, kind: str) -> None:
    config, model = built[kind]
    fam = hf_source.family(kind)
    assert fam.read_from.endswith(".py"), f"{kind}: read from {fam.read_from}, not transformers' source"
    assert fam.causal_lm == type(model).__name__
    real_layers = [n for n in model._no_split_modules if n.endswith("DecoderLayer")] or list(model._no_split_modules)
    assert fam.layers == real_layers
    assert ("sdpa" in fam.attention) == bool(type(model)._supports_sdpa)
    assert ("flash_attention_2" in fam.attention) == bool(type(model)._supports_flash_attn)
    if kind in hf_source.KNOWN_LAYERS:  # the fallback table says the same as the source
        assert [hf_source.KNOWN_LAYERS[kind]] == real_layers


def _real_counts(model, config) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    n, k = experts(config.to_dict())
    if not n:
        return total, total
    # Expert weights are stacked per layer ([experts, ...]) or one module per expert; either way
    # a token uses k/n of them.
    expert_params = sum(p.numel() for name, p in model.named_parameters()
                        if ".experts." in name or name.endswith(".experts") or ".experts" in name)
    return total, total - expert_params * (n - k) // n


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_parameter_count_is_exact(built, kind: str, tmp_path: Path) -> None:
    config, model = built[kind]
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    total, active = _real_counts(model, config)
    got = count_config(written)
    assert (got.total, got.active) == (total, active)
    # A config.json that leaves out every key equal to the class default counts the same.
    defaults = hf_source.config_defaults(kind)
    sparse = {k: v for k, v in written.items() if k == "model_type" or defaults.get(k, object()) != v}
    assert len(sparse) < len(written), "nothing was left out: the defaults were not read"
    assert count_config({**defaults, **sparse}) == got


def test_a_model_type_transformers_lacks_is_unknown() -> None:
    assert hf_source.known_model_type("llama")
    assert not hf_source.known_model_type("qwen9")
    assert hf_source.family("qwen9").layers == []


def test_remote_code_is_read_from_the_directory(tmp_path: Path) -> None:
    (tmp_path / "modeling_mine.py").write_text(
        "class MineBlock: pass\n"
        "class MinePreTrainedModel:\n    _no_split_modules = ['MineBlock']\n    _supports_sdpa = True\n"
        "class MineForCausalLM(MinePreTrainedModel):\n    pass\n")
    fam = hf_source.family("mine", (str(tmp_path), "modeling_mine.MineForCausalLM"))
    assert (fam.causal_lm, fam.layers) == ("MineForCausalLM", ["MineBlock"])
    assert "sdpa" in fam.attention and "flash_attention_2" not in fam.attention
