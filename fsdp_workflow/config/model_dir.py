"""The model directory is the source of truth: read its ``config.json`` and make ``cfg.model`` say the same.

A user names a model the way every peer tool lets them, by its directory
(``model.name_or_path=/shared/models/Qwen3-0.6B``), and expects that model to
train: its weights, its architecture, its decoder layer class as the FSDP wrap
unit, its tie, its sizes in the memory estimate. The ``model`` group's values
(e.g. the tiny Llama of ``+experiment=smoke_chat``) describe *a* model, so one
rule holds for every key, documented in docs/models.md:

  **What describes the model comes from the model.** With a directory, its
  ``config.json`` (plus transformers' class defaults for keys it leaves out)
  sets ``model_type``, ``architecture``, ``decoder_layer_cls``, the shape
  fields and ``tie_word_embeddings``; with a random init, ``model.model_type``'s
  family sets ``architecture`` and ``decoder_layer_cls``. A configured value
  that differs is replaced, and one note lists every replacement.
  ``model.extra_config`` is the one way to change the model's own config
  (e.g. rope scaling): it applies on top, in planning and in the trainer alike.

The attention implementation follows the same rule: a family that cannot run
the configured one (Gemma 2 refuses SDPA, which cannot soft-cap) gets ``eager``
with a note. Everything is read as JSON or through :mod:`.hf_source`, never by
importing transformers: planning stays torch-free.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from fsdp_workflow.config import hf_source
from fsdp_workflow.config.errors import show_value
from fsdp_workflow.config.schema import ModelConfig, ModelInit, WorkflowConfig
from fsdp_workflow.core.modeldir import INDEX_FILE, SINGLE_FILE

CONFIG_FILE = "config.json"
DEFAULT_ATTENTION = ModelConfig.attn_implementation  # the schema's default, sdpa
WEIGHT_GLOBS = (SINGLE_FILE, "model-*.safetensors", INDEX_FILE, "pytorch_model.bin",
                "pytorch_model-*.bin", "pytorch_model.bin.index.json", "consolidated*.safetensors")
# A tokenizer transformers can load offline: a fast one's tokenizer.json, or a slow one's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tiktoken.model")
# model.<key> <- config.json key(s), in order of preference.
SHAPE_KEYS: Dict[str, Tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "moe_intermediate_size"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_attention_heads"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length"),
    "tie_word_embeddings": ("tie_word_embeddings",),
}


@dataclass(frozen=True)
class ModelDir:
    """A local model directory as planning sees it: its config and which files it has."""

    path: str
    config: Dict[str, Any]  # config.json (empty when unreadable)
    problem: Optional[str]  # why config.json could not be read; None: it was
    files: Tuple[str, ...]  # names at the top level

    def has(self, *patterns: str) -> bool:
        return any(glob.fnmatch.fnmatch(f, p) for p in patterns for f in self.files)  # type: ignore[attr-defined]

    @property
    def model_type(self) -> Optional[str]:
        value = self.config.get("model_type")
        return value if isinstance(value, str) else None

    @property
    def remote_code(self) -> Optional[str]:
        """``auto_map``'s causal LM entry: the directory ships its own modeling code."""
        auto = self.config.get("auto_map")
        ref = auto.get("AutoModelForCausalLM") if isinstance(auto, dict) else None
        return ref if isinstance(ref, str) else None


@functools.lru_cache(maxsize=32)
def _read(path: str, stamp: float) -> ModelDir:
    del stamp  # part of the cache key: an edited config.json is read again
    try:
        files = tuple(sorted(os.listdir(path)))
    except OSError as err:
        return ModelDir(path, {}, f"cannot be listed ({err.strerror})", ())
    if CONFIG_FILE not in files:
        return ModelDir(path, {}, f"has no {CONFIG_FILE}", files)
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return ModelDir(path, {}, f"{CONFIG_FILE} is not readable JSON ({err})", files)
    if not isinstance(config, dict):
        return ModelDir(path, {}, f"{CONFIG_FILE} holds no JSON object", files)
    return ModelDir(path, config, None, files)


