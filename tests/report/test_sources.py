"""The data sources ``status`` and the model card name (:mod:`fsdp_workflow.report.run_sources`)."""

from __future__ import annotations

from pathlib import Path

from fsdp_workflow.config.load import compose, to_yaml
from fsdp_workflow.config.record import open_run
from fsdp_workflow.report.run_sources import source_lines

ROW = {"name": "sft", "path": "/d/sft.jsonl", "records": 12, "bad_records": 2, "train_documents": 9,
       "document_share": 1.0, "train_tokens": 900, "token_share": 1.0}


def _record(tmp_path: Path, *overrides: str):
    root = tmp_path / "run"
    root.mkdir()
    (root / "config.yaml").write_text(to_yaml(compose(["+experiment=smoke", f"run_dir={root}", *overrides])))
    return open_run(root)


def test_one_source_is_named_with_the_caches_counts_or_said_to_wait_for_prepare(tmp_path: Path) -> None:
    rec = _record(tmp_path, "data.source=jsonl", "data.path=/d/sft.jsonl", "data.format=conversation")
    assert source_lines(rec, {}) == ["/d/sft.jsonl: counts after prepare"]
    assert source_lines(rec, {"mixture": False, "sources": [ROW]}) == [
        "/d/sft.jsonl: 9 documents (100.0%), 900 tokens, 12 records read, 2 bad"]


def test_a_mixture_names_each_source(tmp_path: Path) -> None:
    rec = _record(tmp_path, "data.source=jsonl", "data.path=null", "data.format=conversation",
                  "+data.sources=[{path: /d/a.jsonl, name: a, num_samples: 30}, {path: /d/b.jsonl, num_samples: 10}]")
    assert source_lines(rec, {}) == ["a (/d/a.jsonl): 30 documents; counts after prepare",
                                     "b.jsonl (/d/b.jsonl): 10 documents; counts after prepare"]
    meta = {"mixture": True, "sources": [dict(ROW, name="a", path="/d/a.jsonl", document_share=0.75),
                                         dict(ROW, name="b", path="/d/b.jsonl", document_share=0.25)]}
    lines = source_lines(rec, meta)
    assert len(lines) == 2 and lines[1].startswith("b (/d/b.jsonl): 9 documents (25.0%), 900 tokens")


def test_synthetic_data_has_no_source(tmp_path: Path) -> None:
    assert source_lines(_record(tmp_path, "data.source=synthetic"), {}) == []
