"""What a data path holds is named at planning, with the key that reads it (issue 49, item 7).

    python -m pytest tests/data/test_path_shapes.py

Through ``python -m fsdp_workflow``, each refused with exit 2 before anything is written:
a ``save_to_disk`` directory given to the JSON-lines reader (was: 34 "bad records" from
its ``dataset_info.json`` and the advice ``on_bad_record=skip``), a directory of Parquet
shards (was: "no .jsonl file" at prepare), a URL or hub id (was: made into a local path),
and a directory holding ``train.jsonl`` beside ``test.jsonl`` (was: both trained). The
fix each message gives is then accepted, and for ``save_to_disk`` prepare reads its rows.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import DataSource, SourceConfig
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.data.rules_path import check_data_paths

from .conftest import make_cfg

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"messages": [{"role": "user", "content": f"What is {i} plus one?"},
                      {"role": "assistant", "content": f"{i} plus one is {i + 1}."}]} for i in range(20)]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke_chat", "dry_run=true", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT)))


def _fix(stderr: str) -> List[str]:
    """The overrides of the first ``fix:`` line (up to the first parenthesis), as the shell splits them."""
    line = next(ln for ln in stderr.splitlines() if ln.strip().startswith("fix:"))
    return shlex.split(line.split("fix:", 1)[1].split(" (", 1)[0])


def test_a_save_to_disk_directory_names_data_source_hf_disk_and_the_fix_prepares_its_rows(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    disk = tmp_path / "saved"
    datasets.Dataset.from_list(CHAT).save_to_disk(str(disk))
    run = tmp_path / "run"
    res = cli(f"run_dir={run}", f"data.path={disk}")
    assert res.returncode == EXIT_USAGE, res.stdout + res.stderr
    assert "save_to_disk" in res.stderr and "dataset_info.json" in res.stderr
    assert _fix(res.stderr) == ["data.source=hf_disk"]
    assert "bad record" not in res.stderr and not run.exists()
    ok = cli(f"run_dir={run}", f"data.path={disk}", *_fix(res.stderr))
    assert ok.returncode == 0, ok.stderr
    prep = subprocess.run([sys.executable, "-m", "fsdp_workflow.data.prepare", str(run), "--workers", "1"],
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert "20 records" in prep.stderr and "0 bad records" in prep.stderr


def test_a_datasetdict_directory_is_named_too(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    disk = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHAT)}).save_to_disk(str(disk))
    res = cli(f"run_dir={tmp_path / 'run'}", f"data.path={disk}")
    assert res.returncode == EXIT_USAGE and "dataset_dict.json" in res.stderr
    assert _fix(res.stderr) == ["data.source=hf_disk"]


def test_a_directory_of_parquet_shards_names_data_source_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(CHAT[i * 10:(i + 1) * 10]), shards / f"part-{i:05d}.parquet")
    run = tmp_path / "run"
    res = cli(f"run_dir={run}", f"data.path={shards.parent}")
    assert res.returncode == EXIT_USAGE, res.stdout + res.stderr
    assert "2 file(s) the parquet reader reads" in res.stderr and _fix(res.stderr) == ["data.source=parquet"]
    assert not run.exists()
    assert cli(f"run_dir={run}", f"data.path={shards.parent}", "data.source=parquet").returncode == 0
    # The other way round: hf_disk on a directory save_to_disk did not write names the reader of its files.
    wrong = cli(f"run_dir={tmp_path / 'run2'}", f"data.path={shards.parent}", "data.source=hf_disk")
    assert wrong.returncode == EXIT_USAGE and _fix(wrong.stderr) == ["data.source=parquet"]


@pytest.mark.parametrize("url,download", [
    ("hf://datasets/HuggingFaceH4/ultrachat_200k", "hf download HuggingFaceH4/ultrachat_200k --repo-type dataset"),
    ("https://huggingface.co/datasets/tatsu-lab/alpaca", "hf download tatsu-lab/alpaca --repo-type dataset"),
    ("https://example.com/exports/chat.jsonl", "curl -L -o /data/chat.jsonl"),
])
def test_a_url_or_hub_id_is_refused_with_how_to_download_it(tmp_path: Path, url: str, download: str) -> None:
    run = tmp_path / "run"
    res = cli(f"run_dir={run}", f"data.path={url}", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE, res.stdout + res.stderr
    assert f"data.path = '{url}'" in res.stderr  # the value as given, not made into a local path
    assert "URLs and hub ids are not read" in res.stderr and download in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written, no directory named after the scheme"


def test_a_train_and_a_test_file_in_one_directory_are_refused_with_the_keys_that_split_them(tmp_path: Path) -> None:
    d = tmp_path / "splits"
    d.mkdir()
    for name, rows in (("train.jsonl", CHAT[:15]), ("test.jsonl", CHAT[15:])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    res = cli(f"run_dir={run}", f"data.path={d}")
    assert res.returncode == EXIT_USAGE, res.stdout + res.stderr
    assert "train.jsonl, test.jsonl" in res.stderr and not run.exists()
    assert _fix(res.stderr) == [f"data.path={d / 'train.jsonl'}", f"data.eval_path={d / 'test.jsonl'}"]
    ok = cli(f"run_dir={run}", *_fix(res.stderr))
    assert ok.returncode == 0, ok.stderr
    assert "training split" not in ok.stderr and "training data" not in ok.stderr  # test.jsonl is held out


def test_split_shards_and_split_directories_are_named_by_glob_or_directory(tmp_path: Path) -> None:
    shards = tmp_path / "hub"
    (shards / "data").mkdir(parents=True)
    for name in ("train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl", "validation-00000-of-00001.jsonl"):
        (shards / "data" / name).write_text(json.dumps(CHAT[0]) + "\n")
    dirs = tmp_path / "dirs"
    for sub in ("train", "dev"):
        (dirs / sub).mkdir(parents=True)
        (dirs / sub / "a.jsonl").write_text(json.dumps(CHAT[0]) + "\n")
        (dirs / sub / "b.jsonl").write_text(json.dumps(CHAT[1]) + "\n")
    fixes = []
    for d in (shards, dirs):
        r = ValidationReport()
        check_data_paths(make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(d)), r)
        assert [i.key for i in r.errors] == ["data.path"], r.errors
        fixes.append(r.errors[0].fix)
    assert fixes[0].startswith(f"data.path='{shards}/data/train-0000*.jsonl' "
                               f"data.eval_path={shards}/data/validation-00000-of-00001.jsonl")
    assert fixes[1].startswith(f"data.path={dirs}/train data.eval_path={dirs}/dev")


def test_a_mixture_source_is_named_by_its_own_keys(tmp_path: Path) -> None:
    d = tmp_path / "pq"
    d.mkdir()
    (d / "x.parquet").write_bytes(b"PAR1")
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=None,
                   sources=[SourceConfig(path=str(d), weight=1), SourceConfig(path="s3://bucket/b.jsonl", weight=1)])
    r = ValidationReport()
    check_data_paths(cfg, r)
    assert [(i.key, i.fix.split(" ")[0]) for i in r.errors] == [("data.source", "data.source=parquet"),
                                                                ("data.sources[1].path", "copy")]
