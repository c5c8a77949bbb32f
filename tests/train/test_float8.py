"""``train.float8``: which linear layers convert, the trainer's refusals, and torchao's conversion on CPU.

The layer filter and the refusals need neither torchao nor a GPU. The conversion
test runs torchao's ``convert_to_float8_training`` through the trainer's
``float8.convert`` on a CPU Llama whose shapes exercise every branch of the
filter; it needs torchao, which is an optional extra (``fsdp_workflow[float8]``)
and is kept out of the CI environment (tests/cli/test_strict_config.py needs it
absent), so there it is skipped. To run it::

    pip install --target /tmp/torchao --no-deps torchao
    PYTHONPATH=$PWD:/tmp/torchao python -m pytest -n 0 -q tests/train/test_float8.py

What only a GPU can show (the float8 matmuls, the loss against bf16, the speed)
is listed under "Owed on a GPU" in docs/training.md.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from fsdp_workflow.train import float8
from fsdp_workflow.train.mesh import StrategyError


@pytest.mark.parametrize("fqn, k, n, converts", [
    ("model.layers.0.self_attn.q_proj", 2048, 2048, True),
    ("model.layers.0.mlp.down_proj", 8192, 2048, True),
    ("model.layers.0.self_attn.k_proj", 4096, 1024, False),  # GQA's K/V at 4096: N <= 1024 and K <= 4096
    ("model.layers.0.self_attn.k_proj", 4096, 1040, True),  # one step past the small-GEMM corner
    ("model.layers.0.self_attn.k_proj", 4112, 1024, True),
    ("model.layers.0.mlp.up_proj", 2048, 4104, False),  # 4104 is not a multiple of 16
    ("lm_head", 4096, 128256, False),  # the output projection stays in bf16
])
def test_filter_keeps_lm_head_odd_and_small_layers_in_high_precision(fqn: str, k: int, n: int, converts: bool) -> None:
    layer = nn.Linear(k, n, bias=False, device="meta")
    assert float8.converts(layer, fqn) is converts, float8.keeps_high_precision(fqn, layer)


def test_filter_skips_what_is_not_a_linear() -> None:
    assert not float8.converts(nn.Embedding(128256, 4096, device="meta"), "model.embed_tokens")
    assert not float8.converts(nn.LayerNorm(4096, device="meta"), "model.norm")


def test_refused_on_cpu_with_the_reason() -> None:
    with pytest.raises(StrategyError, match=r"compute capability >= 8\.9.*train\.float8=false"):
        float8.check_available(torch.device("cpu"))


def test_refused_on_a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(StrategyError, match=r"A100-SXM4-80GB has compute capability 8\.0, below the 8\.9"):
        float8.check_available(torch.device("cuda", 0))


def test_refused_without_torchao_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(StrategyError, match=r"pip install 'fsdp_workflow\[float8\]'"):
        float8.check_available(torch.device("cuda", 0))
    with pytest.raises(StrategyError, match="torchao"):
        float8.convert(nn.Linear(32, 32))


def test_conversion_on_cpu_swaps_exactly_the_filtered_layers() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is the optional float8 extra (see this module's docstring)")
    from torchao.float8.float8_linear import Float8Linear
    from transformers import LlamaConfig, LlamaForCausalLM

    # hidden 2048, 16 heads of 128, 4 KV heads: K/V are 2048 -> 512 (small); the MLP is 2048 -> 4096.
    config = LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=4096, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    names = float8.convert(model)
    prefix = "model.layers.0."
    assert sorted(names) == sorted(prefix + p for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                       "mlp.up_proj", "mlp.down_proj"))
    kinds = {fqn: type(m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {fqn for fqn, kind in kinds.items() if issubclass(kind, Float8Linear)} == set(names)
    assert kinds["lm_head"] is nn.Linear and kinds[prefix + "self_attn.k_proj"] is nn.Linear
    # The weights keep their names and high precision: checkpoints and consolidation do not change.
    assert "model.layers.0.mlp.up_proj.weight" in model.state_dict()
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
