"""Each exit-code table of the docs lists every code the tools exit with (issue 36: the 143 row was missing).

The codes are :data:`fsdp_workflow.core.exit_codes.MEANINGS`; a code added there and not
documented in both tables fails here, naming the page and the codes it lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_workflow.core.exit_codes import MEANINGS

DOCS = Path(__file__).resolve().parents[2] / "docs"
# page -> the heading the table sits under
TABLES = {"training.md": "## Preemption, signals and exit codes", "reliability.md": "## Exit codes"}


def table_codes(page: str, heading: str) -> set[int]:
    """The codes in the first column of the first table under ``heading``."""
    text = (DOCS / page).read_text()
    assert heading in text, f"docs/{page}: no heading {heading!r}"
    rows = []
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return {int(m.group(1)) for row in rows if (m := re.match(r"\|\s*(\d+)\s*\|", row))}


@pytest.mark.parametrize("page", sorted(TABLES))
def test_the_exit_code_table_lists_every_code(page: str) -> None:
    missing = sorted(set(MEANINGS) - table_codes(page, TABLES[page]))
    assert not missing, f"docs/{page}: the exit-code table under {TABLES[page]!r} lacks {missing}: add a row for each"
