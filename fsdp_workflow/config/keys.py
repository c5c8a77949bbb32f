"""Unknown keys, with or without ``+``, named with the closest valid one.

Hydra refuses ``train.max_stepz=3`` itself, but ``+train.max_stepz=3`` (the form
its own error message suggests) adds the key and ``OmegaConf.to_object`` then
drops it without a word. Both forms, and keys that reach the composed config
any other way, are checked here against the typed schema. Keys below a
``Dict`` field (``cluster.nccl_env.*``, ``model.extra_config.*``) are free-form.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterable, List, Optional, Sequence

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig, field_hints

_SELECTORS = ("experiment",)  # defaults-list slots that are not fields
# Keys that existed and were removed because nothing read them: say why.
REMOVED = {
    "strategy.state_dict_type": "removed: checkpoints are always sharded DCP (reshardable, what resume and the "
                                "consolidator read); the consolidation step writes the full model",
    "strategy.zero3_save_16bit_model": "removed: the consolidation step writes the 16-bit model from the ZeRO "
                                       "checkpoint (consolidate.dtype), so nothing gathered one at save time",
    "model.load_in_4bit": "removed: 4-bit (QLoRA-style) weights are not full fine-tuning, which is what this tool runs",
}


def _field_types(cls: Any) -> dict:
    hints = field_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_key(key: str) -> Optional[Issue]:
    """None if ``key`` (dotted) is a schema path, else an :class:`Issue` naming the closest valid key."""
    if key in REMOVED:
        return Issue(key, None, REMOVED[key], f"drop the {key} override / YAML line")
    parts = key.split(".")
    if parts[0] in ("hydra",) or (len(parts) == 1 and parts[0] in _SELECTORS):
        return None
    cls: Any = WorkflowConfig
    for i, part in enumerate(parts):
        fields = _field_types(cls)
        if part not in fields:
            prefix = ".".join(parts[:i])
            names = list(fields) + (list(_SELECTORS) if i == 0 else [])
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            full = lambda n: f"{prefix}.{n}" if prefix else n  # noqa: E731
            where = f"'{prefix}'" if prefix else "the root config"
            fix = f"did you mean {full(close[0])}?" if close else f"valid keys of {where}: {', '.join(sorted(names))}"
            return Issue(key, None, f"unknown key: {where} has no '{part}'", fix)
        typ = fields[part]
        origin = typing.get_origin(typ)
        if origin in (dict, typing.Dict) or typ is dict:
            return None  # free-form mapping below this point
        if origin is typing.Union:  # Optional[...]
            typ = next(a for a in typing.get_args(typ) if a is not type(None))
        if not dataclasses.is_dataclass(typ):
            if i < len(parts) - 1:
                return Issue(key, None, f"'{'.'.join(parts[:i + 1])}' is a value, not a section",
                             f"{'.'.join(parts[:i + 1])}=VALUE")
            return None
        cls = typ
    return None


def override_key(override: str) -> Optional[str]:
    """The dotted key of ``key=v``, ``+key=v``, ``++key=v`` or ``~key``; None for a flag or a flag's value."""
    if override.startswith("-") or ("=" not in override and not override.startswith("~")):
        return None  # a flag (--cfg, -m), or a flag's value (job, hydra)
    return override.lstrip("~+").split("=", 1)[0].strip()


def override_key_issues(overrides: Sequence[str]) -> List[Issue]:
    """Check the keys of command-line overrides (``key=v``, ``+key=v``, ``++key=v``, ``~key``)."""
    issues = []
    for o in overrides:
        key = override_key(o)
        if key is None:
            continue
        if "/" in key or "@" in key:
            continue  # a defaults-list path (group/option, package): Hydra checks it
        issue = check_key(key)
        if issue is not None:
            issues.append(Issue(issue.key, o.split("=", 1)[1] if "=" in o else None, issue.why, issue.fix))
    return issues


def composed_keys(node: Any, prefix: str = "") -> Iterable[str]:
    """Every dotted key of a composed ``DictConfig`` (leaves and sections)."""
    from omegaconf import DictConfig

    for k in node.keys():
        key = f"{prefix}{k}"
        yield key
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            yield from composed_keys(child, key + ".")


def composed_key_issues(cfg: Any) -> List[Issue]:
    """Keys of a composed config the schema does not know (each reported once, at its top)."""
    issues: List[Issue] = []
    bad: List[str] = []
    for key in composed_keys(cfg):
        if any(key.startswith(b + ".") for b in bad):
            continue
        issue = check_key(key)
        if issue is not None:
            bad.append(key)
            issues.append(issue)
    return issues
