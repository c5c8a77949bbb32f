"""Several data sources mixed into one cache: what each source is, and how many of its documents are taken.

``data.path`` is one source; ``data.sources`` is a list of them, each with its
own files, reader, format, field mapping and share. Both end up as a list of
:class:`Source` (:func:`resolve_sources`), so prepare has one code path.

What a share means (docs/data.md, "Mixtures"): a **weight** is a source's
share of the training **documents** (conversations, records), not of tokens:
the weights are normalised to proportions ``p_i``, and the mixture is the
largest one in which every source gives its proportion without repeating a
document: ``M = min_i N_i / p_i`` documents, source i giving
``round(p_i * M)`` of its ``N_i`` usable ones, drawn without replacement by
``data.seed``. The scarcest source (relative to its weight) is taken whole and
the others are downsampled, as ``datasets.interleave_datasets(probabilities,
stopping_strategy="first_exhausted")`` does (LLaMA-Factory's
``mix_strategy=interleave_under`` with ``interleave_probs``), but with exact
counts instead of a random draw per example. **num_samples** takes exactly
that many documents of a source: fewer than it has, a seeded sample without
replacement; more, every document ``num_samples // N`` times plus a seeded
sample of the rest (upsampling). Token shares follow from the documents'
lengths and are reported after prepare (meta.json, ``status``).

Nothing here imports torch or transformers: the planner uses it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from fsdp_workflow.config.schema import DataConfig, DataFormat, DataSource

if TYPE_CHECKING:  # numpy only where documents are selected (prepare), not when a plan is checked
    import numpy as np


@dataclass(frozen=True)
class Source:
    """One source, with ``data.*`` filled in where the source leaves a key unset."""

    index: int
    key: str  # the config key naming it: "data.path" or "data.sources[1]"
    name: str
    path: str
    source: DataSource
    format: DataFormat
    text_field: str
    fields: Dict[str, str]
    weight: Optional[float]
    num_samples: Optional[int]

    def sub(self, name: str) -> str:
        """The config key of one of this source's settings (``data.sources[1].fields``, ``data.path``)."""
        if self.key == "data.path":
            return "data.path" if name == "path" else f"data.{name}"
        return f"{self.key}.{name}"


def is_mixture(d: DataConfig) -> bool:
    """``data.sources`` is set (several sources, or one with a share)."""
    return bool(d.sources)


def _default_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path)) if path else ""
    return base or str(path)


def resolve_sources(d: DataConfig) -> List[Source]:
    """``data.sources`` (or ``data.path`` as one source), each with the ``data.*`` defaults filled in.

    Names are made unique by appending ``#i`` to a repeated one.

    Args:
        d: the data config.

    Returns:
        The sources in config order (empty for ``data.source=synthetic`` without sources).
    """
    if not d.sources:
        if d.source == DataSource.synthetic or not d.path:
            return []
        return [Source(0, "data.path", _default_name(d.path), d.path, d.source, d.format, d.text_field,
                       dict(d.fields), None, None)]
    out: List[Source] = []
    seen: Dict[str, int] = {}
    for i, s in enumerate(d.sources):
        path = str(s.path) if s.path is not None else ""
        name = s.name or _default_name(path)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{i}"
        out.append(Source(
            i, f"data.sources[{i}]", name, path,
            s.source if s.source is not None else d.source,
            s.format if s.format is not None else d.format,
            s.text_field if s.text_field is not None else d.text_field,
            dict(s.fields) if s.fields is not None else dict(d.fields),
            None if s.weight is None else float(s.weight), s.num_samples))
    return out


def planned_shares(sources: Sequence[Source]) -> List[Optional[float]]:
    """Each source's share of the training documents as configured (None: by count, not known before prepare)."""
    if not sources:
        return []
    if len(sources) == 1 and sources[0].weight is None and sources[0].num_samples is None:
        return [1.0]
    if all(s.weight is not None for s in sources):
        total = sum(float(s.weight or 0) for s in sources)
        return [float(s.weight or 0) / total if total > 0 else None for s in sources]
    if all(s.num_samples is not None for s in sources):
        total = sum(int(s.num_samples or 0) for s in sources)
        return [int(s.num_samples or 0) / total if total > 0 else None for s in sources]
    return [None for _ in sources]


def document_counts(sources: Sequence[Source], available: Sequence[int]) -> List[int]:
    """How many training documents each source gives to the mixture.

    Args:
        sources: the sources (all with ``weight``, all with ``num_samples``, or one source with neither).
        available: each source's usable training documents.

    Returns:
        The count per source: all of them for a single unweighted source;
        ``num_samples`` when given; else ``round(p_i * M)`` with
        ``M = min_i available_i / p_i`` (see the module docstring), capped at ``available_i``.
    """
    if len(sources) == 1 and sources[0].weight is None and sources[0].num_samples is None:
        return [int(available[0])]
    if all(s.num_samples is not None for s in sources):
        return [int(s.num_samples or 0) for s in sources]
    p = [float(s.weight or 0) for s in sources]
    total = sum(p)
    p = [w / total for w in p]
    mix = min(n / q for n, q in zip(available, p))
    return [min(int(math.floor(q * mix + 0.5)), int(n)) for q, n in zip(p, available)]


def select(rng: np.random.Generator, available: int, count: int) -> np.ndarray:
    """``count`` indices into ``available`` documents: a seeded sample, repeating whole copies when upsampling.

    Args:
        rng: the mixture's generator (``data.seed``).
        available: the source's usable documents.
        count: how many to take.

    Returns:
        int64 indices, in ascending order within each copy (the mixture is shuffled afterwards).
    """
    import numpy as np

    if count <= 0 or available <= 0:
        return np.zeros(0, np.int64)
    copies, rest = divmod(count, available)
    parts = [np.arange(available, dtype=np.int64)] * copies
    if rest:
        parts.append(np.sort(rng.choice(available, size=rest, replace=False)).astype(np.int64))
    return np.concatenate(parts)


def describe(meta: Dict[str, Any]) -> List[str]:
    """One line per source of a cache's meta.json: name, documents, tokens and shares (empty for one source).

    Used by ``status`` and ``data.inspect``; the model card may call it too.
    """
    rows = meta.get("sources")
    if not isinstance(rows, list) or len(rows) < 2 and not meta.get("mixture"):
        return []
    out = []
    for r in rows:
        if not isinstance(r, dict):
            continue
        out.append(f"{r.get('name')} ({r.get('path')}): {r.get('train_documents', 0):,} documents "
                   f"({100 * float(r.get('document_share') or 0):.1f}%), {r.get('train_tokens', 0):,} tokens "
                   f"({100 * float(r.get('token_share') or 0):.1f}%), {r.get('records', 0):,} records read, "
                   f"{r.get('bad_records', 0):,} bad")
    return out