def read_model_dir(path: str) -> Optional[ModelDir]:
    """The directory at ``path`` (None when it is no directory here)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        return None
    try:
        stamp = os.stat(os.path.join(path, CONFIG_FILE)).st_mtime
    except OSError:
        stamp = 0.0
    return _read(path, stamp)


def hub_cache_dir(repo_id: str) -> Optional[str]:
    """A hub id's snapshot in the local Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), or None.

    Only ids of the form ``org/name`` that are already downloaded resolve: nothing
    is fetched, at planning or at run time.
    """
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")) or os.path.exists(repo_id):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            snapshot = os.path.join(repo, "snapshots", f.read().strip())
    except OSError:
        snaps = sorted(glob.glob(os.path.join(repo, "snapshots", "*")), key=os.path.getmtime)
        snapshot = snaps[-1] if snaps else ""
    return snapshot if snapshot and os.path.isfile(os.path.join(snapshot, CONFIG_FILE)) else None


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's part of a config (a multimodal config nests it in ``text_config``)."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) and "hidden_size" not in config else config


def model_init(m: ModelConfig) -> ModelInit:
    """``model.init``, where null means: pretrained when ``model.name_or_path`` is set, else random."""
    if m.init is not None:
        return m.init
    return ModelInit.pretrained if m.name_or_path else ModelInit.random


def effective_config(m: ModelConfig) -> Dict[str, Any]:
    """The transformers config the trainer builds, as a dict: what the planner counts and checks.

    With a directory (pretrained or random weights alike): the class defaults under its
    ``config.json``; without: the class defaults under the shape fields.
    ``model.extra_config`` on top of both.
    """
    directory = read_model_dir(m.name_or_path) if m.name_or_path else None
    if directory is not None and directory.problem is None:
        own = text_config(directory.config)
        base = dict(hf_source.config_defaults(str(own.get("model_type", ""))))
        base.update(own)
    else:
        base = dict(hf_source.config_defaults(m.model_type))
        base.update(model_type=m.model_type, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                    intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
                    num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                    max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                    tie_word_embeddings=m.tie_word_embeddings)
    base.update(m.extra_config or {})
    if base.get("num_key_value_heads") is None:
        base["num_key_value_heads"] = base.get("num_attention_heads")
    return base


def rope_theta(config: Dict[str, Any]) -> Optional[float]:
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    value = config.get("rope_theta", params.get("rope_theta"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rope_scaling(config: Dict[str, Any]) -> Optional[str]:
    """The rope scaling type a config sets (yarn, llama3, linear, dynamic...), None for plain RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if kind not in (None, "default"):
                return str(kind)
    return None


def experts(config: Dict[str, Any]) -> Tuple[int, int]:
    """(experts per MoE layer, experts each token uses); (0, 0) for a dense model."""
    n = config.get("num_local_experts") or config.get("num_experts") or 0
    k = config.get("num_experts_per_tok") or 0
    return (int(n), int(k)) if isinstance(n, int) and n > 1 else (0, 0)


_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def output_dtype(cfg: WorkflowConfig) -> Optional[str]:
    """The dtype the consolidated model is written in (bf16, fp16, fp32), or None to keep the checkpoint's.

    ``consolidate.dtype=auto`` is the base model's own: its ``config.json``'s ``dtype``
    (``torch_dtype`` before transformers 5), as Hugging Face's ``dtype="auto"`` reads it;
    for random init, or a directory that names none, the checkpoint's (fp32) is kept.
    """
    chosen = cfg.consolidate.dtype.value
    if chosen != "auto":
        return None if chosen == "keep" else chosen
    m = cfg.model
    directory = read_model_dir(m.name_or_path) if m.name_or_path and model_init(m) == ModelInit.pretrained else None
    if directory is None or directory.problem is not None:
        return None
    own = text_config(directory.config)
    return _DTYPES.get(str(own.get("dtype") or own.get("torch_dtype") or ""))


