"""What the installed transformers knows about a model family, read from its source files (no import).

Planning must answer in about a second on a login node and never import torch,
and ``import transformers`` pulls torch in. Yet the planner needs transformers'
own answers: is this ``model_type`` known to the installed version, which class
is its causal LM, which decoder layer class is the FSDP wrap unit
(``_no_split_modules``), which attention kernels it supports (Gemma 2 refuses
SDPA because SDPA cannot soft-cap), and the config class's defaults for keys a
``config.json`` leaves out. All of these are plain literals in transformers'
source, so they are read here with :mod:`ast` from the package directory that
``importlib.util.find_spec`` finds without executing it. The same reader serves
``trust_remote_code`` models: their modeling file sits in the model directory.

A test builds each family of the model matrix with transformers itself and
checks these answers against the real classes (tests/config/test_hf_source.py).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# Used when a modeling file cannot be read (an unusual install): the families of the
# test matrix, whose real classes the tests compare with this table.
KNOWN_LAYERS: Dict[str, str] = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "mixtral": "MixtralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
    "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer", "gemma3_text": "Gemma3DecoderLayer",
    "phi3": "Phi3DecoderLayer", "olmo2": "Olmo2DecoderLayer",
}


def transformers_dir() -> Optional[str]:
    """The installed transformers package directory, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def transformers_version() -> str:
    """The installed transformers version, or ``not installed``."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=64)
def _parse(path: str) -> Optional[ast.Module]:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _ordered_pairs(tree: Optional[ast.Module], name: str) -> Dict[str, str]:
    """A module-level ``NAME = OrderedDict([("a", "B"), ...])`` (or dict literal) as a dict."""
    out: Dict[str, str] = {}
    for node in tree.body if tree else []:
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            continue
        value = node.value
        if isinstance(value, ast.Call) and value.args:
            value = value.args[0]
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            continue
        out.update(dict(literal))
    return out


@functools.lru_cache(maxsize=1)
def _auto_tables() -> Tuple[Dict[str, str], Dict[str, str], Dict[str, str]]:
    """(model_type -> config class, model_type -> module name where special, model_type -> causal LM class)."""
    root = transformers_dir()
    if root is None:
        return {}, {}, {}
    auto = os.path.join(root, "models", "auto")
    mappings = _parse(os.path.join(auto, "auto_mappings.py")) or _parse(os.path.join(auto, "configuration_auto.py"))
    configs = _ordered_pairs(mappings, "CONFIG_MAPPING_NAMES")
    special = _ordered_pairs(mappings, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
    causal = _ordered_pairs(_parse(os.path.join(auto, "modeling_auto.py")), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return configs, special, causal


def known_model_type(model_type: str) -> bool:
    """Whether the installed transformers has a config class for ``model_type``."""
    return model_type in _auto_tables()[0]


def causal_lm_class(model_type: str) -> Optional[str]:
    """The ``*ForCausalLM`` class transformers' Auto class builds for ``model_type`` (None: it builds none)."""
    return _auto_tables()[2].get(model_type)


def module_name(model_type: str) -> str:
    """The ``transformers.models`` sub-package of ``model_type`` (``gemma3_text`` -> ``gemma3``)."""
    return _auto_tables()[1].get(model_type, model_type.replace("-", "_"))


def _classes(tree: Optional[ast.Module]) -> Dict[str, ast.ClassDef]:
    return {n.name: n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef)}


def _class_attr(classes: Dict[str, ast.ClassDef], name: str, attr: str) -> Tuple[bool, Any]:
    """``attr`` of class ``name``, searched up its bases defined in the same file: (found, value)."""
    seen = set()
    todo = [name]
    while todo:
        cls = classes.get(todo.pop(0))
        if cls is None or cls.name in seen:
            continue
        seen.add(cls.name)
        for node in cls.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == attr and node.value is not None:
                try:
                    return True, ast.literal_eval(node.value)
                except ValueError:
                    return False, None
        todo.extend(b.id for b in cls.bases if isinstance(b, ast.Name))
    return False, None


