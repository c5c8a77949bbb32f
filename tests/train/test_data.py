"""Data: documents from each source, held-out split, packing without padding, deterministic resumable order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_workflow.config.schema import DataConfig, DataSource
from fsdp_workflow.train.data import DataError, PackedSource, RankBatches, build_sources, pack, read_documents, split_held_out
from fsdp_workflow.train.tokenizer import byte_level_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def test_text_and_jsonl_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    assert read_documents(DataSource.text, str(tmp_path / "a.txt"), "text") == ["first doc\nline two", "second doc"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text(json.dumps({"body": "héllo"}) + "\n\n" + json.dumps({"body": 7}) + "\n")
    assert read_documents(DataSource.jsonl, str(tmp_path / "d"), "body") == ["héllo", "7"]
    with pytest.raises(DataError, match="data.text_field"):
        read_documents(DataSource.jsonl, str(tmp_path / "d" / "x.jsonl"), "text")
    with pytest.raises(DataError, match="matches no"):
        read_documents(DataSource.text, str(tmp_path / "nothing*.txt"), "text")


def test_parquet_and_hf_disk_sources(tmp_path: Path) -> None:
    import datasets  # the `data` extra, part of `dev`: these readers run for real in the suite
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", "c"], "n": [1, 2]}), tmp_path / "x.parquet")
    assert read_documents(DataSource.parquet, str(tmp_path / "x.parquet"), "text") == ["a b", "c"]
    with pytest.raises(DataError, match="data.text_field"):
        read_documents(DataSource.parquet, str(tmp_path / "x.parquet"), "body")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["u", "v"]}),
                          "test": datasets.Dataset.from_dict({"text": ["w"]})}).save_to_disk(str(tmp_path / "hf"))
    assert read_documents(DataSource.hf_disk, str(tmp_path / "hf"), "text") == ["u", "v"]
    with pytest.raises(DataError, match="save_to_disk"):
        read_documents(DataSource.hf_disk, str(tmp_path / "missing"), "text")


@pytest.mark.parametrize("source,module,hint", [(DataSource.parquet, "pyarrow", "pip install pyarrow"),
                                                (DataSource.hf_disk, "datasets", "pip install datasets")])
def test_missing_reader_package_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  source, module, hint) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    monkeypatch.setitem(sys.modules, module + ".parquet", None)
    with pytest.raises(DataError, match=hint):
        read_documents(source, str(tmp_path / "x.parquet"), "text")


def test_held_out_split_is_stable() -> None:
    docs = [f"doc {i}" for i in range(200)]
    train, held = split_held_out(docs, 0.1, seed=3)
    assert (train, held) == split_held_out(docs, 0.1, seed=3)
    assert not set(train) & set(held) and len(train) + len(held) == 200 and 5 < len(held) < 40


def test_packing_has_no_padding(tok) -> None:
    blocks = pack(["ab", "cde", "f"], tok, seq_len=3, add_eos=True, seed=0)
    assert blocks.shape == (3, 3)  # 2+1 + 3+1 + 1+1 = 9 tokens, every one used
    assert (blocks == tok.eos_token_id).sum() == 3 and (blocks == tok.pad_token_id).sum() == 0


def test_rank_batches_cover_global_order_and_resume() -> None:
    src = PackedSource(torch.arange(40).view(10, 4), seq_len=4, seed=1)
    ranks = [RankBatches(src, 2, r, 2) for r in range(2)]
    seen = [torch.cat([ranks[r].next() for r in range(2)]) for _ in range(5)]  # 5 steps x 4 samples: 2 epochs
    first_epoch = torch.cat(seen)[:10, 0].tolist()
    assert sorted(first_epoch) == list(range(0, 40, 4))  # every block once per epoch
    # Resume at step 3 with ONE rank of micro-batch 4: the same global samples follow.
    solo = RankBatches(src, 4, 0, 1)
    solo.load_state_dict({"samples_consumed": ranks[0].state_dict()["samples_consumed"] - 8})
    assert torch.equal(solo.next(), seen[3]) and torch.equal(solo.next(), seen[4])


def test_synthetic_is_a_function_of_the_index(tok) -> None:
    train, held = build_sources(DataConfig(source=DataSource.synthetic, seed=5), tok, seq_len=16, vocab_size=260)
    assert torch.equal(train.sample(7), train.sample(7)) and not torch.equal(train.sample(7), train.sample(8))
    assert int(train.sample(3).max()) < 260 and held is not None
