"""The one size parser: ``5GB``, ``500MB``, ``1TB``, ``2GiB`` or a byte count.

Validation (``consolidate.max_shard_size``) and the consolidator's
``--max-shard-size`` both call :func:`parse_size`, so a value the planner accepts
is a value the consolidation job can use. Decimal units are powers of 1000 and
binary ones powers of 1024, as in ``transformers``' ``save_pretrained``.

Why not a library's: ``huggingface_hub``'s ``parse_size_to_int`` (a private
module) takes only KB..TB, neither binary units nor a plain byte count, and
``transformers.utils.convert_file_size_to_int`` is gone in transformers 5 (and
importing transformers would cost planning seconds).
"""

from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
SIZE_EXAMPLES = "5GB, 500MB, 1TB, 2GiB or a byte count"


def parse_size(value: Union[str, int]) -> int:
    """Return the number of bytes ``value`` names.

    Args:
        value: a byte count, or a number with one of the units B, KB, MB, GB, TB,
            KiB, MiB, GiB, TiB (case-insensitive).

    Returns:
        The size in bytes, at least 1.

    Raises:
        ValueError: ``value`` is not a size, or names less than one byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size (expected {SIZE_EXAMPLES})")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a size (expected {SIZE_EXAMPLES})")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size < 1:
        raise ValueError(f"{value!r} is less than one byte (expected {SIZE_EXAMPLES})")
    return size
