"""Expected keys and shapes of Llama-family models from config.json alone, without torch.

The architecture check (:mod:`.architecture`) instantiates the model named in config.json on the
meta device, which needs torch + transformers imports that cost seconds, more than the
copy itself. For the decoders users consolidate most (Llama, Mistral, Qwen2 ``*ForCausalLM``)
every parameter name and shape is a pure function of a few config fields, so this module
answers from the JSON in milliseconds. It answers only when it is sure: any model type,
config key or value it does not recognise returns ``None`` with a reason, and the caller
falls back to transformers. ``tests/consolidate/verify/test_architecture_rules.py`` compares these rules
with transformers' own meta-device instantiation so they cannot drift silently.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ArchResult:
    """Expected state-dict keys and shapes of the architecture named in config.json."""

    architecture: str | None = None
    expected: dict[str, tuple] = field(default_factory=dict)
    optional: set[str] = field(default_factory=set)  # tied aliases that may be absent
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Family:
    architecture: str
    qkv_bias: bool | str  # True/False, or the config flag that decides it
    o_bias: bool | str
    mlp_bias: bool | str
    kv_heads_default_is_heads: bool  # absent num_key_value_heads means "= num_attention_heads"
    null_head_dim_ok: bool  # head_dim: null falls back to hidden_size // num_attention_heads
    extra_keys: frozenset[str]  # model-specific config keys that add no parameters


# Checked against transformers 5.x modeling_{llama,mistral,qwen2}.py by the cross-check test.
FAMILIES: dict[str, _Family] = {
    "llama": _Family("LlamaForCausalLM", "attention_bias", "attention_bias", "mlp_bias", True, True,
                     frozenset({"pretraining_tp", "attention_bias", "mlp_bias"})),
    "mistral": _Family("MistralForCausalLM", False, False, False, False, True, frozenset({"sliding_window"})),
    "qwen2": _Family("Qwen2ForCausalLM", True, False, False, False, False,
                     frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})),
}
SUPPORTED_TRANSFORMERS_MAJOR = 5

_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Keys any of these configs may carry that create no parameters (generation, bookkeeping,
# rotary settings: the rotary inv_freq buffers are not persistent, so not in the state dict).
_HARMLESS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "hidden_act", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "use_cache", "attention_dropout", "rope_theta", "rope_scaling",
    "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "id2label", "label2id", "num_labels", "problem_type", "return_dict",
    "output_attentions", "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "use_return_dict", "tokenizer_class",
    "prefix", "task_specific_params", "finetuning_task", "torchscript", "pruned_heads",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
_ACTIVATIONS = frozenset({"silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"})
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3"})


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _flag(config: dict[str, Any], spec: bool | str) -> bool | None:
    """A bias flag: fixed by the family, or read from config (absent = False); None if not a bool."""
    if isinstance(spec, bool):
        return spec
    v = config.get(spec, False)
    return v if isinstance(v, bool) else None


def _transformers_files() -> Path | None:
    spec = importlib.util.find_spec("transformers")  # top-level: locates, does not import
    locs = list(spec.submodule_search_locations or []) if spec else []
    return Path(locs[0]) if locs else None


def transformers_major() -> int | None:
    """transformers' major version, read from its ``__init__.py`` (``__version__ = "5.24.0"``) without importing it.

    ``importlib.metadata`` would answer too, but its import (email, zipfile, csv, ...) costs
    about 30 ms of CPU, a tenth of what the copy itself takes at 1.5 GB.
    """
    root = _transformers_files()
    try:
        text = (root / "__init__.py").read_text() if root else ""
    except OSError:
        return None
    found = re.search(r'^__version__\s*=\s*["\'](\d+)\.', text, re.MULTILINE)
    return int(found.group(1)) if found else None


def class_resolves(model_type: str, name: str) -> bool:
    """Whether ``transformers.<name>`` exists, read from the modeling file without importing it.

    transformers 5 builds its lazy top-level namespace from each modeling module's
    ``__all__``, so the name must be a module-level class there and listed in ``__all__``.
    """
    root = _transformers_files()
    path = root / "models" / model_type / f"modeling_{model_type}.py" if root else None
    if path is None or not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    defined = any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)
    exported = False
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            try:
                exported = name in ast.literal_eval(n.value)
            except ValueError:
                return False
    return defined and exported


def _unsure_reason(config: dict[str, Any], fam: _Family) -> str | None:
    """Why the rule cannot answer for this config, or None when every field is understood."""
    unknown = sorted(set(config) - _HARMLESS - set(_DIMS) - fam.extra_keys)
    if unknown:
        return f"config keys the rules do not know: {unknown[:5]}"
    bad = [k for k in _DIMS if not _pos_int(config.get(k))]
    if bad:
        return f"missing or non-positive {bad}"
    if config["hidden_size"] % config["num_attention_heads"]:
        return "hidden_size not divisible by num_attention_heads"
    kv = config.get("num_key_value_heads", "absent")
    if kv == "absent" and not fam.kv_heads_default_is_heads:
        return "num_key_value_heads absent (the config class default is not num_attention_heads)"
    if kv not in ("absent", None) and not (_pos_int(kv) and config["num_attention_heads"] % kv == 0):
        return f"num_key_value_heads {kv!r} does not divide num_attention_heads"
    hd = config.get("head_dim", "absent")
    if not (hd == "absent" or _pos_int(hd) or (hd is None and fam.null_head_dim_ok)):
        return f"head_dim {hd!r}"
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        return "tie_word_embeddings is not a boolean"
    if config.get("hidden_act", "silu") not in _ACTIVATIONS:
        return f"hidden_act {config.get('hidden_act')!r}"
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if rope is not None and not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) in _ROPE_TYPES):
            return f"{key} {rope!r}"
    if any(_flag(config, s) is None for s in (fam.qkv_bias, fam.o_bias, fam.mlp_bias)):
        return "a bias flag is not a boolean"
    return None


def expected_from_rules(config: dict[str, Any], archs: list[str], wrapper_archs: bool) -> tuple[ArchResult | None, str]:
    """Expected keys/shapes for a Llama/Mistral/Qwen2 causal LM, from config.json's JSON.

    Args:
        config: config.json as a dict.
        archs: The de-prefixed ``architectures`` list.
        wrapper_archs: ``architectures`` is empty or names a wrapper class, so the class
            comes from ``model_type`` (as ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` maps it).

    Returns:
        ``(result, "")`` when the rule is sure, else ``(None, reason)``; the caller then
        instantiates the model with transformers.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        return None, f"no rule for model_type {model_type!r}"
    fam = FAMILIES[model_type]
    if not wrapper_archs and archs != [fam.architecture]:
        return None, f"architectures {archs} is not exactly ['{fam.architecture}'] for model_type '{model_type}'"
    major = transformers_major()
    if major is None:
        return None, "transformers version unknown"
    if major != SUPPORTED_TRANSFORMERS_MAJOR or importlib.util.find_spec("torch") is None:
        return None, f"rules are checked against transformers {SUPPORTED_TRANSFORMERS_MAJOR}.x with torch installed"
    reason = _unsure_reason(config, fam)
    if reason:
        return None, reason
    if not class_resolves(model_type, fam.architecture):
        return None, f"'{fam.architecture}' not found in transformers' modeling_{model_type}.py"

    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    qkv_b, o_b, mlp_b = (_flag(config, s) for s in (fam.qkv_bias, fam.o_bias, fam.mlp_bias))
    exp: dict[str, tuple] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, out_dim, in_dim, bias in (("q", heads * hd, h, qkv_b), ("k", kv * hd, h, qkv_b),
                                            ("v", kv * hd, h, qkv_b), ("o", h, heads * hd, o_b)):
            exp[f"{p}self_attn.{proj}_proj.weight"] = (out_dim, in_dim)
            if bias:
                exp[f"{p}self_attn.{proj}_proj.bias"] = (out_dim,)
        for proj, out_dim, in_dim in (("gate", inter, h), ("up", inter, h), ("down", h, inter)):
            exp[f"{p}mlp.{proj}_proj.weight"] = (out_dim, in_dim)
            if mlp_b:
                exp[f"{p}mlp.{proj}_proj.bias"] = (out_dim,)
        exp[f"{p}input_layernorm.weight"] = (h,)
        exp[f"{p}post_attention_layernorm.weight"] = (h,)
    exp["model.norm.weight"] = (h,)
    exp["lm_head.weight"] = (vocab, h)
    # Tied: transformers shares one Parameter under both names, and either may be the one saved.
    tied = {"lm_head.weight", "model.embed_tokens.weight"} if config.get("tie_word_embeddings") else set()
    res = ArchResult(fam.architecture, exp, tied)
    if wrapper_archs:
        res.notes.append(f"architectures {archs} name a wrapper; resolved '{fam.architecture}' from model_type '{model_type}'")
    res.notes.append(f"expected keys from the {model_type} config rules (verify/architecture_rules.py, no torch import); "
                     f"'{fam.architecture}' found in transformers' modeling_{model_type}.py")
    return res, ""
