"""A model directory is checked at planning: what would otherwise fail on every rank after the queue.

Each refusal names the key, the value, why and the fix, and exits 2 before
anything is written or queued (docs/models.md lists them):

* no ``config.json``, or an unreadable one;
* a ``model_type`` the installed transformers does not know (its version, and
  ``model.trust_remote_code=true`` where the directory ships its own code);
* a family whose decoder layer class cannot be found (the FSDP wrap unit);
* ``model.init=pretrained`` with no weight files;
* no tokenizer transformers can load, when the data needs one;
* ``train.seq_len`` beyond ``max_position_embeddings`` without rope scaling;
* an attention implementation the family does not support, named explicitly;
* ``model.router_aux_loss_coef`` on a dense model, or above 0 (the model config's own, when null) for a
  family whose forward computes no router loss (Llama 4's text model).

The directory is read as JSON (:mod:`.model_dir`); nothing imports torch.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config import hf_source
from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.model_dir import (
    TOKENIZER_FILES,
    WEIGHT_GLOBS,
    effective_config,
    experts,
    family_of,
    model_init,
    read_model_dir,
    rope_scaling,
    text_config,
)
from fsdp_workflow.config.rules_run import ATTN_IMPLEMENTATIONS
from fsdp_workflow.config.schema import ClusterKind, DataSource, ModelInit, WorkflowConfig


def _directory_here(cfg: WorkflowConfig) -> bool:
    """Whether a missing directory is an error here (a local run), not a warning (a cluster's storage)."""
    return cfg.cluster.kind == ClusterKind.local and not cfg.dry_run


def check_model_dir(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The directory has a config transformers knows, weights to load, and a family we can wrap."""
    m = cfg.model
    if not m.name_or_path:
        _check_random_family(cfg, r)
        return
    directory = read_model_dir(m.name_or_path)
    if directory is None:
        return  # rules_run names a missing path (an error locally, a warning for a cluster's storage)
    key = "model.name_or_path"
    if directory.problem is not None:
        r.error(key, m.name_or_path, f"this model directory {directory.problem}",
                "point model.name_or_path at a Hugging Face model directory (config.json, weights, tokenizer), "
                "e.g. the output of save_pretrained or huggingface-cli download")
        return
    kind = directory.model_type
    version = hf_source.transformers_version()
    own = text_config(directory.config)
    if kind is None:
        r.error(key, m.name_or_path, "its config.json has no model_type, so no transformers class can build it",
                "use a directory written by save_pretrained (its config.json names model_type)")
        return
    remote = directory.remote_code
    if not hf_source.known_model_type(kind) and not (remote and m.trust_remote_code):
        why = f"its config.json says model_type={kind!r}, which transformers {version} (installed here) does not know"
        fix = ("model.trust_remote_code=true (the directory ships its own modeling code; read it first)" if remote
               else f"a transformers release that knows {kind!r} (pip install -U transformers), or a supported "
                    "family (docs/models.md)")
        r.error(key, m.name_or_path, why, fix)
        return
    if own.get("model_type", kind) == kind and not remote and hf_source.causal_lm_class(kind) is None:
        r.error(key, m.name_or_path, f"transformers {version} has no causal LM class for model_type={kind!r} "
                "(AutoModelForCausalLM cannot build it)", "a causal language model directory (docs/models.md)")
        return
    fam = family_of(m)
    if not fam.layers:
        r.error("model.decoder_layer_cls", m.decoder_layer_cls,
                f"the decoder layer class of {fam.causal_lm or kind} could not be read from transformers' source "
                "(it is the unit FSDP shards and checkpoints)",
                "model.decoder_layer_cls=<its decoder layer class>, e.g. LlamaDecoderLayer, as printed by "
                "print(model) in Python")
    if model_init(m) == ModelInit.pretrained and not directory.has(*WEIGHT_GLOBS):
        r.error(key, m.name_or_path, "the directory has no weights (model.safetensors, model-*.safetensors with "
                "its index, or pytorch_model*.bin)",
                "download the weights into it too, or model.init=random to train its architecture from scratch")
    _check_tokenizer(cfg, directory.files, r)
    _check_attention(cfg, fam, r)


def _check_random_family(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Without a directory, ``model.model_type`` must be a family the installed transformers builds."""
    m = cfg.model
    if hf_source.transformers_dir() is None or hf_source.known_model_type(m.model_type):
        _check_attention(cfg, family_of(m), r)
        return
    r.error("model.model_type", m.model_type,
            f"transformers {hf_source.transformers_version()} (installed here) has no such model_type",
            "a model_type of a supported family (docs/models.md), e.g. model.model_type=llama")


def _check_tokenizer(cfg: WorkflowConfig, files: tuple, r: ValidationReport) -> None:
    """A tokenizer transformers can load offline, unless another one is named or the data needs none."""
    m = cfg.model
    if m.tokenizer or cfg.data.source == DataSource.synthetic:
        return
    if any(f in files for f in TOKENIZER_FILES):
        return
    have = [f for f in files if f.startswith("tokenizer") or f.endswith((".model", ".tiktoken"))]
    why = ("the model directory has no tokenizer (no tokenizer.json, tokenizer.model or vocab.json)"
           + (f"; only {', '.join(have)}" if have else ""))
    r.error("model.tokenizer", None, why + ", and data.source=" + cfg.data.source.value + " is tokenised with it",
            "copy the tokenizer files into the model directory, or model.tokenizer=/path/to/tokenizer_dir")


def _check_attention(cfg: WorkflowConfig, fam: hf_source.Family, r: ValidationReport) -> None:
    impl = cfg.model.attn_implementation
    if fam.read_from in ("unknown", "table") or impl in fam.attention or impl not in ATTN_IMPLEMENTATIONS:
        return
    r.error("model.attn_implementation", impl, f"{fam.causal_lm} does not support it (transformers "
            f"{hf_source.transformers_version()}: it accepts {', '.join(fam.attention)})",
            f"model.attn_implementation={'sdpa' if 'sdpa' in fam.attention else 'eager'}")


def check_positions(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """``train.seq_len`` within the positions the model was trained for, unless rope scaling stretches them."""
    m = cfg.model
    hf = effective_config(m)
    limit = hf.get("max_position_embeddings")
    if not isinstance(limit, int) or limit < 1 or cfg.train.seq_len <= limit or rope_scaling(hf):
        return
    r.error("train.seq_len", cfg.train.seq_len,
            f"longer than the model's max_position_embeddings ({limit}); without rope scaling the positions "
            "past it were never trained and quality falls apart silently",
            f"train.seq_len={limit}, or stretch the positions explicitly, e.g. +model.extra_config.rope_scaling="
            f"'{{rope_type: yarn, factor: {max(2, -(-cfg.train.seq_len // limit))}.0, "
            f"original_max_position_embeddings: {limit}}}'")


def check_router_aux(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """``model.router_aux_loss_coef`` exists for mixture-of-experts models only (no dead knob)."""
    coef = getattr(cfg.model, "router_aux_loss_coef", None)
    own = effective_config(cfg.model).get("router_aux_loss_coef")
    weight = own if coef is None else coef  # null takes the model config's own (train/loss.router_aux_coef)
    if isinstance(weight, (int, float)) and weight > 0 and experts(effective_config(cfg.model))[0]:
        fam = family_of(cfg.model)
        if hf_source.computes_router_loss(fam) is False:  # llama4_text: found only at the first step before
            taken = "" if coef is not None else f"null takes the model config's router_aux_loss_coef={own}, but "
            r.error("model.router_aux_loss_coef", coef,
                    f"{taken}{fam.causal_lm}'s forward computes no router load-balancing loss (transformers "
                    f"{hf_source.transformers_version()}: its modeling file never calls "
                    f"{hf_source.ROUTER_LOSS_CALL.rstrip('(')}), so there is none to train; the trainer would stop "
                    "at its first step", "model.router_aux_loss_coef=0 (train without a router loss)")
            return
    if coef is None:
        return
    if not experts(effective_config(cfg.model))[0]:
        r.error("model.router_aux_loss_coef", coef,
                f"the model ({cfg.model.model_type}) has no experts, so there is no router loss to weigh",
                "model.router_aux_loss_coef=null (it applies to mixture-of-experts models: Mixtral, Qwen3-MoE...)")
    elif coef < 0:
        r.error("model.router_aux_loss_coef", coef, "a negative weight rewards unbalanced routing",
                "model.router_aux_loss_coef=0 (off), or a small positive value such as 0.001")


RULES: List[Rule] = [check_model_dir, check_positions, check_router_aux]
