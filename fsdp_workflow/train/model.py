"""Build the causal LM: from a local Hugging Face directory or randomly from the shape fields.

Never downloads: ``HF_HUB_OFFLINE=1`` is set before transformers is imported
and every ``from_pretrained`` passes ``local_files_only=True``.

Large models: with ``meta=True`` the model is built on the meta device (no
memory); :mod:`fsdp_workflow.train.parallel` shards it, materialises only the
local shards and broadcasts rank 0's full weights into them.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_workflow.config.schema import ModelConfig, ModelInit  # noqa: E402


def build_hf_config(model_cfg: ModelConfig) -> Any:
    """The transformers config for the model.

    With ``model.name_or_path``: the directory's ``config.json``, whatever
    ``model.init`` says (random init trains that architecture from new weights).
    Without: ``AutoConfig.for_model`` from the shape fields, with ``architectures``
    set so the consolidated ``config.json`` names the right class. ``model.extra_config``
    applies on top of both, as the planner counted it (config/model_dir.py).

    Raises:
        FileNotFoundError: ``model.name_or_path`` is not a local directory.
    """
    from transformers import AutoConfig

    path = model_cfg.name_or_path
    if model_cfg.init == ModelInit.pretrained or path:
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"model.name_or_path={path!r} is not a local directory. With model.init=pretrained the "
                "weights must be on local or shared storage (the trainer never downloads); or set "
                "model.init=random to build the model from its shape fields."
            )
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
        for key, value in (model_cfg.extra_config or {}).items():
            if key == "rope_scaling":  # transformers 5's name; it holds rope_theta too, so merge, never replace
                key = "rope_parameters"
            old = getattr(config, key, None)
            setattr(config, key, {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value)
    else:
        fields: Dict[str, Any] = dict(
            vocab_size=model_cfg.vocab_size,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_hidden_layers=model_cfg.num_hidden_layers,
            num_attention_heads=model_cfg.num_attention_heads,
            num_key_value_heads=model_cfg.num_key_value_heads,
            max_position_embeddings=model_cfg.max_position_embeddings,
            rope_theta=model_cfg.rope_theta,
            tie_word_embeddings=model_cfg.tie_word_embeddings,
        )
        fields.update(model_cfg.extra_config)
        config = AutoConfig.for_model(model_cfg.model_type, **fields)
        config.architectures = [model_cfg.architecture]
    config._attn_implementation = model_cfg.attn_implementation
    config.use_cache = False
    return config


def build_model(model_cfg: ModelConfig, *, seed: int, meta: bool = False) -> nn.Module:
    """Instantiate the model on CPU (or on the meta device).

    Args:
        model_cfg: the ``model`` group.
        seed: seeds random init, so every rank that builds the model builds the same one.
        meta: build parameters on the meta device (no storage; buffers stay real);
            the weights come later from rank 0.

    Returns:
        The ``*ForCausalLM`` module in fp32 (FSDP keeps fp32 master weights; mixed
        precision casts for compute).
    """
    from transformers import AutoModelForCausalLM

    config = build_hf_config(model_cfg)
    if meta:
        from accelerate import init_empty_weights

        # Parameters on meta; buffers (rotary tables) stay real, as Accelerate's FSDP2
        # preparation expects of non-main ranks.
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
        # init_empty_weights re-creates every parameter on meta as it is registered,
        # so the tie post_init made (lm_head.weight = embed_tokens.weight) is lost:
        # this rank would shard one parameter more than the ranks that built real.
        retie(model)
    elif model_cfg.init == ModelInit.pretrained:
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.name_or_path,
            config=config,
            dtype=torch.float32,
            trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=True,
        )
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    model = model.to(torch.float32)
    model.config.use_cache = False
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def retie(model: nn.Module) -> None:
    """Tie the weights ``model.config`` ties again, after a step that copies parameters one by one.

    ``Module.to("meta")``, ``to_empty`` without FSDP and Accelerate's ``init_empty_weights``
    give each module its own new parameter, so a tied output embedding becomes a second
    parameter. Every rank must hold the same parameter set before ``fully_shard`` (its
    all-gathers are sized by it) and a tied model must train one tensor. transformers'
    ``tie_weights`` ties only what the config asks for; a model without it ties nothing.
    """
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def tied_parameter_names(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs ``(alias, owner)`` of parameter names that are one parameter (e.g. ``lm_head.weight`` of the embedding).

    Read from the module tree itself (``named_parameters(remove_duplicate=False)``), so
    it says what is tied, not what the config intends.
    """
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return pairs


def untied(model: nn.Module) -> list[str]:
    """The ties ``model``'s config asks for that are two parameters, as ``"target -> source"`` (empty: all hold).

    A tie that a wrapping step lost trains two tensors that drift apart, and the
    consolidated model, which keeps one of them, would not be the model trained. Lost
    means both names are listed as parameters of their own (``named_parameters`` lists
    a tied alias once); wrappers that flatten parameters (FSDP1 without
    ``use_orig_params``) list neither, and are not judged here.
    """
    wanted = getattr(model, "all_tied_weights_keys", None) or {}
    # Activation checkpointing and torch.compile insert a module level into the names.
    names = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
             for n, _ in model.named_parameters()}
    return [f"{t} -> {s}" for t, s in wanted.items() if t in names and s in names]


def non_persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers that ``state_dict`` omits (rotary ``inv_freq``...), by fully qualified name."""
    out: Dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules():
        for buf_name in getattr(mod, "_non_persistent_buffers_set", ()):
            buf = mod._buffers.get(buf_name)
            if buf is not None:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def set_buffer(model: nn.Module, fqn: str, value: torch.Tensor) -> None:
    """Replace the buffer at ``fqn`` keeping it non-persistent."""
    parent, _, name = fqn.rpartition(".")
    mod = model.get_submodule(parent) if parent else model
    mod.register_buffer(name, value, persistent=False)


def decoder_layer_classes(model: nn.Module, names: Optional[list[str]]) -> Tuple[type, ...]:
    """Resolve decoder-layer class names (``FSDP_TRANSFORMER_CLS_TO_WRAP``) to classes in ``model``.

    Args:
        model: the model.
        names: class names; None or empty: the model's ``_no_split_modules``.

    Raises:
        ValueError: a name matches no module class in the model.
    """
    wanted = list(names or getattr(model, "_no_split_modules", None) or [])
    # Walk the MRO: FSDP2 swaps a sharded module's class for a subclass (FSDPLlamaDecoderLayer).
    found = {c.__name__: c for m in model.modules() for c in type(m).__mro__}
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ValueError(
            f"FSDP_TRANSFORMER_CLS_TO_WRAP / model.decoder_layer_cls names {missing}, but the model has no "
            f"such module. Decoder-like classes present: {sorted(n for n in found if 'Layer' in n)}. "
            "Fix model.decoder_layer_cls in the config."
        )
    return tuple(found[n] for n in wanted)
