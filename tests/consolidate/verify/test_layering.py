"""consolidate/verify/ sits between the readers and the steps: they import it, it never imports them back.

The graph is the one ``tests/test_imports.py`` builds from the source (function-level imports
included), so a lazy import back into the steps fails here too.
"""

from __future__ import annotations

from typing import Dict, Set

from tests.test_imports import _graph

PKG = "fsdp_workflow.consolidate"
VERIFY = f"{PKG}.verify"
ABOVE = {f"{PKG}.steps", f"{PKG}.consolidation"}  # the steps that run verification and report it


def _importers_of_verify(graph: Dict[str, Set[str]]) -> Set[str]:
    return {src for src, dsts in graph.items()
            if not src.startswith(VERIFY) and any(d == VERIFY or d.startswith(VERIFY + ".") for d in dsts)}


def _verify_reaches_up(graph: Dict[str, Set[str]]) -> Set[str]:
    """Modules of verify/ that import a module which imports verify/ (a cycle through the package)."""
    importers = _importers_of_verify(graph)
    return {src for src, dsts in graph.items() if src.startswith(VERIFY) and dsts & importers}


def test_only_the_steps_import_verify() -> None:
    graph = _graph()
    assert {m for m in graph if m.startswith(VERIFY + ".")} >= {
        f"{VERIFY}.{m}" for m in ("expected", "values", "rounding", "files", "safetensors_probe", "verifier",
                                  "architecture", "architecture_rules", "report_schema")}
    assert _importers_of_verify(graph) == ABOVE


def test_verify_never_imports_what_imports_it() -> None:
    assert _verify_reaches_up(_graph()) == set()


def test_the_check_catches_a_reader_that_imports_verify() -> None:
    graph = {f"{PKG}.source": {f"{VERIFY}.report_schema"}, f"{VERIFY}.expected": {f"{PKG}.source"},
             f"{PKG}.steps": {f"{VERIFY}.verifier"}, f"{VERIFY}.report_schema": set()}
    assert _importers_of_verify(graph) == {f"{PKG}.source", f"{PKG}.steps"}
    assert _verify_reaches_up(graph) == {f"{VERIFY}.expected"}
