"""Opening the run's token cache from its data pointer (what the trainer calls on every rank)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.data.cache import CacheError, TokenCache


def open_cache(layout: RunDir, pad_id: int) -> Optional[TokenCache]:
    """The cache ``layout``'s data pointer names, memory-mapped; None for ``data.source=synthetic``.

    Args:
        layout: the run directory.
        pad_id: the token id padding is filled with (never trained).

    Raises:
        CacheError: no pointer, or it names a missing or incomplete cache; the message says what to run.
    """
    fix = f"run `python -m fsdp_workflow.data.prepare {layout.root}` first (the prepare job of the chain)"
    try:
        pointer = json.loads(layout.data_pointer.read_text())
    except FileNotFoundError as err:
        raise CacheError(f"{layout.data_pointer}: the data has not been prepared for this run; {fix}") from err
    except (OSError, ValueError) as err:
        raise CacheError(f"{layout.data_pointer}: unreadable ({err}); {fix}") from err
    if not isinstance(pointer, dict) or "cache" not in pointer:
        raise CacheError(f"{layout.data_pointer}: not a data pointer (no 'cache' entry); {fix}")
    if pointer.get("cache") is None:
        if pointer.get("synthetic"):
            return None
        raise CacheError(f"{layout.data_pointer}: names no cache; {fix}")
    try:
        cache = TokenCache(Path(pointer["cache"]), pad_id)
    except CacheError as err:
        raise CacheError(f"{err}; {fix}") from err
    key = pointer.get("key")
    if key and cache.meta.get("key") not in (None, key):
        raise CacheError(f"{cache.path}: holds cache key {cache.meta.get('key')}, the run's pointer says {key}; {fix}")
    return cache
