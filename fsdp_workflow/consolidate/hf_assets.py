"""config.json and the non-weight files of a Hugging Face model directory.

Besides config.json and the tokenizer: the base model's licence files and what they say
(the model card's ``license``), and ``model.safetensors.index.json`` as transformers writes it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_workflow.core.licences import licence_files
from fsdp_workflow.core.modeldir import CARD_FILE

from .consolidation_errors import ConsolidationError
from .key_names import WRAPPER_CLASS_NAMES, fix_architecture
from .jsontypes import JsonObject, JsonValue

# Files copied verbatim from the reference directory when present.
ASSET_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
)
# Licence texts recognised by their title (the Hub's licence identifiers, docs/hub/repositories-licenses).
_LICENCE_TITLES: list[tuple[re.Pattern[str], dict[str, str]]] = [
    (re.compile(r"llama (2|3|3\.1|3\.2|3\.3|4) community license agreement"), {}),  # -> llama2, llama3.1...
    (re.compile(r"gemma terms of use"), {"license": "gemma"}),
    (re.compile(r"qwen research license agreement"), {"license": "other", "license_name": "qwen-research"}),
    (re.compile(r"tongyi qianwen license agreement"), {"license": "other", "license_name": "tongyi-qianwen"}),
    (re.compile(r"qwen license agreement"), {"license": "other", "license_name": "qwen"}),
    (re.compile(r"apache license\s+version 2\.0"), {"license": "apache-2.0"}),
    (re.compile(r"\bmit license\b.*permission is hereby granted, free of charge", re.DOTALL), {"license": "mit"}),
]
_LICENCE_HEAD_CHARS = 4000  # titles sit at the top; do not read a whole licence
def read_config(reference: Path) -> JsonObject:
    """Load ``reference/config.json`` as plain JSON (no transformers import).

    Args:
        reference: A Hugging Face model directory.

    Returns:
        The parsed config.

    Raises:
        ConsolidationError: No config.json there, or not a JSON object.
    """
    path = reference / "config.json"
    if not path.is_file():
        raise ConsolidationError(f"{path}: reference has no config.json; pass --reference pointing at a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConsolidationError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConsolidationError(f"{path}: holds a JSON {type(config).__name__}, not an object; point --reference at a Hugging Face model directory")
    return config


def fixed_architectures(config: JsonObject) -> tuple[list[str], list[str]]:
    """Return the de-prefixed ``architectures`` and notes about what changed.

    Wrapper class names (``FullyShardedDataParallel``, ``OptimizedModule``) cannot be fixed
    from the name alone; they are resolved later from ``model_type`` (see verify/architecture.py).
    """
    raw = config.get("architectures")
    archs = [str(a) for a in raw] if isinstance(raw, list) else []
    notes: list[str] = []
    out: list[str] = []
    for a in archs:
        b = fix_architecture(a)
        if b != a:
            notes.append(f"architectures: '{a}' -> '{b}' (FSDP2 class prefix removed)")
        out.append(b)
    return out, notes


def needs_arch_from_model_type(archs: list[str]) -> bool:
    return not archs or any(a in WRAPPER_CLASS_NAMES for a in archs)


def write_config(config: JsonObject, out: Path, archs: list[str], dtype: str) -> None:
    """Write config.json with fixed architectures and the true output dtype."""
    names: list[JsonValue] = list(archs)
    cfg = dict(config)
    cfg["architectures"] = names
    # transformers 5 reads "dtype"; v4 and many serving stacks read "torch_dtype".
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_assets(reference: Path, out: Path, config: JsonObject) -> list[str]:
    """Copy generation config, tokenizer files, chat template (and remote code if used)."""
    copied = []
    names = list(ASSET_FILES)
    if config.get("auto_map"):
        names += [p.name for p in reference.glob("*.py")]
    for name in names:
        src = reference / name
        if src.is_file():
            shutil.copy2(src, out / name)
            copied.append(name)
    return copied


def dominant_float_dtype(sizes: dict[str, int]) -> str:
    """The floating dtype holding most bytes (what ``torch_dtype`` should say)."""
    floats = {k: v for k, v in sizes.items() if k in ("float32", "bfloat16", "float16", "float64")}
    pool = floats or sizes
    return max(pool, key=lambda k: pool[k]) if pool else "float32"


def copy_licenses(sources: Path | Sequence[Path | None] | None, out: Path) -> list[str]:
    """Copy the base model's licence files into ``out``, from the first source directory that has any.

    Sources are tried in order (the reference directory first, then e.g. the run's base
    model directory), so the files all come from one model. A file of the same name already
    in ``out`` is kept.

    Args:
        sources: One directory, or candidates in order of preference (None entries skipped).
        out: The output model directory.

    Returns:
        The names copied (empty when no source has any).
    """
    candidates = [sources] if isinstance(sources, Path) else [s for s in (sources or []) if s is not None]
    for directory in candidates:
        found = licence_files(directory)
        if found:
            copied = []
            for src in found:
                if not (out / src.name).exists():
                    shutil.copy2(src, out / src.name)
                    copied.append(src.name)
            return copied
    return []


def index_metadata(tensors: Iterable[tuple[int, int]], num_buffer_elements: int = 0) -> dict[str, int]:
    """``metadata`` of ``model.safetensors.index.json`` as transformers 5's ``save_pretrained`` writes it.

    transformers drops tied aliases first (``remove_tied_weights_from_state_dict``), then
    huggingface_hub's ``split_torch_state_dict_into_shards`` sums each distinct storage's
    bytes into ``total_size``, and ``save_pretrained`` adds ``total_parameters``
    (``model.num_parameters()``: parameters only, tied ones once, buffers not counted). For
    the tensors a consolidation writes (each its own contiguous storage, tied aliases
    already dropped) that is the sum of their bytes and of their element counts.

    Args:
        tensors: ``(numel, nbytes)`` of every tensor written, tied aliases excluded.
        num_buffer_elements: Elements of persistent buffers among them (not parameters).

    Returns:
        ``{"total_parameters": ..., "total_size": ...}``.
    """
    numel = nbytes = 0
    for n, b in tensors:
        numel += n
        nbytes += b
    return {"total_parameters": numel - num_buffer_elements, "total_size": nbytes}


def index_text(metadata: Mapping[str, int], weight_map: Mapping[str, str]) -> str:
    """The index file's text, formatted as transformers writes it (sorted keys, indent 2, final newline)."""
    return json.dumps({"metadata": dict(metadata), "weight_map": dict(weight_map)}, indent=2, sort_keys=True) + "\n"


