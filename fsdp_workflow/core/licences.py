"""Which files of a model directory are its licence terms (shared by the trainer and the consolidator).

A base model's licence may require its terms to travel with every derivative
(Llama's does: "a copy of this Agreement" and the use policy). The trainer keeps
them in ``RUN_DIR/hf_assets`` beside config.json; the consolidator copies them
into the model it writes.
"""

from __future__ import annotations

import re
from pathlib import Path

# LICENSE, LICENSE.txt, LICENSE-MODEL, LICENCE.md, USE_POLICY.md, NOTICE, notice.txt, COPYING...
LICENCE_FILE_RE = re.compile(r"(licen[cs]e|use[_-]policy|notice|copying)([-_][a-z0-9]+)?(\.(txt|md|rst))?",
                             re.IGNORECASE)


def licence_files(directory: Path) -> list[Path]:
    """The licence, use-policy and notice files directly inside ``directory``, by name.

    Args:
        directory: A Hugging Face model directory (or any directory; a missing one has none).

    Returns:
        Regular files whose names match :data:`LICENCE_FILE_RE`, sorted.
    """
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and LICENCE_FILE_RE.fullmatch(p.name))
