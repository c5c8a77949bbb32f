"""The runtime seam: each ``container.runtime`` value is one class, and nothing outside container/ names one.

Adding a runtime touches ``fsdp_workflow/container/`` (its class and a registry
line), ``config/schema.py`` (the enum value), ``conf/container/<name>.yaml`` and
docs/containers.md. These tests hold the code to that: a value without a class,
a config file or a docs section fails here, and so does a runtime special-cased
in another package.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fsdp_workflow
from fsdp_workflow.config import compose
from fsdp_workflow.config.schema import ContainerRuntime
from fsdp_workflow.container import RUNTIMES, Runtime, runtime_for

PACKAGE = Path(fsdp_workflow.__file__).parent
DOCS = PACKAGE.parent / "docs" / "containers.md"
# Where a runtime's name may appear in code: its own package, and the schema that lists the values.
OWNERS = (PACKAGE / "container", PACKAGE / "config" / "schema.py")
# A runtime special-cased in code: a comparison with the enum member, or with its value as a string.
SPECIAL_CASE = re.compile(r"ContainerRuntime\.\w+|runtime\s*[!=]=\s*[\"']\w+[\"']")


@pytest.mark.parametrize("value", [r.value for r in ContainerRuntime])
def test_every_value_has_a_class_a_config_file_and_docs(value: str) -> None:
    runtime = RUNTIMES[value]
    assert isinstance(runtime, Runtime) and runtime.name == value
    assert (PACKAGE / "conf" / "container" / f"{value}.yaml").is_file()
    overrides = ["+experiment=smoke", f"container={value}"]
    assert runtime_for(compose(overrides)) is runtime
    if value != "none":
        assert f"container={value}" in DOCS.read_text(), f"docs/containers.md does not show container={value}"


def test_no_runtime_is_special_cased_outside_container() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        if any(path == owner or owner in path.parents for owner in OWNERS):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if SPECIAL_CASE.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not found, "ask fsdp_workflow.container (runtime_for(cfg)) instead of naming a runtime:\n" + "\n".join(found)
