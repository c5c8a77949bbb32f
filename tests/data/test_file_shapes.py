"""Files as other tools export them: JSON arrays, gzip and zstd streams, UTF-16/32, Parquet under a .jsonl name.

Each compressed or array file must give exactly the tokens of the same records
as plain JSON Lines; the planner's record count must be what prepare reads;
and a file prepare cannot read as UTF-8 text is named with its real encoding
or format and the fix, not with latin1 advice.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, List

import pytest

from fsdp_workflow.config.schema import DataFormat, DataSource
from fsdp_workflow.data.mixture import resolve_sources
from fsdp_workflow.data.prepare import prepare
from fsdp_workflow.data.sources import DataError
from fsdp_workflow.data.summary import count_records

from .conftest import make_cfg, write_jsonl

ALPACA = [{"instruction": f"Name the number {i}.", "input": "" if i % 2 else f"context {i}",
           "output": f"The number is {i}."} for i in range(12)]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": f"Hello {i}!"}]}
            for i in range(12)]


def _tokens(tmp_path: Path, name: str, path: Path, fmt: DataFormat, **data: Any) -> List[bytes]:
    cfg = make_cfg(tmp_path / name, seq_len=512, source=DataSource.jsonl, path=str(path), format=fmt,
                   eval_fraction=0.0, chat_template="chatml", **data)
    assert count_records(resolve_sources(cfg.data)[0]) == 12  # the planner counts what prepare reads
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["records"] == 12 and p.meta["bad_records"] == 0
    # The packed arrays themselves, byte for byte (the cache key differs: it names the files).
    return [f.read_bytes() for f in sorted((p.path / "train").iterdir())]


def _zstd(raw: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")  # a dev dependency: installed by tools/install.sh
    return zstandard.ZstdCompressor().compress(raw)


@pytest.mark.parametrize("records,fmt", [(ALPACA, DataFormat.alpaca), (SHAREGPT, DataFormat.conversation)],
                         ids=["alpaca", "sharegpt"])
def test_a_json_array_and_compressed_streams_read_as_json_lines(tmp_path: Path, records, fmt) -> None:
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    raw = plain.read_bytes()
    array = tmp_path / "export.json"
    array.write_text(json.dumps(records, indent=2))  # how Alpaca's alpaca_data.json and ShareGPT dumps look
    gz = tmp_path / "data.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    zst = tmp_path / "data.jsonl.zst"
    zst.write_bytes(_zstd(raw))
    unnamed = tmp_path / "gz_without_the_name.jsonl"
    unnamed.write_bytes(gzip.compress(raw))  # recognised by its magic bytes
    want = _tokens(tmp_path, "plain", plain, fmt)
    for path in (array, gz, zst, unnamed):
        assert _tokens(tmp_path, "run_" + path.name, path, fmt) == want, path.name


def test_a_directory_finds_compressed_files(tmp_path: Path) -> None:
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl.gz").write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in ALPACA[:5])))
    write_jsonl(d / "b.jsonl", ALPACA[5:])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(d), format=DataFormat.alpaca,
                   chat_template="chatml", eval_fraction=0.0)
    assert count_records(resolve_sources(cfg.data)[0]) == 12
    assert prepare(cfg, num_workers=1, progress=False).meta["records"] == 12


@pytest.mark.parametrize("encoding,name", [("utf-16", "UTF-16LE"), ("utf-32", "UTF-32LE"), ("utf-16-be", None)])
def test_wide_text_is_named_with_the_iconv_fix(tmp_path: Path, encoding: str, name) -> None:
    path = tmp_path / "wide.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in ALPACA)
    if name is None:  # big-endian with its mark written by hand (Python's utf-16-be writes none)
        path.write_bytes(b"\xfe\xff" + text.encode(encoding))
        name = "UTF-16BE"
    else:
        path.write_bytes(text.encode(encoding))
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.alpaca,
                   chat_template="chatml")
    with pytest.raises(DataError) as err:
        prepare(cfg, num_workers=1, progress=False)
    assert f"the text is {name}" in str(err.value) and f"iconv -f {name} -t UTF-8" in str(err.value)
    assert "latin1" not in str(err.value)
    assert not (tmp_path / "run" / "data.json").exists()


def test_parquet_under_a_jsonl_name_names_data_source(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")  # a dev dependency
    import pyarrow.parquet as pq

    path = tmp_path / "export.jsonl"
    pq.write_table(pa.table({"instruction": ["a"], "input": [""], "output": ["b"]}), path)
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.alpaca,
                   chat_template="chatml")
    with pytest.raises(DataError, match=r"this is a Parquet file, not text or JSON lines\. Fix: data\.source=parquet"):
        prepare(cfg, num_workers=1, progress=False)


def test_a_broken_json_array_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(ALPACA[:3], indent=2)[:-40])  # cut off
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.alpaca,
                   chat_template="chatml")
    with pytest.raises(DataError, match=r"broken\.json:\d+: the file starts as a JSON array but is not valid JSON"):
        prepare(cfg, num_workers=1, progress=False)


def test_records_truncated_to_nothing_trained_are_named_with_the_fix(tmp_path: Path) -> None:
    # Alpaca's classic prompt (no chat template) is longer than a short seq_len: every answer falls past the cut.
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(ALPACA))
    cfg = make_cfg(tmp_path / "run", seq_len=64, source=DataSource.jsonl, path=str(path), format=DataFormat.alpaca,
                   eval_fraction=0.0)
    with pytest.raises(DataError) as err:
        prepare(cfg, num_workers=1, progress=False)
    assert "no usable documents of 12 records: 12 truncated to train.seq_len=64 with no trained token left" \
        in str(err.value) and "raise train.seq_len" in str(err.value)
