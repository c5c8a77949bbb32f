"""Every float the config holds is a finite number.

``optimizer.lr=inf`` (or ``nan``, ``-inf``, YAML's ``.inf``/``.nan``) composes:
OmegaConf's float type takes them. A bounds check catches some by luck
(``nan`` fails every comparison), others not at all (``lr=inf`` is ``> 0``),
and floats in free-form sections (``model.extra_config``) or lists
(``optimizer.betas``) have no bounds. So this rule walks the typed tree
generically, every dataclass field, mapping value and list item, and refuses
every non-finite float by its dotted key. A new float field is covered
without a line here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from enum import Enum
from typing import Any, Iterator, List, Tuple

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import WorkflowConfig, field_hints

NONFINITE_WHY = "must be a finite number"


def floats(node: Any, prefix: str = "") -> Iterator[Tuple[str, float]]:
    """Every float below ``node`` as ``(dotted key, value)``; list items as ``key[i]``.

    Args:
        node: a config dataclass (or a mapping, list or leaf below one).
        prefix: the dotted key of ``node`` itself.

    Returns:
        An iterator over the float leaves, in the tree's order.
    """
    if isinstance(node, float):
        yield prefix, node
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from floats(getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from floats(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)) and not isinstance(node, Enum):
        for i, v in enumerate(node):
            yield from floats(v, f"{prefix}[{i}]")


def _fix(key: str) -> str:
    """``key=<schema default>`` when the schema has a finite one, else a placeholder."""
    node: Any = WorkflowConfig
    default: Any = None
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return f"{key}=<a finite number>"  # below a free-form mapping (model.extra_config.*)
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return f"{key}=<a finite number>"
        f = fields[part]
        node = field_hints(node)[part]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    if isinstance(default, float) and math.isfinite(default):
        return f"{key}={default}"
    if isinstance(default, list) and all(isinstance(x, float) and math.isfinite(x) for x in default):
        return f"{key}=[{','.join(str(x) for x in default)}]"
    return f"{key}=<a finite number>"


def check_finite(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Refuse ``nan``, ``inf`` and ``-inf`` wherever the config holds a float."""
    for key, value in floats(cfg):
        if not math.isfinite(value):
            base = re.sub(r"\[\d+\]$", "", key)  # a float list (optimizer.betas) by its key; a list of sections keeps [i]
            r.error(base, value, f"{NONFINITE_WHY}, not {value}: a non-finite value makes the run's "
                    "numbers NaN or infinite from the first step", _fix(base))


RULES: List[Rule] = [check_finite]
