"""The data lines of the planner's summary: each source's records, tokens and share, as far as planning can know.

Planning must answer in about a second on a login node, so records are
counted only where that is cheap (JSON lines and text blocks of files up to
:data:`COUNT_LIMIT_BYTES` in all, Parquet row counts from the file footers),
and tokens are known only after prepare: they are shown from the cache of an
earlier prepare of this run directory when its sources match, else said to
come "after prepare". No torch or transformers here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from fsdp_workflow.config.schema import DataSource, WorkflowConfig, data_parallel_size, run_layout
from fsdp_workflow.data.mixture import Source, is_mixture, planned_shares, resolve_sources
from fsdp_workflow.data.sources import DataError, count_file, expand

COUNT_LIMIT_BYTES = 256 << 20  # count the records of a source only up to this much data
EPOCHS_NOTED = 3.0  # more passes than this over the training data are said (planning and prepare)


def count_records(src: Source) -> Optional[int]:
    """The records of a source, where counting is cheap; None otherwise (missing files, too large, hf_disk)."""
    try:
        files = expand(src.source, src.path, src.key)
    except (DataError, OSError):
        return None
    if src.source == DataSource.parquet:
        try:
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        except Exception:  # noqa: BLE001 - a summary line, not a check: prepare reports the real error
            return None
    if src.source not in (DataSource.jsonl, DataSource.text):
        return None
    if sum(os.path.getsize(f) for f in files) > COUNT_LIMIT_BYTES:
        return None
    try:
        return sum(count_file(src.source, f) for f in files)  # decompressed, arrays by element: as prepare reads
    except (DataError, OSError):
        return None  # prepare names the problem


def _prepared_meta(cfg: WorkflowConfig) -> Dict[str, Any]:
    """``meta.json`` of the cache this run directory last prepared ({} when there is none)."""
    try:
        pointer = json.loads(run_layout(cfg).data_pointer.read_text())
        with open(os.path.join(pointer["cache"], "meta.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _prepared_rows(cfg: WorkflowConfig) -> Dict[str, Dict[str, Any]]:
    """Per-source rows of the cache this run directory last prepared (by source key), if it matches the config."""
    meta = _prepared_meta(cfg)
    rows = meta.get("sources")
    return {r["key"]: r for r in rows if isinstance(r, dict) and "key" in r} if isinstance(rows, list) else {}


def epochs_note(cfg: WorkflowConfig, samples: int, exact: bool) -> Optional[str]:
    """How many times ``train.max_steps`` reads the training data, when more than :data:`EPOCHS_NOTED`; else None.

    Args:
        cfg: the run's config (steps and global batch).
        samples: the packed training samples (``exact``), or the records read, which bound them from
            above: a packed sample holds whole documents, so the epochs are then at least the figure given.
        exact: ``samples`` counts packed samples (prepare's, or an earlier prepare's cache).
    """
    t = cfg.train
    batch = t.micro_batch_size * t.grad_accum_steps * data_parallel_size(cfg)
    taken = t.max_steps * batch
    if samples < 1 or taken / samples <= EPOCHS_NOTED:
        return None
    epochs = taken / samples
    over = (f"the {samples:,} packed training samples" if exact else
            f"the {samples:,} records (at most as many packed samples: each holds whole documents)")
    fix = (f"train.max_steps={max(int(EPOCHS_NOTED * samples // batch), 1)} for {EPOCHS_NOTED:g} epochs, or more data"
           if exact else "fewer train.max_steps or more data (prepare gives the exact count)")
    return (f"train.max_steps={t.max_steps} x {batch} sequences per step = {taken:,} samples: "
            f"{'' if exact else 'at least '}{epochs:.1f} epochs over {over}. Each document is trained about "
            f"{epochs:.0f} times, which a model memorises (the training loss falls while the eval loss rises); "
            f"if that is not meant: {fix}")


def summary_lines(cfg: WorkflowConfig) -> List[str]:
    """``data ...`` lines for the planner's summary (none for synthetic data).

    Args:
        cfg: the run's config.

    Returns:
        One line for ``data.path``; for a mixture a heading and one line per
        source: reader/format, weight or num_samples, planned share of the
        training documents, records (where counted) and tokens (after prepare).
    """
    d = cfg.data
    sources = resolve_sources(d)
    if not sources:
        return []
    shares = planned_shares(sources)
    prepared = _prepared_rows(cfg)
    lines = []
    if is_mixture(d):
        lines.append(f"data         mixture of {len(sources)} source(s), mixed by data.seed={d.seed}; "
                     "share = of the training documents")
    for src, share in zip(sources, shares):
        n = count_records(src)
        records = f"{n:,} records" if n is not None else "records counted by prepare"
        row = prepared.get(src.key)
        if row and row.get("path") == src.path:
            tokens = f"{row.get('train_tokens', 0):,} tokens ({100 * float(row.get('token_share') or 0):.1f}%) " \
                     "at the last prepare"
        else:
            tokens = "tokens after prepare"
        how = (f"weight {src.weight:g}" if src.weight is not None else
               f"num_samples {src.num_samples:,}" if src.num_samples is not None else "")
        share_s = f"share {100 * share:.1f}%" if share is not None else "share after prepare"
        head = "data        " if not is_mixture(d) else "  -"
        lines.append(f"{head} {src.name}: {src.source.value}/{src.format.value}"
                     + (f", {how}" if how else "") + (f", {share_s}" if is_mixture(d) else "")
                     + f", {records}, {tokens}")
    if not is_mixture(d):  # a mixture's documents per source are known after prepare (which says it then)
        train = (_prepared_meta(cfg).get("splits") or {}).get("train") or {}
        prepared_here = sources[0].key in prepared and prepared[sources[0].key].get("path") == sources[0].path
        note = (epochs_note(cfg, int(train.get("samples") or 0), exact=True) if prepared_here and train
                else epochs_note(cfg, n, exact=False) if n is not None else None)
        if note:
            lines.append("epochs       " + note)
    return lines
