"""Tiny replicas of the model families users fine-tune, as their downloaded directories look.

Each row of :data:`FAMILIES` is one family: the config class's own keys (real key
names: rope scaling, experts, soft-capping, windows, tie) at a tiny shape, the
family's stock chat template (tests/data/templates, verbatim) in a tokenizer that
carries its special tokens, and a vocabulary of a few hundred tokens. :func:`build`
writes what a user has after downloading the real model:

- ``config.json`` spelled as the hub's copies are (written by transformers 4.x:
  ``torch_dtype``, ``rope_theta`` and ``rope_scaling``; checked to load back to the
  same config), with the tokenizer's bos/eos/pad ids;
- ``model.safetensors`` from ``save_pretrained`` in the family's dtype (transformers
  writes the hub's per-expert names for MoE families);
- ``tokenizer.json`` and ``tokenizer_config.json`` holding the chat template, as the
  hub's tokenizers do (no separate ``chat_template.jinja``);
- ``generation_config.json`` with sampling defaults and every end-of-turn id.

A new family is one line of :data:`FAMILIES`. The only knowledge kept outside the
rows is how transformers 4.x spelled rope settings (:func:`hub_config`); a family
whose config needs more says so there.

``python -m tests.families.replicas OUT`` writes every replica under ``OUT``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from tests.data.test_families import FAMILIES as CHAT_FAMILIES
from tests.data.test_families import Family as ChatFamily

# Every replica's shape: 2 decoder layers (a sliding and a global one where the family
# alternates), GQA with 2 KV heads, head_dim 16. Rows override what their family fixes.
SHAPE: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16)
VOCAB_MULTIPLE = 128  # real vocabularies are padded past the tokenizer (Qwen: 151936 for 151665 tokens)
TOKENIZER_VOCAB = 700  # BPE merges trained on the shipped corpus, plus the family's special tokens
SEED = 0
# A base model without a template of its own (the one make_tokenizer writes is removed), whose
# vocabulary holds chatml's markers (as Qwen's base models' do): smoke_chat's fallback, chatml,
# trains and ships. A vocabulary without them is refused at planning (test_template_rule).
NO_TEMPLATE = ChatFamily(template="Qwen-Qwen2.5-7B-Instruct.jinja", specials=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"), eos="<|endoftext|>", bos=None,
                         open="<|im_start|>assistant\n", eot="<|im_end|>")
HUB_TRANSFORMERS_VERSION = "4.51.3"  # what wrote the hub's config.json files of these families


@dataclass(frozen=True)
class Replica:
    """One family of the matrix: what its directory holds, and what the matrix shows about it."""

    name: str  # the family as users call it (docs/models.md)
    real: str  # the real model whose config this copies, at a tiny shape
    model_type: str  # config.json's model_type (transformers' config class)
    chat: Optional[str]  # tests/data/test_families.FAMILIES key (stock template + special tokens); None: no template
    tied: bool  # tie_word_embeddings, as the real one
    config: Mapping[str, Any] = field(default_factory=dict)  # the family's own keys, at the tiny shape
    dtype: str = "bfloat16"  # the real checkpoint's dtype
    pad: Optional[str] = None  # the real tokenizer's pad token (Llama 3 and Mistral have none)
    run: Tuple[str, ...] = ()  # overrides the family's run needs besides the directory; each row says why
    proves: str = ""  # what this row adds to the others (docs/models.md)

    @property
    def key(self) -> str:
        """A name for test ids and directories: ``qwen3-tied``."""
        return self.name.lower().replace(" ", "-").replace("(", "").replace(")", "")

    @property
    def experts(self) -> int:
        """Experts per MoE layer (0: a dense model); Qwen3-MoE and Mixtral spell the key differently."""
        return int(self.config.get("num_experts") or self.config.get("num_local_experts") or 0)

    @property
    def chat_family(self) -> ChatFamily:
        return CHAT_FAMILIES[self.chat] if self.chat else NO_TEMPLATE

    @property
    def template_file(self) -> Optional[str]:
        """The stock template's file under tests/data/templates, or None for a base model without one."""
        return self.chat_family.template if self.chat else None


LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, rope_theta=500000.0)

# fmt: off
FAMILIES: Tuple[Replica, ...] = (
    Replica("Llama 3.1", "meta-llama/Llama-3.1-8B-Instruct", "llama", "llama3.1", tied=False, config=dict(rope_parameters=LLAMA31_ROPE, max_position_embeddings=131072), proves="llama3 rope scaling, untied head"),
    Replica("Llama 3.2", "meta-llama/Llama-3.2-1B-Instruct", "llama", "llama3.2", tied=True, config=dict(rope_parameters={**LLAMA31_ROPE, "factor": 32.0}, max_position_embeddings=131072), proves="tied embeddings under FSDP2"),
    Replica("Qwen2.5", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", "qwen2.5", tied=True, pad="<|endoftext|>", config=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), max_position_embeddings=32768, use_sliding_window=False), proves="q/k/v biases, tied"),
    Replica("Qwen3 (tied)", "Qwen/Qwen3-0.6B", "qwen3", "qwen3", tied=True, pad="<|endoftext|>", config=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), max_position_embeddings=40960), proves="q/k norms, tied, think tokens in the template"),
    Replica("Qwen3 (untied)", "Qwen/Qwen3-8B", "qwen3", "qwen3", tied=False, pad="<|endoftext|>", config=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), max_position_embeddings=40960), proves="the same family untied"),
    Replica("Qwen3-MoE", "Qwen/Qwen3-30B-A3B", "qwen3_moe", "qwen3", tied=False, pad="<|endoftext|>", config=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, rope_parameters=dict(rope_type="default", rope_theta=1000000.0), max_position_embeddings=40960), proves="experts (per-expert names on disk), router"),
    Replica("Mistral", "mistralai/Mistral-7B-Instruct-v0.3", "mistral", "mistral-v0.3", tied=False, config=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0), max_position_embeddings=32768, sliding_window=None), proves="[INST] template"),
    Replica("Mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", "mistral-v0.3", tied=False, config=dict(num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32768), proves="experts under block_sparse_moe names on disk"),
    Replica("Gemma 2", "google/gemma-2-2b-it", "gemma2", "gemma2", tied=True, pad="<pad>", dtype="float32", config=dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=16, sliding_window=4096, max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh"), run=("data.on_bad_record=skip",), proves="logit soft-capping, eager attention, template refusing system turns"),  # run: the shipped chats open 160 of 240 with a system turn, which Gemma 2's template refuses; prepare names them and offers this key
    Replica("Gemma 3 (text)", "google/gemma-3-1b-it", "gemma3_text", "gemma3", tied=True, pad="<pad>", config=dict(query_pre_attn_scalar=16, sliding_window=512, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32768), proves="Gemma3ForCausalLM, local and global rope"),
    Replica("Phi-3", "microsoft/Phi-3-mini-4k-instruct", "phi3", "phi3", tied=False, pad="<|endoftext|>", config=dict(max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047), proves="fused qkv and gate_up projections"),
    Replica("OLMo 2", "allenai/OLMo-2-1124-7B", "olmo2", None, tied=False, pad="<|pad|>", config=dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0), max_position_embeddings=4096), proves="post-norm layers, a base model without a chat template"),
    Replica("Granite-MoE", "ibm-granite/granite-3.0-1b-a400m-base", "granitemoe", None, tied=True, pad="<|pad|>", config=dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.015625, rope_parameters=dict(rope_type="default", rope_theta=10000.0), max_position_embeddings=4096), proves="experts fused on disk under its own names (input_linear, router.layer), which transformers renames in memory; tied"),
)
# fmt: on

BY_KEY: Dict[str, Replica] = {r.key: r for r in FAMILIES}


