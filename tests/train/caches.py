"""Token caches built directly with the cache writer (for unit tests that need no prepare step)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from fsdp_workflow.data.cache import IGNORE_INDEX, TokenCache, commit_cache, write_split

PAD = 258  # the byte-level tokenizer's <pad>


def build_cache(root: Path, docs: Sequence[Sequence[int]], seq_len: int, eval_docs: Sequence[Sequence[int]] = (),
                trained: Sequence[Sequence[bool]] = ()) -> TokenCache:
    """A committed cache of ``docs`` (and ``eval_docs``), every token trained unless ``trained`` says otherwise."""
    tmp = root.with_name(root.name + ".tmp")
    for split, split_docs in (("train", docs), ("eval", eval_docs)):
        if not split_docs:
            continue
        tokens = [np.asarray(d, dtype=np.int64) for d in split_docs]
        masks = [np.asarray(trained[i], dtype=bool) if split == "train" and trained else np.ones(len(d), bool)
                 for i, d in enumerate(tokens)]
        labels = [np.where(m, t, IGNORE_INDEX) for t, m in zip(tokens, masks)]
        write_split(tmp / split, tokens, labels, seq_len)
    commit_cache(tmp, root, {"key": "test", "seq_len": seq_len})
    return TokenCache(root, PAD)
