"""Parameter count from the model's shape fields (no torch).

Below both the planner's memory estimate and the validation rules that size
the consolidation and evaluation jobs, so the two agree.
"""

from __future__ import annotations

from fsdp_workflow.config.schema import ModelConfig


def num_params(m: ModelConfig) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2) from its shapes."""
    h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
    head_dim = h // max(m.num_attention_heads, 1)
    kv = m.num_key_value_heads * head_dim
    attn = 2 * h * h + 2 * h * kv  # q, o and k, v projections
    if m.model_type == "qwen2":
        attn += h + 2 * kv  # q/k/v biases
    per_layer = attn + 3 * h * i + 2 * h
    embed = v * h * (1 if m.tie_word_embeddings else 2)
    return m.num_hidden_layers * per_layer + embed + h
