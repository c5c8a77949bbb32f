"""Which data a run trained on, by source: what ``status`` and the model card both name.

The sources are the config's (``data.sources`` of a mixture, else ``data.path``); their
counts (records read, documents and tokens taken, shares) come from the prepared cache's
``meta.json`` where the prepare step wrote them. Before a prepare, or for a cache that
cannot be opened, the configured sources are named without counts: nothing is estimated.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from fsdp_workflow.config.record import RunRecord
from fsdp_workflow.config.schema import DataSource
from fsdp_workflow.data.cache import CacheError
from fsdp_workflow.data.mixture import describe
from fsdp_workflow.data.open import open_cache


def cache_meta(record: RunRecord) -> Optional[Dict[str, Any]]:
    """``meta.json`` of the cache the run trains on (None before a prepare, for synthetic data, or unreadable)."""
    if not record.layout.data_pointer.exists():
        return None
    try:
        cache = open_cache(record.layout, pad_id=0)  # reads the pointer and meta.json; maps no array yet
    except CacheError:
        return None
    return cache.meta if cache is not None else None


def source_lines(record: RunRecord, meta: Optional[Dict[str, Any]] = None) -> List[str]:
    """One line per data source: its name, path and, where the cache has them, records, tokens and share.

    Args:
        record: the run's record (its typed config names the sources).
        meta: the cache's meta.json (:func:`cache_meta`); read here when None.

    Returns:
        The lines: from the cache's meta.json when it has them, else from the config; empty for
        synthetic data, or without either.
    """
    meta = meta if meta is not None else cache_meta(record)
    rows = meta.get("sources") if meta else None
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        if len(rows) > 1 or meta.get("mixture"):  # type: ignore[union-attr]
            return describe(meta)  # type: ignore[arg-type]  # the mixture's lines, as data.inspect prints them
        r = rows[0]
        return [f"{r.get('path')}: {r.get('train_documents', 0):,} documents (100.0%), {r.get('train_tokens', 0):,} "
                f"tokens, {r.get('records', 0):,} records read, {r.get('bad_records', 0):,} bad"]
    cfg = record.config  # before a prepare: the configured sources, without counts
    if cfg is None or cfg.data.source == DataSource.synthetic:
        return []
    if cfg.data.sources:
        total = sum(s.weight or 0.0 for s in cfg.data.sources)
        out = []
        for s in cfg.data.sources:
            share = (f"weight {s.weight:g}" + (f" ({100 * s.weight / total:.1f}%)" if total else "")
                     if s.weight is not None else f"{s.num_samples:,} documents" if s.num_samples is not None else "")
            out.append(f"{s.name or s.path.rsplit('/', 1)[-1]} ({s.path}): {share}; counts after prepare")
        return out
    return [f"{cfg.data.path}: counts after prepare"] if cfg.data.path else []


__all__ = ["cache_meta", "source_lines"]
