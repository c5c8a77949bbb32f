"""Real corpora: undecodable bytes, records over the size limit, giant records in bounded memory, progress."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_workflow.config.schema import DataSource, OnBadRecord
from fsdp_workflow.data import prepare as prepare_mod
from fsdp_workflow.data import sources
from fsdp_workflow.data.prepare import main, prepare
from fsdp_workflow.data.sources import DataError

from .conftest import make_cfg

GOOD = json.dumps({"text": "plain words here"}).encode() + b"\n"
LATIN1 = json.dumps({"text": "caf_"}).encode().replace(b"_", b"\xe9") + b"\n"  # é in latin-1: not UTF-8


def _jsonl(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"".join(lines))
    return p


def test_undecodable_bytes_named_by_file_line_and_skipped(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [GOOD, LATIN1, GOOD])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8: byte 0xe9 at column 14"):
        prepare(cfg, num_workers=1, progress=False)
    cfg.data.on_bad_record = OnBadRecord.skip
    p = prepare(cfg, num_workers=2, progress=False)
    assert p.meta["bad_records"] == 1 and p.meta["splits"]["train"]["documents"] == 2


def test_undecodable_text_block_is_a_bad_record(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_bytes(b"first block\n\nsecond \xff block\n\nthird block\n")
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path=str(f), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"c\.txt:3: not UTF-8: byte 0xff"):
        prepare(cfg, num_workers=1, progress=False)


def test_a_bad_byte_inside_a_multi_line_text_block_is_named_by_its_own_line(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_bytes(b"intro\n\nline one ok\nline two \xff bad\nline three\n")  # the block starts on line 3
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path=str(f), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"c\.txt:4: not UTF-8: byte 0xff at column 10 ") as err:
        prepare(cfg, num_workers=1, progress=False)
    assert "Fix the data, or set data.on_bad_record=skip" in str(err.value)  # plain text has no fields to name


def test_a_cut_off_json_line_is_named_at_its_end(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [GOOD, b'{"text": "cut off\n', GOOD])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON \(Invalid control character at column 18\)"):
        prepare(cfg, num_workers=1, progress=False)
    path.write_bytes(GOOD + b'{"text"\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON \(Expecting ':' delimiter at column 8\)"):
        prepare(cfg, num_workers=1, progress=False)


def test_prepare_cli_exits_2_on_bad_bytes_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from omegaconf import OmegaConf

    path = _jsonl(tmp_path, [GOOD, LATIN1])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:2: not UTF-8" in err and "Traceback" not in err


def test_record_over_the_size_limit_is_named_and_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1000)
    big = json.dumps({"text": "x" * 5000}).encode() + b"\n"
    path = _jsonl(tmp_path, [GOOD, big, GOOD])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"d\.jsonl:2: the record is 0\.0 MiB, over the .* MiB limit"):
        prepare(cfg, num_workers=1, progress=False)
    cfg.data.on_bad_record = OnBadRecord.skip
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["bad_records"] == 1 and p.meta["splits"]["train"]["documents"] == 2


def test_missing_text_field_suggests_a_key_the_planner_accepts(tmp_path: Path) -> None:
    """format=text: the fix is data.text_field (the planner refuses data.fields with format=text)."""
    path = _jsonl(tmp_path, [json.dumps({"body": "x"}).encode() + b"\n"])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError) as err:
        prepare(cfg, num_workers=1, progress=False)
    assert "data.text_field=NAME" in str(err.value) and "data.fields" not in str(err.value)
    from fsdp_workflow.config.errors import ValidationReport
    from fsdp_workflow.data.plan_checks import check_data_format

    cfg.data.text_field = "body"  # the suggested fix passes the planner's data rules
    report = ValidationReport()
    check_data_format(cfg, report)
    assert not report.errors


_PEAK = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.data.conftest import make_cfg
    from fsdp_workflow.config.schema import DataFormat, DataSource
    from fsdp_workflow.data.prepare import prepare
    tmp = Path(sys.argv[1]); size = int(sys.argv[2]); fmt = sys.argv[3]
    word = "lorem ipsum dolor sit amet " * (size // 27 + 1)
    if fmt == "text":
        rec = {{"text": word[:size]}}
    else:
        rec = {{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": word[:size]}}]}}
    (tmp / "d.jsonl").write_text(json.dumps(rec) + "\\n")
    del word, rec
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = make_cfg(tmp / "run", seq_len=128, source=DataSource.jsonl, path=str(tmp / "d.jsonl"), eval_fraction=0.0,
                   format=DataFormat(fmt), **({{"chat_template": "chatml"}} if fmt == "conversation" else {{}}))
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["truncated"] == 1, p.meta
    print(json.dumps({{"base_kb": base, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
""")


@pytest.mark.parametrize("fmt", ["text", "conversation"])
def test_a_giant_record_costs_a_few_times_its_size(tmp_path: Path, fmt: str) -> None:
    """A 50 MB record at seq_len 128: peak memory grows by at most 6x the record (was 13.6 GB)."""
    size = 50 << 20
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _PEAK.format(root=root), str(tmp_path), str(size), fmt],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (r["peak_kb"] - r["base_kb"]) * 1024
    assert grown < 6 * size, f"grew {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB record"


def test_progress_reports_records_tokens_and_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(prepare_mod, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(prepare_mod, "CHUNK_RECORDS", 2)
    path = _jsonl(tmp_path, [GOOD] * 6)
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), eval_fraction=0.0)
    with caplog.at_level(logging.INFO, logger="fsdp_workflow.data.prepare"):
        prepare(cfg, num_workers=1, progress=True)
    lines = [r.getMessage() for r in caplog.records if "records (" in r.getMessage()]
    assert len(lines) >= 3, lines
    assert "6 records" in lines[-1] and "tokens (" in lines[-1] and "/s)" in lines[-1]
