"""Mixtures (data.sources): real prepares of text + chat + mapped-field sources, shares, determinism, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from fsdp_workflow.config.schema import (ClusterKind, DataFormat, DataSource, OnBadRecord, SourceConfig,
                                         run_layout)
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.data.prepare import prepare
from fsdp_workflow.data.sources import DataError
from fsdp_workflow.data.summary import summary_lines
from fsdp_workflow.plan.checks import check

from .conftest import make_cfg, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def _chat(i: int) -> Dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"question {i}?"},
                         {"role": "assistant", "content": f"answer number {i}."}]}


@pytest.fixture()
def three(tmp_path: Path) -> Dict[str, Path]:
    """300 conversations (one bad line), 400 text blocks, 200 prompt/completion records with their own field names."""
    d = tmp_path / "data"
    d.mkdir()
    chat = [json.dumps(_chat(i)) for i in range(300)]
    chat.insert(7, '{"messages": [{"role": "user", "content": "no answer"}]}')  # bad: no assistant turn
    paths = {"chat": write_jsonl(d / "chat.jsonl", chat)}
    paths["text"] = d / "notes.txt"
    paths["text"].write_text("\n\n".join(f"note {i} about things" for i in range(400)) + "\n")
    paths["qa"] = write_jsonl(d / "qa.jsonl", [{"question": f"q{i}", "answer": f"a{i}!"} for i in range(200)])
    return paths


def _sources(p: Dict[str, Path], weights: List[float]) -> List[SourceConfig]:
    return [SourceConfig(path=str(p["chat"]), weight=weights[0]),
            SourceConfig(path=str(p["text"]), name="notes", source=DataSource.text, format=DataFormat.text,
                         weight=weights[1]),
            SourceConfig(path=str(p["qa"]), format=DataFormat.prompt_completion,
                         fields={"prompt": "question", "completion": "answer"}, weight=weights[2])]


def _mix_cfg(run: Path, p: Dict[str, Path], weights: List[float], seed: int = 1, **kw: Any) -> Any:
    args: Dict[str, Any] = dict(source=DataSource.jsonl, format=DataFormat.conversation, chat_template="chatml",
                                sources=_sources(p, weights), eval_fraction=0.0, seed=seed,
                                on_bad_record=OnBadRecord.skip)
    args.update(kw)
    return make_cfg(run, **args)


def _digest(cache_dir: Path) -> Dict[str, str]:
    return {str(f.relative_to(cache_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(cache_dir.rglob("*.npy"))}


def test_mixture_takes_each_share_and_records_it(tmp_path: Path, three: Dict[str, Path]) -> None:
    cfg = _mix_cfg(tmp_path / "run", three, [2, 1, 1])
    p = prepare(cfg, num_workers=2, progress=False)
    rows = {r["key"]: r for r in p.meta["sources"]}
    # p = (.5, .25, .25); M = min(300/.5, 400/.25, 200/.25) = 600: chat whole, the others downsampled
    assert [rows[f"data.sources[{i}]"]["train_documents"] for i in range(3)] == [300, 150, 150]
    assert rows["data.sources[0]"]["bad_records"] == 1 and rows["data.sources[0]"]["records"] == 301
    assert rows["data.sources[1]"]["name"] == "notes" and rows["data.sources[1]"]["documents"] == 400
    for key, want in (("data.sources[0]", .5), ("data.sources[1]", .25), ("data.sources[2]", .25)):
        assert abs(rows[key]["document_share"] - want) < 0.01
    assert p.meta["mixture"] is True and p.meta["bad_records"] == 1
    assert sum(r["train_tokens"] for r in rows.values()) == p.meta["splits"]["train"]["tokens"]
    # every document knows its file:line across sources, and each source's documents are what it holds
    cache = open_cache(run_layout(cfg), pad_id=258)
    assert cache is not None
    split = cache.split("train")
    assert split is not None
    offs = np.asarray(split.doc_offsets)
    seen = {"chat.jsonl": 0, "notes.txt": 0, "qa.jsonl": 0}
    for doc in range(len(offs) - 1):
        where = cache.source_of("train", doc)
        assert where is not None
        path, line = where.rsplit(":", 1)
        name = os.path.basename(path)
        seen[name] += 1
        text = bytes(int(t) for t in split.tokens[offs[doc]:offs[doc + 1]] if t < 256).decode()
        raw = Path(path).read_text().split("\n")[int(line) - 1]
        if name == "notes.txt":
            assert text.startswith(raw) and (split.labels[offs[doc] + 1:offs[doc + 1]] != IGNORE_INDEX).all()
        elif name == "qa.jsonl":
            assert json.loads(raw)["answer"] in text
        else:
            assert json.loads(raw)["messages"][-1]["content"] in text
    assert seen == {"chat.jsonl": 300, "notes.txt": 150, "qa.jsonl": 150}


def test_same_seed_same_bytes_other_seed_other_order(tmp_path: Path, three: Dict[str, Path]) -> None:
    a = prepare(_mix_cfg(tmp_path / "a", three, [2, 1, 1], cache_dir=str(tmp_path / "ca")), num_workers=2,
                progress=False)
    b = prepare(_mix_cfg(tmp_path / "b", three, [2, 1, 1], cache_dir=str(tmp_path / "cb")), num_workers=1,
                progress=False)
    assert not a.reused and not b.reused and a.key == b.key
    assert _digest(a.path) == _digest(b.path)
    c = prepare(_mix_cfg(tmp_path / "c", three, [2, 1, 1], seed=2, cache_dir=str(tmp_path / "cc")),
                num_workers=2, progress=False)
    assert c.key != a.key and _digest(c.path)["train/tokens.npy"] != _digest(a.path)["train/tokens.npy"]
    # a weight is part of the key: another weight is another cache
    d = prepare(_mix_cfg(tmp_path / "d", three, [2, 1, 2], cache_dir=str(tmp_path / "ca")), num_workers=2,
                progress=False)
    assert d.key != a.key and not d.reused


def test_num_samples_upsamples_and_eval_is_held_out_per_source(tmp_path: Path, three: Dict[str, Path]) -> None:
    srcs = _sources(three, [1, 1, 1])
    for s, n in zip(srcs, (50, 20, 450)):
        s.weight, s.num_samples = None, n
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, format=DataFormat.conversation, chat_template="chatml",
                   sources=srcs, eval_fraction=0.1, on_bad_record=OnBadRecord.skip)
    p = prepare(cfg, num_workers=2, progress=False)
    rows = p.meta["sources"]
    assert [r["train_documents"] for r in rows] == [50, 20, 450]
    assert all(r["held_out"] > 0 for r in rows)
    assert p.meta["splits"]["eval"]["documents"] == sum(r["held_out"] for r in rows)
    qa = rows[2]
    # 450 from about 180 training documents: every one at least twice, none more than three times
    cache = open_cache(run_layout(cfg), pad_id=258)
    assert cache is not None
    lines = np.load(cache.path / "train" / "doc_sources.npy")
    qa_index = cache.meta["source_files"].index(str(three["qa"].resolve()))
    _, reps = np.unique(lines[lines[:, 0] == qa_index, 1], return_counts=True)
    assert len(reps) == qa["documents"] - qa["held_out"] and reps.min() == 2 and reps.max() == 3


def test_data_path_is_one_unweighted_source(tmp_path: Path, three: Dict[str, Path]) -> None:
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, format=DataFormat.conversation,
                   chat_template="chatml", path=str(three["chat"]), eval_fraction=0.0,
                   on_bad_record=OnBadRecord.skip)
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["mixture"] is False and p.meta["splits"]["train"]["documents"] == 300
    assert [r["key"] for r in p.meta["sources"]] == ["data.path"]
    assert not check(cfg).errors


def test_summary_lists_sources_then_tokens_after_prepare(tmp_path: Path, three: Dict[str, Path]) -> None:
    cfg = _mix_cfg(tmp_path / "run", three, [2, 1, 1])
    text = "\n".join(summary_lines(cfg))
    assert "mixture of 3 source(s), mixed by data.seed=1" in text
    assert "chat.jsonl: jsonl/conversation, weight 2, share 50.0%, 301 records, tokens after prepare" in text
    assert "notes: text/text, weight 1, share 25.0%, 400 records" in text
    prepare(cfg, num_workers=1, progress=False)
    text = "\n".join(summary_lines(cfg))
    assert "tokens after prepare" not in text and "at the last prepare" in text


def test_status_names_the_sources(tmp_path: Path, three: Dict[str, Path]) -> None:
    from fsdp_workflow.report.status.collect import _data_summary

    cfg = _mix_cfg(tmp_path / "run", three, [2, 1, 1])
    prepare(cfg, num_workers=1, progress=False)
    lines = _data_summary(run_layout(cfg))["sources"]
    assert len(lines) == 3 and lines[1].startswith(f"notes ({three['text']}): 150 documents (25.0%)")


def test_every_problem_of_every_source_at_once(tmp_path: Path, three: Dict[str, Path]) -> None:
    srcs = _sources(three, [1, -1, float("nan")])
    srcs.append(SourceConfig(path=str(tmp_path / "missing.jsonl"), num_samples=10))
    srcs.append(SourceConfig(path=str(three["text"]), source=DataSource.text, format=DataFormat.text,
                             fields={"content": "body"}, weight=1))
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, format=DataFormat.conversation, chat_template="chatml",
                   path=str(three["chat"]), sources=srcs)
    cfg.cluster.kind, cfg.dry_run = ClusterKind.local, False
    keys: Dict[str, str] = {}
    for issue in check(cfg).errors:  # a key may carry two errors (a NaN weight is also refused as non-finite)
        keys[issue.key] = keys.get(issue.key, "") + " | " + issue.why
    assert "both set" in keys["data.path"]
    assert "finite number above 0" in keys["data.sources[1].weight"]
    assert "finite number" in keys["data.sources[2].weight"]  # nan: the non-finite rule speaks for the key
    assert "does not exist" in keys["data.sources[3].path"]
    assert "reads one field" in keys["data.sources[4].fields"]
    assert "same path" in keys["data.sources[4].path"]
    assert "do not combine" in keys["data.sources"]


def test_cli_refuses_a_bad_mixture_with_exit_2(tmp_path: Path, three: Dict[str, Path]) -> None:
    sources = f"[{{path: {three['chat']}, weight: 1}}, {{path: {three['qa']}, weight: -2}}]"
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "data=mixture",
                           "data.chat_template=chatml", f"data.sources={sources}", "dry_run=true",
                           f"run_dir={run}"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.sources[1].weight" in proc.stderr + proc.stdout and not run.exists()


def test_a_source_left_empty_is_named(tmp_path: Path, three: Dict[str, Path]) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", ['{"messages": []}'])
    srcs = [SourceConfig(path=str(three["chat"]), weight=1), SourceConfig(path=str(empty), weight=1)]
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, format=DataFormat.conversation, chat_template="chatml",
                   sources=srcs, on_bad_record=OnBadRecord.skip)
    with pytest.raises(DataError, match=r"data.sources\[1\]='empty.jsonl'.*no usable documents of 1 records: 1 bad records skipped"):
        prepare(cfg, num_workers=1, progress=False)
