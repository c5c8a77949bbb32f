"""Bad records named with file and line (fail or skip and count); overlong documents truncated or dropped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fsdp_workflow.config.schema import DataFormat, DataSource, OnBadRecord, Overlong, TrainOn
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.prepare import prepare
from fsdp_workflow.data.sources import DataError
from fsdp_workflow.data.templates import TemplateError

from .conftest import make_cfg, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD = [
    ({"msgs": []}, "no field 'messages'"),
    ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}, "empty assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ('{"messages": [', "not valid JSON"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "no string 'content'"),
]


def _chat_cfg(tmp_path: Path, records: list, **data: object):
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    data = {"chat_template": "chatml", "eval_fraction": 0.0, **data}
    return make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.conversation,
                    **data)


def test_fail_names_the_first_five_with_file_line_and_count(tmp_path: Path) -> None:
    records = [GOOD] + [b for b, _ in BAD] + [GOOD]
    cfg = _chat_cfg(tmp_path, records)
    with pytest.raises(DataError) as err:
        prepare(cfg, num_workers=1, progress=False)
    msg = str(err.value)
    assert msg.startswith("6 bad record(s)") and "... and 1 more" in msg and "on_bad_record=skip" in msg
    for line, (_, why) in enumerate(BAD[:5], start=2):
        assert f"chat.jsonl:{line}: " in msg and why in msg
    assert not (tmp_path / "run" / "data.json").exists()


def test_skip_counts_in_meta(tmp_path: Path) -> None:
    cfg = _chat_cfg(tmp_path, [GOOD] + [b for b, _ in BAD] + [GOOD], on_bad_record=OnBadRecord.skip)
    p = prepare(cfg, num_workers=2, progress=False)
    assert p.meta["bad_records"] == len(BAD) and p.meta["records"] == len(BAD) + 2
    assert p.meta["splits"]["train"]["documents"] == 2


def test_mapped_field_missing_names_the_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pc.jsonl", [{"question": "q", "answer": "a"}, {"question": "q"}])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.prompt_completion,
                   fields={"prompt": "question", "completion": "answer"})
    with pytest.raises(DataError, match=r"pc\.jsonl:2: no field 'answer' \(data\.fields\.completion='answer'\)"):
        prepare(cfg, num_workers=1, progress=False)


def test_no_template_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    cfg = _chat_cfg(tmp_path, [GOOD], chat_template=None)
    with pytest.raises(TemplateError, match="data.chat_template"):
        prepare(cfg, num_workers=1, progress=False)
    cfg.data.chat_template = "nosuch"
    with pytest.raises(TemplateError, match="chatml"):
        prepare(cfg, num_workers=1, progress=False)


def _long_records() -> list:
    return [{"messages": [{"role": "user", "content": "u" * 10}, {"role": "assistant", "content": "a" * 200}]},
            {"messages": [{"role": "user", "content": "u" * 300}, {"role": "assistant", "content": "late"}]},
            GOOD]


def test_overlong_truncated_and_counted(tmp_path: Path) -> None:
    cfg = _chat_cfg(tmp_path, _long_records(), overlong=Overlong.truncate)
    cfg.train.seq_len = 100
    p = prepare(cfg, num_workers=1, progress=False)
    # the first is cut to 100 tokens; the second loses every trained token and is left out
    assert p.meta["truncated"] == 2 and p.meta["dropped_untrained"] == 1
    offs = np.load(p.path / "train" / "doc_offsets.npy")
    assert sorted(np.diff(offs).tolist())[-1] == 100 and len(offs) == 3


def test_overlong_dropped_and_counted(tmp_path: Path) -> None:
    cfg = _chat_cfg(tmp_path, _long_records(), overlong=Overlong.drop, train_on=TrainOn.all)
    cfg.train.seq_len = 100
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["dropped_overlong"] == 2 and p.meta["truncated"] == 0
    assert p.meta["splits"]["train"]["documents"] == 1
    labels = np.load(p.path / "train" / "labels.npy")
    assert labels[0] == IGNORE_INDEX and (labels[1:] != IGNORE_INDEX).all()


def test_cache_reads_with_numpy_alone(tmp_path: Path) -> None:
    """The documented numpy-only reading (docs/data.md) gives each sample's documents and labels."""
    cfg = _chat_cfg(tmp_path, [GOOD] * 5)
    cfg.train.seq_len = 1024
    p = prepare(cfg, num_workers=1, progress=False)
    d = p.path / "train"
    tokens = np.load(d / "tokens.npy", mmap_mode="r")
    labels = np.load(d / "labels.npy", mmap_mode="r")
    doc_offsets = np.load(d / "doc_offsets.npy", mmap_mode="r")
    sample_docs = np.load(d / "sample_docs.npy", mmap_mode="r")
    s = 0
    first, last = sample_docs[s], sample_docs[s + 1]
    start, end = doc_offsets[first], doc_offsets[last]
    assert last - first == 5 and end - start == p.meta["splits"]["train"]["tokens"]
    assert tokens.dtype == np.int32 and labels.dtype == np.int32 and len(tokens) == len(labels)
    assert (labels != IGNORE_INDEX).sum() == 5 * len(b"hello<|im_end|>\n")


def test_a_tokenizer_larger_than_the_model_is_refused_before_anything_is_written(tmp_path, bpe_tokenizer_dir):
    """Ids past the model's embedding rows would be an index error on the GPU, hours later: refused at prepare."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}])
    cfg = make_cfg(tmp_path / "run", tokenizer=str(bpe_tokenizer_dir), source=DataSource.jsonl, path=str(data))
    cfg.model.vocab_size = 500  # the tokenizer has 1000
    with pytest.raises(DataError, match=r"tokenizer has 1000 tokens but the model has 500 embedding rows"):
        prepare(cfg, num_workers=1, progress=False)
    assert not (tmp_path / "run").exists()
