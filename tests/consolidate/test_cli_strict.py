"""The consolidator is as strict as the planner: every bad argument is exit 2 with a message.

Also: optional ``meta.pt`` it cannot read becomes a note, and the newest *complete* step
is the default.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fsdp_workflow.consolidate import ConsolidationError, UnsafeCheckpointError, consolidate
from fsdp_workflow.consolidate.__main__ import main

from . import layouts
from .conftest import assert_same_tensors, expected, load_out

SIZE_FORMS = "5GB, 500MB, 1TB, 2GiB or a byte count"


@dataclasses.dataclass
class NemoTrainerConfig:
    """Stands in for the config objects NeMo pickles into meta.pt: a class not on the allow-list."""

    lr: float = 3e-4
    precision: str = "bf16-mixed"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run dir with checkpoints/step-2 and step-4 written by ``dcp.save`` (one process, two small tensors)."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # a one-process dcp.save, on purpose
        for step in (2, 4):
            state = {"model": {"w": torch.full((8, 4), float(step)), "b": torch.arange(4.0)}}
            layouts.save(state, run / "checkpoints" / f"step-{step}")
    return run


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; an uncaught exception (a traceback) fails the test by itself."""
    rc = main([*argv, "--no-progress"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _cli_subprocess(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", *argv, "--no-progress"],
                          capture_output=True, text=True)


def _copy_run(trained: Path, tmp_path: Path, kind: str = "llama") -> Path:
    dst = tmp_path / kind
    shutil.copytree(trained / kind, dst)
    return dst


# --max-shard-size: the planner's parser


@pytest.mark.parametrize("size", ["1TB", "2GiB", "500MB", "123456"])
def test_max_shard_size_accepts_what_the_planner_accepts(tiny_run, tmp_path, capsys, size):
    rc, out, err = _cli([str(tiny_run), str(tmp_path / "o"), "--max-shard-size", size], capsys)
    assert rc == 0, err
    assert json.loads(out)["files"] == ["model.safetensors"]


@pytest.mark.parametrize("size", ["5XB", "0", "1.5.GB", "five"])
def test_bad_max_shard_size_is_one_line_naming_flag_value_and_forms(tiny_run, tmp_path, size):
    proc = _cli_subprocess([str(tiny_run), str(tmp_path / "o"), "--max-shard-size", size])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --max-shard-size {size}:"), proc.stderr
    assert SIZE_FORMS in lines[0]
    assert not (tmp_path / "o").exists()


def test_api_max_shard_size_zero_bytes(tiny_run, tmp_path):
    with pytest.raises(ConsolidationError, match="--max-shard-size 0: .*less than one byte"):
        consolidate(tiny_run, tmp_path / "o", max_shard_size=0, progress=False)


# --remove-sharded needs verification


def test_remove_sharded_without_verify_is_refused(tiny_run, tmp_path, capsys):
    tiny_run = shutil.copytree(tiny_run, tmp_path / "run")  # the shards this would delete are this test's own
    rc, _, err = _cli([str(tiny_run), str(tmp_path / "o"), "--remove-sharded", "--no-verify"], capsys)
    assert rc == 2 and err.startswith("error: --remove-sharded with --no-verify")
    assert "drop --no-verify" in err
    with pytest.raises(ConsolidationError, match="--remove-sharded with --no-verify"):
        consolidate(tiny_run, tmp_path / "o", remove_sharded=True, verify=False, progress=False)
    assert (tiny_run / "checkpoints" / "step-4" / ".metadata").is_file()
    assert not (tmp_path / "o").exists()


# every other bad argument


BAD_ARGS = [
    (["--workers", "0"], "--workers 0: must be a whole number of threads, at least 1"),
    (["--workers=-3"], "--workers -3: must be a whole number of threads, at least 1"),
    (["--average-last", "0"], "--average-last 0: must be at least 1"),
    (["--average-last=-1"], "--average-last -1: must be at least 1"),
    (["--average-last", "3"], "--average-last 3: only 2 steps in .* are complete"),
    (["--step", "3"], "--step 3: not found in .*available steps are \\[2, 4\\]"),
    (["--steps", "2,5"], "--steps \\[5\\]: not found"),
    (["--steps", "2,2"], "--steps 2,2: step\\(s\\) \\[2\\] listed twice"),
    (["--steps", ","], "--steps: no step numbers given"),
    (["--steps", "2,4", "--weights", "1"], "--weights has 1 values but 2 checkpoints are averaged"),
    (["--average-last", "2", "--weights", "1,2,3"], "--weights has 3 values but 2 checkpoints are averaged"),
    (["--steps", "2,4", "--weights=-1,2"], "--weights -1.0,2.0: weights must be finite, non-negative"),
    (["--steps", "2,4", "--weights", "0,0"], "must be finite, non-negative and sum to more than 0"),
    (["--steps", "2,4", "--weights", "nan,1"], "must be finite"),
    (["--weights", "1"], "--weights 1.0: weights are only used when averaging"),
    (["--dtype", "bf16", "--reference", "/nonexistent/ref"], "--reference /nonexistent/ref: no config.json there"),
]


@pytest.mark.parametrize("extra,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_argument_is_exit_2_with_message(tiny_run, tmp_path, capsys, extra, message):
    rc, out, err = _cli([str(tiny_run), str(tmp_path / "o"), *extra], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and re.search(message, err), err
    assert not (tmp_path / "o").exists()
    assert (tiny_run / "checkpoints" / "step-4" / ".metadata").is_file()


def test_bad_paths_are_exit_2(tiny_run, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "r").mkdir()  # a run directory: its checkpoints/ and a file beside them
    (tmp_path / "r" / "checkpoints").symlink_to(tiny_run / "checkpoints")
    (tmp_path / "r" / "config.yaml").write_text("x")
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o")], "does not exist"),
        ([str(tmp_path / "afile"), str(tmp_path / "o")], "not a file$"),
        ([str(tiny_run / "checkpoints" / "step-4" / ".metadata"), str(tmp_path / "o")],
         f"not a file; give its directory: {re.escape(str(tiny_run / 'checkpoints' / 'step-4'))}$"),
        ([str(tmp_path / "r" / "config.yaml"), str(tmp_path / "o")],
         f"not a file; give its directory: {re.escape(str(tmp_path / 'r'))}$"),
        ([str(tiny_run), str(tmp_path)], "OUT exists and is not a model written by this tool"),
        ([str(tiny_run), str(tmp_path / "afile" / "o")], "afile is a file, not a directory"),
        ([str(tiny_run / "checkpoints" / "step-4"), str(tmp_path / "o"), "--step", "2"],
         "--step 2: .*step-4 is a single checkpoint \\(step 4\\)"),
    ]
    for argv, message in cases:
        rc, _, err = _cli(argv, capsys)
        assert rc == 2 and err.startswith("error: ") and re.search(message, err.strip(), re.M), (argv, err)


def test_several_mistakes_are_reported_together(tiny_run, tmp_path, capsys):
    rc, _, err = _cli([str(tiny_run), str(tmp_path / "o"), "--workers", "0", "--average-last", "0",
                       "--max-shard-size", "5XB"], capsys)
    assert rc == 2 and err.startswith("error: found 3 problems with the options:")
    assert "--workers 0" in err and "--average-last 0" in err and "--max-shard-size 5XB" in err


def test_bad_arguments_leave_no_traceback_in_a_real_process(tiny_run, tmp_path):
    for extra in (["--workers", "0"], ["--average-last", "0"], ["--remove-sharded", "--no-verify"], ["--workers", "x"]):
        proc = _cli_subprocess([str(tiny_run), str(tmp_path / "o"), *extra])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (extra, proc.stderr)


# meta.pt is optional; .metadata is not


@pytest.mark.slow
def test_unreadable_meta_pt_is_a_note_not_a_failure(trained, tmp_path):
    run = trained / "llama"
    want = expected(run, 4)
    layouts.lightning(want, tmp_path / "nemo", {"global_step": 4, "cfg": NemoTrainerConfig()})
    res = consolidate(tmp_path / "nemo", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert_same_tensors(load_out(tmp_path / "out"), want)
    v = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert v["ok"] and "meta_pt" not in v
    note = next(n for n in v["notes"] if "meta.pt: could not be read" in n)
    assert "NemoTrainerConfig" in note and "allow-list" in note and "skipped" in note
    assert res.verification["notes"] == v["notes"]


@pytest.mark.slow
def test_corrupt_meta_pt_is_a_note(trained, tmp_path):
    run = trained / "llama"
    want = expected(run, 4)
    layouts.lightning(want, tmp_path / "pl", {"global_step": 4})
    ckpt = tmp_path / "pl" / "epoch=0-step=4.ckpt"
    (ckpt / "meta.pt").write_bytes(b"PK\x03\x04 not really a zip")
    res = consolidate(tmp_path / "pl", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert any("meta.pt: could not be read" in n for n in res.verification["notes"])
    assert_same_tensors(load_out(tmp_path / "out"), want)


@pytest.mark.slow
def test_metadata_with_unknown_class_is_still_a_hard_error(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    step = run / "checkpoints" / "step-4"
    meta = pickle.load(open(step / ".metadata", "rb"))  # our own file: plain pickle is fine here
    meta.planner_data = NemoTrainerConfig()
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(UnsafeCheckpointError, match=r"step-4/\.metadata: refusing to unpickle global .*NemoTrainerConfig"):
        consolidate(run, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# the newest complete step


@pytest.mark.slow
def test_newest_incomplete_step_is_skipped_with_a_note(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "step-4" / ".metadata").unlink()  # a crashed save renamed anyway
    (run / "checkpoints" / "step-6").mkdir()  # a copy that has not started writing files yet
    rc, out, err = _cli([str(run), str(tmp_path / "out")], capsys)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["sources"] == [str(run / "checkpoints" / "step-2")]
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 2))
    notes = json.loads((tmp_path / "out" / "verification.json").read_text())["notes"]
    for skipped in ("step-4", "step-6"):
        note = next(n for n in notes if f"{skipped}: skipped" in n)
        assert f"{skipped}/.metadata is missing" in note and "using step 2, the newest complete step" in note
        assert f"note: {note}" in err
    # the same choice from the checkpoints dir, and --average-last counts complete steps only
    rc, _, err = _cli([str(run / "checkpoints"), str(tmp_path / "avg"), "--average-last", "2"], capsys)
    assert rc == 2 and "--average-last 2: only 1 steps in" in err and "are complete ([2])" in err and "[4, 6]" in err


@pytest.mark.slow
def test_explicit_incomplete_step_is_an_error(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "step-4" / ".metadata").unlink()
    for flag in (["--step", "4"], ["--steps", "2,4"]):
        rc, _, err = _cli([str(run), str(tmp_path / "out"), *flag], capsys)
        assert rc == 2 and "step-4/.metadata is missing" in err and "not a complete checkpoint" in err, err
        assert "Pick a complete step ([2])" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_no_complete_step_at_all(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step}" / ".metadata").unlink()
    proc = _cli_subprocess([str(run), str(tmp_path / "out")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no complete checkpoint: every step directory lacks '.metadata'" in proc.stderr
    assert "step-2/.metadata" in proc.stderr and "step-4/.metadata" in proc.stderr
