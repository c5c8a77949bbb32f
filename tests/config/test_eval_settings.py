"""Evaluation settings that cannot evaluate anything are warned about at planning (issue 36, item 10).

In-process planning checks (``plan.checks.check``: the config rules and the plan stage's
file comparison), one forked dry run for the printed form, and the prepare step's count
of the held-out split. No training.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import List, Sequence

import pytest

import forked_cli  # tests/forked_cli.py
from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.load import ASSETS_DIR, compose
from fsdp_workflow.config.schema import DataSource
from fsdp_workflow.core.commands import hydra_value
from fsdp_workflow.plan.checks import check

CORPUS = ASSETS_DIR / "smoke" / "corpus.txt"


def warnings(overrides: Sequence[str], key: str) -> List[Issue]:
    report = check(compose(["+experiment=smoke", "train.max_steps=30", *overrides]))
    assert not report.errors, [e.format() for e in report.errors]
    return [w for w in report.warnings if w.key == key]


def test_evaluating_less_often_than_the_run_is_long_is_warned() -> None:
    [w] = warnings(["train.eval_every_steps=50"], "train.eval_every_steps")
    assert w.value == 50 and "longer than the run (train.max_steps=30)" in w.why and "no eval_loss" in w.why
    assert w.fix.startswith("train.eval_every_steps=3 ")
    assert warnings(["train.eval_every_steps=30"], "train.eval_every_steps") == []  # step 30 evaluates


def test_evaluating_without_held_out_data_is_warned_for_each_evaluation_asked() -> None:
    [w] = warnings(["train.eval_every_steps=5", "data.eval_fraction=0"], "train.eval_every_steps")
    assert "no held-out data (data.eval_path=null, data.eval_fraction=0)" in w.why
    assert "data.eval_fraction=0.05" in w.fix and "data.eval_path=" in w.fix
    slurm = ["cluster=slurm", "cluster.partition=p", "consolidate.every_checkpoint=true", "data.eval_fraction=0",
             "dry_run=true"]
    [w] = warnings(slurm, "consolidate.every_checkpoint")
    assert "records 'skipped'" in w.why and "consolidate.every_checkpoint=false" in w.fix
    # synthetic data always has a held-out stream; a held-out fraction is held-out data
    assert warnings(["data=synthetic", "train.eval_every_steps=5", "data.eval_fraction=0"],
                    "train.eval_every_steps") == []
    assert warnings(["train.eval_every_steps=5"], "train.eval_every_steps") == []


def test_eval_files_nothing_evaluates_on_are_warned(tmp_path: Path) -> None:
    held = tmp_path / "held.txt"
    held.write_text("A held-out paragraph the run never trains on.\n")
    [w] = warnings([f"data.eval_path={hydra_value(str(held))}"], "data.eval_path")
    assert "nothing evaluates on it during the run (train.eval_every_steps=0" in w.why
    assert "train.eval_every_steps=N" in w.fix
    assert warnings([f"data.eval_path={hydra_value(str(held))}", "train.eval_every_steps=10"], "data.eval_path") == []


def test_eval_data_equal_to_the_training_data_is_warned(tmp_path: Path) -> None:
    data = tmp_path / "train.txt"
    shutil.copy(CORPUS, data)
    link = tmp_path / "link.txt"
    os.symlink(data, link)
    copy = tmp_path / "copy.txt"
    shutil.copy(CORPUS, copy)
    base = [f"data.path={hydra_value(str(data))}", "train.eval_every_steps=10"]
    for given in (data, link):  # the same file, by its path or another
        [w] = warnings([*base, f"data.eval_path={hydra_value(str(given))}"], "data.eval_path")
        assert f"every one of its files is training data: {given} (read by data.path too)" in w.why, w.why
        assert "measure documents the model trains on" in w.why and "data.eval_fraction=0.05" in w.fix
    [w] = warnings([*base, f"data.eval_path={hydra_value(str(copy))}"], "data.eval_path")
    assert f"{copy} (a copy of {data}, data.path: the same bytes)" in w.why, w.why
    # a directory holding the training file and one other: one of two files
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(CORPUS, both / "a.txt")
    (both / "b.txt").write_text("Held-out text.\n")
    [w] = warnings([f"data.path={hydra_value(str(both / 'a.txt'))}", "train.eval_every_steps=10",
                    f"data.eval_path={hydra_value(str(both))}"], "data.eval_path")
    assert "1 of its 2 files are training data" in w.why, w.why
    other = tmp_path / "other.txt"
    other.write_bytes(CORPUS.read_bytes()[:-1] + b"!")  # same size, other content
    assert warnings([*base, f"data.eval_path={hydra_value(str(other))}"], "data.eval_path") == []


def test_the_dry_run_prints_each_warning_once(tmp_path: Path) -> None:
    args = ["+experiment=smoke", f"run_dir={hydra_value(str(tmp_path / 'run'))}", "dry_run=true",
            "train.max_steps=30", "train.eval_every_steps=50", f"data.eval_path={hydra_value(str(CORPUS))}"]
    proc = forked_cli.run(args, cwd=tmp_path, env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stderr
    assert out.count("warning: train.eval_every_steps = 50") == 1, out
    assert out.count("warning: data.eval_path = ") == 1 and "is training data" in out, out


def test_prepare_warns_of_a_held_out_split_too_small_to_evaluate(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from fsdp_workflow.data.prepare import prepare
    from tests.data.conftest import make_cfg

    cases = [({"eval_fraction": 1e-9}, 8, "data.eval_fraction=1e-09 held out no document"),
             ({"eval_fraction": 0.05}, 500, "fewer than one evaluation reads per rank (train.eval_batches=500")]
    for data, eval_batches, said in cases:
        cfg = make_cfg(tmp_path / f"run{eval_batches}", seq_len=64, source=DataSource.text, path=str(CORPUS), **data)
        cfg.train.eval_batches = eval_batches
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_workflow.data.prepare"):
            prepare(cfg, num_workers=1, progress=False)
        assert said in caplog.text, caplog.text
    cfg = make_cfg(tmp_path / "fine", seq_len=64, source=DataSource.text, path=str(CORPUS), eval_fraction=0.05)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_workflow.data.prepare"):
        prepare(cfg, num_workers=1, progress=False)
    assert "warning" not in caplog.text