@dataclass(frozen=True)
class Family:
    """What transformers' source says about one family's causal LM."""

    model_type: str
    causal_lm: Optional[str]  # the class AutoModelForCausalLM builds
    layers: List[str]  # decoder layer classes, the FSDP wrap unit (from _no_split_modules)
    attention: Tuple[str, ...]  # attn_implementation values the class accepts for training
    read_from: str  # the modeling file, or "table" / "unknown"

    @property
    def layer_cls(self) -> str:
        return ",".join(self.layers)


def _modeling_file(model_type: str, remote: Optional[Tuple[str, str]]) -> Optional[str]:
    if remote is not None:  # (model directory, "modeling_x.XForCausalLM")
        directory, ref = remote
        return os.path.join(directory, ref.split("--")[-1].rsplit(".", 1)[0] + ".py")
    root = transformers_dir()
    if root is None:
        return None
    mod = module_name(model_type)
    return os.path.join(root, "models", mod, f"modeling_{mod}.py")


@functools.lru_cache(maxsize=64)
def family(model_type: str, remote: Optional[Tuple[str, str]] = None) -> Family:
    """Read ``model_type``'s family from transformers (or, with ``remote``, from the directory's own code).

    Args:
        model_type: ``config.json``'s ``model_type``.
        remote: ``(directory, auto_map["AutoModelForCausalLM"])`` for ``trust_remote_code`` models.
    """
    cls = remote[1].rsplit(".", 1)[-1] if remote else causal_lm_class(model_type)
    path = _modeling_file(model_type, remote)
    classes = _classes(_parse(path)) if path else {}
    if cls and cls in classes:
        found, value = _class_attr(classes, cls, "_no_split_modules")
        names = [str(v) for v in value or []] if found else []
        # Multimodal files list vision blocks too; the text model wraps its decoder layers.
        layers = [n for n in names if n.endswith("DecoderLayer")] or names
        attention = ["eager"]
        for attr, impl in (("_supports_sdpa", "sdpa"), ("_supports_flex_attn", "flex_attention"),
                           ("_supports_flash_attn", "flash_attention_2")):
            ok, supported = _class_attr(classes, cls, attr)
            if ok and supported:
                attention.append(impl)
        if "flash_attention_2" in attention:
            attention.append("flash_attention_3")
        if layers:
            return Family(model_type, cls, layers, tuple(attention), path or "")
    if model_type in KNOWN_LAYERS:
        return Family(model_type, cls, [KNOWN_LAYERS[model_type]], ("eager", "sdpa"), "table")
    return Family(model_type, cls, [], ("eager", "sdpa"), "unknown")


# What a family's forward calls to turn router logits into the load-balancing loss it returns as aux_loss.
ROUTER_LOSS_CALL = "load_balancing_loss_func("


def computes_router_loss(fam: Family) -> Optional[bool]:
    """Whether the family's modeling file computes a router load-balancing loss (None: its file is not read here).

    Llama 4's text model keeps ``router_aux_loss_coef`` in its config but never calls
    :data:`ROUTER_LOSS_CALL`: its forward returns no ``aux_loss``, so a router loss cannot train.
    """
    return None if fam.read_from in ("table", "unknown") else _calls_router_loss(fam.read_from)


@functools.lru_cache(maxsize=64)
def _calls_router_loss(path: str) -> Optional[bool]:
    try:
        with open(path, encoding="utf-8") as fh:
            return ROUTER_LOSS_CALL in fh.read()
    except (OSError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=64)
def config_defaults(model_type: str) -> Dict[str, Any]:
    """The literal defaults of ``model_type``'s config class (keys a ``config.json`` may leave out)."""
    configs, _, _ = _auto_tables()
    name = configs.get(model_type)
    root = transformers_dir()
    if name is None or root is None:
        return {}
    mod = module_name(model_type)
    classes = _classes(_parse(os.path.join(root, "models", mod, f"configuration_{mod}.py")))
    out: Dict[str, Any] = {}
    chain: List[str] = []
    todo = [name]
    while todo:  # base classes first, so a subclass's default wins
        cls = classes.get(todo.pop(0))
        if cls is None or cls.name in chain:
            continue
        chain.insert(0, cls.name)
        todo.extend(b.id for b in cls.bases if isinstance(b, ast.Name))
    for cname in chain:
        for node in classes[cname].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                try:
                    out[node.target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out
