"""docs/models.md's table of families is the matrix's rows (tests/families/replicas.py), line for line."""

from __future__ import annotations

from tests.families.table import DOC, REGENERATE, documented, render


def test_the_families_table_is_the_matrix() -> None:
    shown = documented(DOC.read_text())
    assert shown, f"{DOC}: the families table's markers are missing; put them back and run: {REGENERATE}"
    assert shown == render(), (f"{DOC}'s table of families and the matrix (tests/families/replicas.py) disagree; "
                               f"regenerate the table with: {REGENERATE}")
