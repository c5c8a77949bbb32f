"""Parameter counts from the model's config (no torch): total, and active per token for MoE.

Below both the planner's memory estimate and the validation rules that size
the consolidation and evaluation jobs, so the two agree. The count reads the
config the trainer will build (:func:`fsdp_workflow.config.model_dir.effective_config`:
a directory's ``config.json``, or the shape fields), so a pretrained Qwen3 is
counted as Qwen3, with its head_dim, q/k norms, experts and tie.
tests/config/test_model_size.py compares it with real models of every family
of the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from fsdp_workflow.config.schema import ModelConfig

# Families whose MLP is two matrices (up, down) rather than the gated three.
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "phi", "starcoder2", "falcon", "gpt_bigcode", "bloom"}
# Families with q/k projections carrying a bias (Qwen2 hard-codes it; others read attention_bias).
_QKV_BIAS = {"qwen2", "qwen2_moe"}
# RMSNorms per decoder layer (input + post-attention unless listed).
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "olmo2": 2}
# q/k norms: over one head (per_head) or over all heads of the projection.
_QK_NORM = {"qwen3": "per_head", "qwen3_moe": "per_head", "gemma3_text": "per_head", "olmo2": "all", "olmoe": "all"}


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter, every expert
    active: int  # what one token uses (total for a dense model)


def _int(config: Dict[str, Any], key: str, default: int = 0) -> int:
    value = config.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def count_config(config: Dict[str, Any]) -> ParamCount:
    """Parameters of the decoder-only causal LM that ``config`` (a transformers config as a dict) describes."""
    from fsdp_workflow.config.model_dir import experts

    kind = str(config.get("model_type", ""))
    h, v, layers = _int(config, "hidden_size"), _int(config, "vocab_size"), _int(config, "num_hidden_layers")
    heads = max(_int(config, "num_attention_heads", 1), 1)
    kv = _int(config, "num_key_value_heads", heads) or heads
    hd = _int(config, "head_dim") or h // heads
    q, k = heads * hd, kv * hd
    attn = h * q + 2 * h * k + q * h
    if kind in _QKV_BIAS or config.get("attention_bias"):
        attn += q + 2 * k + (h if config.get("attention_bias") else 0)
    qk = _QK_NORM.get(kind)
    attn += 2 * hd if qk == "per_head" else (q + k if qk == "all" else 0)
    norms = _NORMS_PER_LAYER.get(kind, 2) * h
    mats = 2 if kind in _UNGATED else 3
    dense_mlp = mats * h * _int(config, "intermediate_size")
    n_exp, k_exp = experts(config)
    moe_layers = 0
    if n_exp:
        sparse_step = _int(config, "decoder_sparse_step", 1) or 1
        dense_only = set(config.get("mlp_only_layers") or [])
        first_dense = _int(config, "first_k_dense_replace")
        moe_layers = sum(1 for i in range(layers)
                         if i not in dense_only and i >= first_dense and (i + 1) % sparse_step == 0)
    expert_i = _int(config, "moe_intermediate_size") or _int(config, "intermediate_size")
    expert = mats * h * expert_i
    shared_i = _int(config, "shared_expert_intermediate_size")
    shared = (mats * h * shared_i + h) if shared_i else 0  # the shared expert and its gate
    router = h * n_exp
    dense_layers = layers - moe_layers
    body_total = layers * (attn + norms) + dense_layers * dense_mlp + moe_layers * (n_exp * expert + router + shared)
    body_active = layers * (attn + norms) + dense_layers * dense_mlp + moe_layers * (k_exp * expert + router + shared)
    embed = v * h * (1 if config.get("tie_word_embeddings") else 2) + h  # + the final norm
    return ParamCount(body_total + embed, body_active + embed)


def count_params(m: ModelConfig) -> ParamCount:
    """Total and active parameters of the model ``m`` describes (its directory's config when it has one)."""
    from fsdp_workflow.config.model_dir import effective_config

    return count_config(effective_config(m))


def num_params(m: ModelConfig) -> int:
    """Every parameter of the model (every expert of an MoE): what memory and the merge must hold."""
    return count_params(m).total