def family_of(m: ModelConfig) -> hf_source.Family:
    """The family ``m`` belongs to: its directory's ``model_type`` (or remote code), else ``model.model_type``."""
    directory = read_model_dir(m.name_or_path) if m.name_or_path else None
    if directory is not None and directory.problem is None and directory.model_type:
        remote = directory.remote_code if m.trust_remote_code else None
        return hf_source.family(directory.model_type, (directory.path, remote) if remote else None)
    return hf_source.family(m.model_type)


def _shipped_labels() -> List[str]:
    """The ``name`` of every shipped model group: labels a directory's own name replaces."""
    from fsdp_workflow.config.load import CONF_DIR

    labels = []
    for path in glob.glob(os.path.join(str(CONF_DIR), "model", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            labels += [line.split(":", 1)[1].strip() for line in f if line.startswith("name:")]
    return labels


def resolve_model(cfg: WorkflowConfig) -> List[str]:
    """Make ``cfg.model`` describe the model that will train (the module's rule); returns the notes.

    Mutates ``cfg.model``. Problems (no directory, an unknown ``model_type``...) are
    left for :mod:`.rules_model` to report; this only fills in what can be read.
    """
    m = cfg.model
    notes: List[str] = []
    if m.name_or_path and not os.path.isdir(os.path.expanduser(m.name_or_path)):
        cached = hub_cache_dir(m.name_or_path)
        if cached is not None:
            notes.append(f"model.name_or_path {m.name_or_path!r} is the local hub cache's {cached}")
            m.name_or_path = cached
    if m.name_or_path and os.path.isdir(os.path.expanduser(m.name_or_path)):
        m.name_or_path = os.path.abspath(os.path.expanduser(m.name_or_path))  # the same from every directory
    m.init = model_init(m)
    directory = read_model_dir(m.name_or_path) if m.name_or_path else None
    changed: List[str] = []

    def take(key: str, value: Any) -> None:
        old = getattr(m, key)
        if value is not None and value != old:
            changed.append(f"{key} {show_value(old)} -> {show_value(value)}")
            setattr(m, key, value)

    if directory is not None and directory.problem is None and directory.model_type:
        if m.name in _shipped_labels() and os.path.basename(directory.path) != m.name:
            m.name = os.path.basename(directory.path)
        hf = effective_config(m)
        take("model_type", directory.model_type if "text_config" not in directory.config else hf.get("model_type"))
        for key, names in SHAPE_KEYS.items():
            value = next((hf[n] for n in names if isinstance(hf.get(n), (int, bool)) and hf[n] is not None), None)
            take(key, bool(value) if key == "tie_word_embeddings" and value is not None else value)
        take("rope_theta", rope_theta(hf))
    fam = family_of(m)
    if fam.causal_lm:
        take("architecture", fam.causal_lm)
    if fam.layers and set(fam.layers) != {c.strip() for c in m.decoder_layer_cls.split(",") if c.strip()}:
        take("decoder_layer_cls", fam.layer_cls)
    # Only the default is replaced: another value the family refuses is an error (rules_model) the user chose.
    if fam.read_from not in ("unknown", "table") and m.attn_implementation == DEFAULT_ATTENTION \
            and DEFAULT_ATTENTION not in fam.attention:
        fallback = "eager"
        changed.append(f"attn_implementation {show_value(m.attn_implementation)} -> {show_value(fallback)} "
                       f"({fam.causal_lm} does not support {m.attn_implementation})")
        m.attn_implementation = fallback
    if changed:
        source = f"{directory.path}/{CONFIG_FILE}" if directory is not None and directory.problem is None \
            else f"model.model_type={m.model_type}"
        notes.append(f"model: the model's own values from {source} replace the config's: "
                     + "; ".join(f"model.{c}" for c in changed))
    return notes
