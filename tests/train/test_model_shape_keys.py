"""The model shape keys reach the model the trainer builds (random init): none is a dead knob."""

from __future__ import annotations

import pytest

from fsdp_workflow.config.load import compose
from fsdp_workflow.train.model import build_hf_config, build_model

SHAPE = {
    "vocab_size": 300, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 3, "max_position_embeddings": 1024,
}


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_every_shape_key_reaches_the_built_model(model: str) -> None:
    cfg = compose(["+experiment=smoke", f"model={model}", *(f"model.{k}={v}" for k, v in SHAPE.items())])
    hf = build_hf_config(cfg.model)
    assert {k: getattr(hf, k) for k in SHAPE} == SHAPE
    net = build_model(cfg.model, seed=0, meta=True)
    assert net.get_input_embeddings().weight.shape == (SHAPE["vocab_size"], SHAPE["hidden_size"])
    assert len(net.model.layers) == SHAPE["num_hidden_layers"]
    attn, mlp = net.model.layers[0].self_attn, net.model.layers[0].mlp
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    assert attn.k_proj.weight.shape[0] == SHAPE["num_key_value_heads"] * head_dim
    assert mlp.up_proj.weight.shape == (SHAPE["intermediate_size"], SHAPE["hidden_size"])
