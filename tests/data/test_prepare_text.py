"""prepare() for format=text: every source, the pointer, reuse, 1 vs 2 workers, open_cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from fsdp_workflow.config.schema import DataSource, run_layout
from fsdp_workflow.data.cache import IGNORE_INDEX, CacheError
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.data.prepare import main, prepare
from fsdp_workflow.data.sources import DataError

from .conftest import CORPUS, make_cfg, write_jsonl

TEXTS = ["alpha beta gamma", "delta epsilon", "zeta ünïcode ✓", "eta theta iota kappa"]


def _decode(tokens: np.ndarray) -> bytes:
    return bytes(int(t) for t in tokens if t < 256)


def test_text_source_documents_with_eos(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("\n\n".join(TEXTS) + "\n")
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path=str(f), eval_fraction=0.0)
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.path is not None and not p.reused
    cache = open_cache(run_layout(cfg), pad_id=258)
    assert cache is not None
    split = cache.split("train")
    assert split is not None and cache.split("eval") is None
    offs = np.asarray(split.doc_offsets)
    docs = sorted(_decode(split.tokens[offs[i]:offs[i + 1]]).decode() for i in range(len(offs) - 1))
    assert docs == sorted(TEXTS)
    # EOS (257) ends every document, and every token but each document's first is trained
    assert all(split.tokens[offs[i + 1] - 1] == 257 for i in range(len(offs) - 1))
    labels = np.asarray(split.labels)
    assert (labels[offs[:-1]] == IGNORE_INDEX).all()
    trained = np.ones(len(labels), bool)
    trained[offs[:-1]] = False
    assert (labels[trained] == np.asarray(split.tokens)[trained]).all()
    s = split.sample(0)
    assert s.position_ids[0] == 0 and (s.labels[s.input_ids == 258] == IGNORE_INDEX).all()
    pointer = json.loads(run_layout(cfg).data_pointer.read_text())
    assert pointer == {"cache": str(p.path), "key": p.key}


@pytest.mark.parametrize("source", ["jsonl", "parquet", "hf_disk"])
def test_record_sources(tmp_path: Path, source: str) -> None:
    records = [{"body": t, "other": 1} for t in TEXTS]
    if source == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", records)
    elif source == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        from datasets import Dataset

        path = tmp_path / "ds"
        Dataset.from_list(records).save_to_disk(str(path))
    cfg = make_cfg(tmp_path / "run", source=DataSource(source), path=str(path), text_field="body", eval_fraction=0.0)
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["splits"]["train"]["documents"] == len(TEXTS)
    assert p.meta["splits"]["train"]["tokens"] == sum(len(t.encode()) + 1 for t in TEXTS)


def test_missing_text_field_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"txt": "bad"}])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path))
    with pytest.raises(DataError, match=r"d\.jsonl:2: no field 'text'"):
        prepare(cfg, num_workers=1, progress=False)


def test_reuse_and_same_arrays_with_1_and_2_workers(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path=str(CORPUS), eval_fraction=0.1)
    first = prepare(cfg, num_workers=1, progress=False)
    t0 = time.monotonic()
    again = prepare(cfg, num_workers=2, progress=False)
    assert again.reused and again.path == first.path and time.monotonic() - t0 < 2.0
    cfg.data.cache_dir = str(tmp_path / "shared")
    two = prepare(cfg, num_workers=2, progress=False)
    assert not two.reused and two.key == first.key and two.path != first.path
    for split in ("train", "eval"):
        for name in ("tokens.npy", "labels.npy", "doc_offsets.npy", "sample_docs.npy"):
            assert np.array_equal(np.load(first.path / split / name), np.load(two.path / split / name)), name
    # a changed setting is another cache
    cfg.train.seq_len = 128
    assert prepare(cfg, num_workers=1, progress=False).key != first.key


def test_synthetic_and_missing_pointer(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path / "run")
    layout = run_layout(cfg)
    with pytest.raises(CacheError, match="python -m fsdp_workflow.data.prepare"):
        open_cache(layout, pad_id=0)
    p = prepare(cfg, progress=False)
    assert p.path is None
    assert json.loads(layout.data_pointer.read_text()) == {"cache": None, "synthetic": True}
    assert open_cache(layout, pad_id=0) is None


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_workflow.config.load import to_yaml

    path = write_jsonl(tmp_path / "d.jsonl", [{"nope": 1}])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path))
    run_layout(cfg).root.mkdir(parents=True)
    run_layout(cfg).config.write_text(to_yaml(cfg))
    assert main([str(tmp_path / "run"), "--workers", "1"]) == 2
    assert "d.jsonl:1" in capsys.readouterr().err
    write_jsonl(path, [{"text": "fine"}])
    assert main([str(tmp_path / "run"), "--workers", "1"]) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_data_num_workers_sets_the_prepare_processes(tmp_path: Path, workers: int) -> None:
    """``data.num_workers`` is what prepare uses when no ``--workers`` is given (recorded in meta.json)."""
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path=str(CORPUS), num_workers=workers)
    assert prepare(cfg, progress=False).meta["workers"] == workers
