"""Plan-time rules of ``data.sources`` (a mixture): every problem of every source, in one report.

Run with the other data rules (:data:`fsdp_workflow.data.plan_checks.RULES`) when a
run is planned; a violation exits 2 before anything is written. The format
and field rules of each source are :mod:`fsdp_workflow.data.plan_checks`' own, run
per source.
"""

from __future__ import annotations

import glob
import math
import os

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.path_keys import is_url
from fsdp_workflow.config.schema import ClusterKind, DataSource, WorkflowConfig

_EXAMPLE = "data.sources='[{path: /data/a.jsonl, weight: 3}, {path: /data/b.jsonl, weight: 1}]'"


def _exists(path: str) -> bool:
    path = os.path.expanduser(path)
    if set("*?[") & set(path):
        return bool(glob.glob(path))
    return os.path.exists(path)


def check_sources(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """``data.sources``: not beside ``data.path``; each a readable path with one positive, finite share."""
    d = cfg.data
    if not d.sources:
        return
    if d.path:
        r.error("data.path", d.path, "data.path and data.sources are both set: a run reads one source "
                "(data.path) or a mixture (data.sources), not both",
                "data.path=null to mix data.sources, or data.sources=[] to read data.path alone")
    if d.source == DataSource.synthetic:
        r.error("data.source", d.source.value, "data.source=synthetic prepares nothing, so data.sources would be "
                "ignored", "data=mixture (or data.source=jsonl: the reader of every source that sets none)")
    hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    kinds = set()
    seen = {}
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if s.source == DataSource.synthetic:
            r.error(f"{key}.source", s.source.value, "a source of a mixture reads files; synthetic data reads none",
                    f"{key}.source=jsonl (or text, parquet, hf_disk), or data.source=jsonl for every source")
        if not s.path:
            r.error(f"{key}.path", s.path, "every source needs its files", f"{key}.path=/path/to/data.jsonl")
        elif not _exists(str(s.path)) and not is_url(str(s.path)):  # a URL: rules_path names it
            where = "on this machine" if hard else "here (fine if it exists on the cluster's shared filesystem)"
            (r.error if hard else r.warn)(f"{key}.path", s.path, f"the source's data does not exist {where}",
                                          f"{key}.path=/absolute/path/that/exists")
        else:
            real = os.path.realpath(os.path.expanduser(str(s.path)))
            if real in seen:
                r.error(f"{key}.path", s.path, f"data.sources[{seen[real]}] reads the same path: its documents "
                        "would count twice and file:line would be ambiguous",
                        f"one source per path; raise data.sources[{seen[real]}].weight (or num_samples) instead")
            seen.setdefault(real, i)
        if s.weight is not None and s.num_samples is not None:
            r.error(f"{key}.num_samples", s.num_samples, f"{key} sets both weight and num_samples",
                    f"keep one: {key}.weight={s.weight} or {key}.num_samples={s.num_samples}")
        elif s.weight is None and s.num_samples is None:
            r.error(f"{key}.weight", None, "every source of a mixture needs its share",
                    f"{key}.weight=1 (a relative share of the training documents) or {key}.num_samples=N")
        if s.weight is not None:
            kinds.add("weight")
            w = float(s.weight)
            if not math.isfinite(w) or w <= 0:
                r.error(f"{key}.weight", s.weight, "a weight is a relative share of the training documents: "
                        "it must be a finite number above 0", f"{key}.weight=1 (or leave the source out)")
        if s.num_samples is not None:
            kinds.add("num_samples")
            if s.num_samples < 1:
                r.error(f"{key}.num_samples", s.num_samples, "the documents to take from this source: at least 1",
                        f"{key}.num_samples=1000 (or leave the source out)")
    if len(kinds) > 1:
        r.error("data.sources", [s.weight if s.weight is not None else s.num_samples for s in d.sources],
                "some sources give a weight and others num_samples: a weight is a share of a mixture whose size "
                "the sources set, num_samples an absolute count, and the two do not combine",
                "give every source a weight, or every source a num_samples; e.g. " + _EXAMPLE)
