"""Bounds of every numeric field, and the model's shape rules.

The bounds are declared beside each field in ``schema.py`` (``bounded(...)``);
this module only walks the tree and reports. A bounds error on a key hides the
other rules' errors on that same key (see ``validate``), so a user sees "must
be at least 1" once, not three consequences of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, List, Optional, Tuple

from fsdp_workflow.config.schema import BOUNDS_KEY, WorkflowConfig, field_hints
from fsdp_workflow.config.errors import BOUNDS_WHY, Rule, ValidationReport


def bounded_fields(root: Any = WorkflowConfig, prefix: str = "") -> Iterator[Tuple[str, dict, Any]]:
    """Every bounded field as ``(dotted key, {"ge", "gt", "le", "lt"}, schema default)``, in schema order."""
    hints = field_hints(root)
    for f in dataclasses.fields(root):
        key = f"{prefix}{f.name}"
        if BOUNDS_KEY in f.metadata:
            yield key, f.metadata[BOUNDS_KEY], f.default
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            yield from bounded_fields(typ, key + ".")


def describe(bounds: dict) -> str:
    """``>= 1``, ``> 0``, ``in [0, 1)`` ..."""
    lo = f"[{_num(bounds['ge'])}" if bounds["ge"] is not None else (f"({_num(bounds['gt'])}" if bounds["gt"] is not None else None)
    hi = f"{_num(bounds['le'])}]" if bounds["le"] is not None else (f"{_num(bounds['lt'])})" if bounds["lt"] is not None else None)
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    return ("<= " if hi and hi[-1] == "]" else "< ") + (hi or "")[:-1]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _violates(value: Any, b: dict) -> bool:
    if isinstance(value, float) and math.isnan(value):
        return True
    return ((b["ge"] is not None and value < b["ge"]) or (b["gt"] is not None and value <= b["gt"])
            or (b["le"] is not None and value > b["le"]) or (b["lt"] is not None and value >= b["lt"]))


def _example(key: str, b: dict, default: Any) -> str:
    """The fix to type: the schema default when it is in range, else the nearest bound."""
    if default is not None and not _violates(default, b):
        return f"{key}={_num(default)}"
    for cand in (b["ge"], b["gt"] + 1 if b["gt"] is not None else None, b["le"]):
        if cand is not None and not _violates(cand, b):
            return f"{key}={_num(cand)}"
    return f"a value {describe(b)}"


def check_bounds(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Every bounded field within its declared range (``null`` means "not set" and passes)."""
    for key, b, default in bounded_fields():
        value = _get(cfg, key)
        if value is None or isinstance(value, bool):
            continue
        if _violates(value, b):
            extra = " (null disables it)" if key in ("optimizer.max_grad_norm",) else ""
            r.error(key, value, f"{BOUNDS_WHY}{describe(b)}{extra}", _example(key, b, default))


def head_dim(cfg: WorkflowConfig) -> Optional[int]:
    """The attention head size: ``extra_config.head_dim`` if set, else hidden / heads (None if not whole)."""
    m = cfg.model
    explicit = m.extra_config.get("head_dim") if m.extra_config else None
    if explicit is not None:
        return int(explicit)
    if m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads == 0:
        return m.hidden_size // m.num_attention_heads
    return None


def check_model_shape(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Heads divide the hidden size, KV heads divide heads, head dimension even for RoPE."""
    m = cfg.model
    heads, kv, hidden = m.num_attention_heads, m.num_key_value_heads, m.hidden_size
    if min(heads, kv, hidden) < 1:
        return  # reported by check_bounds
    explicit = bool(m.extra_config and m.extra_config.get("head_dim") is not None)
    if not explicit and hidden % heads:
        near = [h for h in range(1, 2 * heads + 1) if hidden % h == 0]
        best = min(near, key=lambda h: abs(h - heads))
        r.error("model.hidden_size", hidden,
                f"not divisible by model.num_attention_heads ({heads}): every head needs the same width",
                f"model.hidden_size={heads * max(1, round(hidden / heads))} (or model.num_attention_heads={best})")
    if heads % kv:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        best = min(divisors, key=lambda d: abs(d - kv))
        r.error("model.num_key_value_heads", kv,
                f"does not divide model.num_attention_heads ({heads}): grouped-query attention shares each "
                "KV head among an equal number of query heads",
                f"model.num_key_value_heads={best} (a divisor of {heads})")
    hd = head_dim(cfg)
    if hd is not None and hd % 2:
        r.error("model.num_attention_heads", heads,
                f"gives a head dimension of {hd}; rotary position embeddings rotate pairs of channels, so it must be even",
                "choose hidden_size / num_attention_heads even (or set model.extra_config.head_dim to an even value)")


RULES: List[Rule] = [check_bounds, check_model_shape]


def bounds_markdown(composed: Optional[WorkflowConfig] = None) -> str:
    """The bounds table of ``docs/configuration.md`` (a test keeps the two equal).

    Args:
        composed: the config a user gets without an experiment (``compose(["~experiment"])``),
            whose values fill the default column. None: the schema's own defaults, which
            the groups' YAML files override (e.g. ``model.vocab_size`` comes from
            ``conf/model/tiny_llama.yaml``), so the docs pass the composed config.

    Returns:
        The markdown table.
    """
    rows = ["| key | allowed | default |", "|---|---|---|"]
    for key, b, default in bounded_fields():
        value = _get(composed, key) if composed is not None else default
        shown = "null" if value is None else _num(value)
        rows.append(f"| `{key}` | {describe(b)} | {shown} |")
    return "\n".join(rows)
