"""The written tensor names against the reference directory's own weights, where it holds any.

With ``--reference BASE`` pointing at the model directory training started from (an
Accelerate, torchtitan or Lightning run), that directory's safetensors are the truth for
the names other tools expect: its ``model.safetensors.index.json``'s ``weight_map``, or the
headers of its ``*.safetensors`` files (8 bytes of length, then JSON: no tensor is read).
A difference is a note in verification.json and on stderr, naming a few names on each
side; the model still loads with transformers, so it is not a failure. A project run's
``hf_assets/`` holds no weights, so nothing is compared there (the family matrix compares
every family's consolidated names with its directory's: ``tests/families/test_matrix.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

from fsdp_workflow.core.modeldir import INDEX_FILE

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def _header_names(path: Path) -> set[str] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if size > _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    return {k for k in header if k != "__metadata__"} if isinstance(header, dict) else None


def reference_weight_names(directory: Path) -> set[str] | None:
    """The tensor names of the weights in ``directory``, or None when it holds no (readable) safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            weight_map = None
        if isinstance(weight_map, dict) and weight_map:
            return set(weight_map)
    names: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        found = _header_names(path)
        if found is None:
            return None
        names |= found
    return names or None


def names_note(directory: Path, written: Iterable[str]) -> str | None:
    """A note when the written names differ from ``directory``'s weights (None: they agree, or it has none)."""
    want = reference_weight_names(directory)
    if want is None:
        return None
    got = set(written)
    if got == want:
        return None
    only_out, only_ref = sorted(got - want), sorted(want - got)
    return (f"the tensor names written differ from the weights in the reference directory {directory}: "
            f"{len(only_out)} only in the output (e.g. {only_out[:3]}), {len(only_ref)} only in the reference "
            f"(e.g. {only_ref[:3]}). transformers loads the output; tools reading the reference's names "
            "(vLLM, llama.cpp's converter) may not. Is --reference the model this checkpoint was trained from?")
