"""docs/contributing.md's architecture table is the import rule tests/test_imports.py enforces.

The page promises "one picture that matches tests/test_imports.py": its table of stages and
what each may import is read here and compared with ``ALLOWED``, so a layer added or
loosened in the test without the page (or the other way round) fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Set

from tests.test_imports import ALLOWED

PAGE = Path(__file__).resolve().parents[2] / "docs" / "contributing.md"
MARKER = "<!-- the table tests/docs/test_architecture_page.py compares"


def page_table(text: str) -> Dict[str, Set[str]]:
    """The ``| stage | may import |`` rows that follow the marker comment, up to the first blank line."""
    lines = text.split(MARKER, 1)[1].splitlines()[1:]
    rows: Dict[str, Set[str]] = {}
    for line in lines:
        if not line.strip():
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("stage", "---"):
            continue
        stage = cells[0].replace("\\_", "_")
        rows[stage] = {s.strip() for s in cells[1].split(",") if s.strip()}
    return rows


def test_the_page_table_is_the_import_rule() -> None:
    table = page_table(PAGE.read_text())
    assert set(table) == set(ALLOWED), f"stages only on the page: {set(table) - set(ALLOWED)}; only in the test: {set(ALLOWED) - set(table)}"
    wrong = {stage: (sorted(table[stage]), sorted(ALLOWED[stage])) for stage in ALLOWED if table[stage] != ALLOWED[stage]}
    assert not wrong, f"page vs tests/test_imports.py ALLOWED: {wrong}"


def test_the_reader_sees_a_difference() -> None:
    """The comparison can fail: a row with one import more is read as such."""
    text = f"{MARKER} -->\n| stage | may import |\n|---|---|\n| core | config |\n| \\_\\_init\\_\\_ | api |\n\nafter"
    assert page_table(text) == {"core": {"config"}, "__init__": {"api"}}
