"""A damaged cache is never used: readers refuse it naming the file, prepare rebuilds it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fsdp_workflow.config.schema import DataSource, run_layout
from fsdp_workflow.data.cache import CacheError
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.data.prepare import prepare

from .conftest import make_cfg, write_jsonl

TEXTS = [{"text": f"document number {i} with some words"} for i in range(40)]


def _prepared(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.1)
    return cfg, prepare(cfg, num_workers=1, progress=False)


def test_meta_records_sizes_and_checksums(tmp_path: Path) -> None:
    _, p = _prepared(tmp_path)
    check = p.meta["check"]
    assert {"train/tokens.npy", "train/labels.npy", "train/doc_offsets.npy", "train/sample_docs.npy",
            "train/doc_sources.npy", "eval/tokens.npy"} <= set(check)
    for rel, entry in check.items():
        assert entry["bytes"] == os.path.getsize(p.path / rel) and len(entry["sampled_sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_cache_is_refused_then_rebuilt_by_prepare(tmp_path: Path, damage: str) -> None:
    cfg, p = _prepared(tmp_path)
    tokens = p.path / "train" / "tokens.npy"
    good = tokens.read_bytes()
    if damage == "truncate":
        tokens.write_bytes(good[: len(good) // 2])
    elif damage == "flip":
        tokens.write_bytes(good[:-8] + bytes(b ^ 0xFF for b in good[-8:]))
    else:
        tokens.unlink()
    with pytest.raises(CacheError, match=r"damaged: train/tokens\.npy.*fsdp_workflow\.data\.prepare"):
        open_cache(run_layout(cfg), pad_id=258)
    again = prepare(cfg, num_workers=1, progress=False)
    assert not again.reused and again.path == p.path
    assert tokens.read_bytes() == good  # rebuilt, identical
    cache = open_cache(run_layout(cfg), pad_id=258)
    assert cache is not None and cache.split("train") is not None
    assert prepare(cfg, num_workers=1, progress=False).reused  # and sound: reused from now on


def test_the_trainer_refuses_a_damaged_cache_and_names_prepare(tmp_path: Path) -> None:
    from fsdp_workflow.train.data import DataError as TrainDataError
    from fsdp_workflow.train.data import open_sources

    cfg, p = _prepared(tmp_path)
    labels = p.path / "train" / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-4])
    with pytest.raises(TrainDataError, match=r"labels\.npy has \d+ bytes.*prepare"):
        open_sources(cfg, pad_id=258)


def test_source_of_each_document(tmp_path: Path) -> None:
    cfg, p = _prepared(tmp_path)
    cache = open_cache(run_layout(cfg), pad_id=258)
    assert cache is not None
    offs = np.load(p.path / "train" / "doc_offsets.npy")
    tokens = np.load(p.path / "train" / "tokens.npy")
    for d in range(len(offs) - 1):
        src = cache.source_of("train", d)
        assert src is not None and src.startswith(str(tmp_path / "d.jsonl") + ":")
        line = int(src.rsplit(":", 1)[1])
        text = bytes(int(t) for t in tokens[offs[d]:offs[d + 1]] if t < 256).decode()
        assert text == TEXTS[line - 1]["text"]
