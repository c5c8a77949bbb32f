"""config.json and the non-weight files of a Hugging Face model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from .errors import ConsolidationError
from .keys import WRAPPER_CLASS_NAMES, fix_architecture
from .report import JsonObject, JsonValue

# Files copied verbatim from the reference directory when present.
ASSET_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
)


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
    from the name alone; they are resolved later from ``model_type`` (see verify.py).
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