def hub_config(written: Dict[str, Any]) -> Dict[str, Any]:
    """``config.json`` as transformers 4.x wrote it, from what 5.x writes.

    The hub's files of these families predate transformers 5: they name ``torch_dtype``
    and spell rope as ``rope_theta`` plus ``rope_scaling`` (null for plain rope). Gemma 3
    keeps its local layers' base apart, as ``rope_local_base_freq``: the one family with
    rope per layer type. :func:`build` checks that the result loads back to the same config.
    """
    out = dict(written)
    out["torch_dtype"] = out.pop("dtype")
    rope = out.pop("rope_parameters", None)
    if rope is not None and "rope_type" not in rope:  # per layer type (Gemma 3)
        out["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    if rope is not None:
        rope = dict(rope)
        out["rope_theta"] = rope.pop("rope_theta")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:  # a top-level key then (Phi-3 writes none: 1.0)
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
        rope.pop("partial_rotary_factor", None)
        out["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    out["transformers_version"] = HUB_TRANSFORMERS_VERSION
    return out


def _tokenizer(row: Replica, directory: Path) -> Any:
    """The family's tokenizer with its stock template inside ``tokenizer_config.json``, as on the hub."""
    from transformers import AutoTokenizer

    from tests.data.test_families import make_tokenizer

    make_tokenizer(row.chat_family, directory)
    template = directory / "chat_template.jinja"  # transformers 5 writes it apart; the hub's copies hold it inside
    tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
    if row.chat:
        tok_cfg["chat_template"] = template.read_text()
    template.unlink()
    if row.pad:
        tok_cfg["pad_token"] = row.pad
    tok_cfg.pop("backend", None)  # transformers 5 only
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return AutoTokenizer.from_pretrained(str(directory))


def vocab_size(tokenizer: Any) -> int:
    return -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def build(row: Replica, directory: Path) -> Path:
    """Write ``row``'s replica into ``directory`` (created): weights, config, tokenizer, generation config.

    Returns:
        ``directory``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(row, directory)
    fam = row.chat_family
    ends = [tok.convert_tokens_to_ids(t) for t in dict.fromkeys((fam.eos, fam.eot)) if t in tok.get_vocab()]
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=ends[0] if len(ends) == 1 else ends,
               pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(row.model_type, **SHAPE, vocab_size=vocab_size(tok), tie_word_embeddings=row.tied,
                                  **ids, **row.config)
    config.dtype = row.dtype
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, row.dtype))
    model.generation_config = GenerationConfig(**ids, do_sample=True, temperature=0.6, top_p=0.9)
    model.save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps(hub_config(json.loads(path.read_text())), indent=2) + "\n")
    again = AutoConfig.from_pretrained(str(directory)).to_dict()
    for d in (again, want := config.to_dict()):
        for volatile in ("transformers_version", "_name_or_path"):
            d.pop(volatile, None)
    assert again == want, f"{row.name}: the hub spelling of config.json loads differently: {again} != {want}"
    return directory


def _shapes(directory: Path) -> Dict[str, Tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parameter_count(directory: Path) -> int:
    """The real number of parameters of a replica, from its weights (a tied head is stored once)."""
    return sum(_numel(s) for s in _shapes(directory).values())


# the hub's per-expert names (transformers writes them), or Granite-MoE's experts fused on disk too
_EXPERT = re.compile(r"\.experts\.\d+\.|\.block_sparse_moe\.(input|output)_linear\.")


def active_parameter_count(directory: Path, row: Replica) -> int:
    """Parameters one token uses: every expert's weights count ``k / E`` (the router picks k of E)."""
    if not row.experts:
        return parameter_count(directory)
    share = row.config["num_experts_per_tok"] / row.experts
    return round(sum(_numel(s) * (share if _EXPERT.search(k) else 1) for k, s in _shapes(directory).items()))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for r in FAMILIES:
        print(build(r, root / r.key))
