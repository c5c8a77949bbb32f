"""No dead knobs: every leaf of the schema is read by the code it claims to control.

A leaf counts as read when some module outside ``fsdp_workflow/config/`` (or
``config/accelerate_env.py`` and the strategy specs under ``config/strategies/``, whose
``env`` is the environment Accelerate reads) accesses an attribute of that name. The few leaves read only by validation are
listed with the reason they still change what runs. A new field nobody reads
fails here, so it cannot land as a silent no-op.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Iterator

import pytest

from fsdp_workflow.config.schema import BOUNDS_KEY, WorkflowConfig

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_workflow"

READ_ONLY_BY_VALIDATION: dict[str, str] = {}


def leaves(cls=WorkflowConfig, prefix: str = "") -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _sources() -> dict:
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")
            if "config" not in p.relative_to(PACKAGE).parts or p.name == "accelerate_env.py"
            or "strategies" in p.relative_to(PACKAGE).parts}


SOURCES = _sources()


@pytest.mark.parametrize("leaf", list(leaves()))
def test_every_leaf_has_a_reader(leaf: str) -> None:
    name = leaf.rsplit(".", 1)[-1]
    readers = [p for p, text in SOURCES.items() if re.search(rf"\.{re.escape(name)}\b", text)]
    if leaf in READ_ONLY_BY_VALIDATION:
        assert not readers, f"{leaf} is read now: drop it from READ_ONLY_BY_VALIDATION"
        return
    assert readers, (f"{leaf}: no module outside config/ reads it, so setting it changes nothing. "
                     "Wire it into the code it controls, remove it, or refuse it with a message.")


def test_every_numeric_leaf_declares_bounds() -> None:
    def fields(cls=WorkflowConfig, prefix: str = ""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                yield from fields(t, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", t, f

    unbounded = [key for key, t, f in fields()
                 if (t in (int, float) or t in (typing.Optional[int], typing.Optional[float]))
                 and BOUNDS_KEY not in f.metadata]
    assert unbounded == [], f"numeric fields without bounded(...): {unbounded}"


def test_removed_knobs_are_gone_and_explained() -> None:
    from fsdp_workflow.config.keys import REMOVED, check_key

    all_leaves = set(leaves())
    for key in REMOVED:
        assert key not in all_leaves
        issue = check_key(key)
        assert issue is not None and issue.why.startswith("removed")


def test_docs_list_every_bound() -> None:
    """The default column holds what a user gets (the composed base config), not the schema's values."""
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.config.rules_bounds import bounds_markdown

    doc = (PACKAGE.parent / "docs" / "configuration.md").read_text()
    assert bounds_markdown(compose(["~experiment"])) in doc, (
        "docs/configuration.md's bounds table differs from the composed config: paste the output of "
        "`python -c 'from fsdp_workflow.config.load import compose; from fsdp_workflow.config.rules_bounds "
        "import bounds_markdown; print(bounds_markdown(compose([\"~experiment\"])))'`")