def licence_metadata(out_dir: Path, base_dirs: Sequence[Path]) -> dict[str, str]:
    """The card's ``license`` / ``license_name`` / ``license_link``, when they can be known.

    In order: what the base model's own card (``README.md`` front matter in ``base_dirs``)
    declares; else a licence file copied into ``out_dir`` recognised by its title (Llama,
    Gemma, Qwen, Apache-2.0, MIT); else, with a licence file that is not recognised,
    ``license: other`` linking to it. Nothing is inferred from model names.

    Args:
        out_dir: The output directory, with the licence files already copied.
        base_dirs: The base model's directories (:func:`.card.base_model_dirs`), in order of preference.

    Returns:
        The front-matter keys (empty when unknown).
    """
    for d in base_dirs:
        declared = front_matter(d / CARD_FILE)
        value = declared.get("license")
        if isinstance(value, str) and value:
            meta = {"license": value}
            for key in ("license_name", "license_link"):
                extra = declared.get(key)
                if isinstance(extra, str) and extra and (key != "license_link" or _link_ok(extra, out_dir)):
                    meta[key] = extra
            return meta
    files = [p for p in licence_files(out_dir) if p.name.lower().startswith("licen")]
    found = [m for m in (_recognise(p) for p in files) if m]
    if found and all(m == found[0] for m in found):
        meta = dict(found[0])
        if meta["license"] == "other":
            meta["license_link"] = next(p.name for p in files if _recognise(p) == found[0])
        return meta
    if files and not found:
        return {"license": "other", "license_link": files[0].name}
    return {}


def front_matter(path: Path) -> dict[str, Any]:
    """The YAML front matter of a Markdown file (``---`` ... ``---`` at its top); {} when none or unreadable."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    m = re.match(r"---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.DOTALL)
    if not m:
        return {}
    import yaml  # type: ignore[import-untyped]  # imported here: the copy path never needs it

    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _link_ok(link: str, out_dir: Path) -> bool:
    """A declared ``license_link`` still points somewhere: a URL, or a file the output has."""
    return "://" in link or (out_dir / link).is_file()


def _recognise(path: Path) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = " ".join(f.read(_LICENCE_HEAD_CHARS).split()).lower()
    except OSError:
        return {}
    for pattern, meta in _LICENCE_TITLES:
        m = pattern.search(head)
        if m:
            return dict(meta) if meta else {"license": f"llama{m.group(1)}"}
    return {}
