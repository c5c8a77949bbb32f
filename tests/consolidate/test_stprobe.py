"""The safetensors check that runs in a child process (``consolidate/stprobe.py``) and what ``check_files`` makes of it.

Real files written with ``safetensors.numpy.save_file``; a truncated file, a child that
cannot start and a child that fails are each reported, naming the file or the cause.
"""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from fsdp_workflow.consolidate import check, stprobe
from fsdp_workflow.consolidate.expect import Expected, ExpectedModel


def _write(path, **tensors):
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_the_child_reports_what_safetensors_reads(tmp_path):
    good = _write(tmp_path / "model.safetensors", w=np.zeros((3, 4), np.float16), b=np.zeros(5, np.int64))
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(good.read_bytes()[:20])  # the header cut short
    report, problem = stprobe.SafetensorsProbe([good, bad]).result()
    assert problem == ""
    assert report[str(good)] == {"metadata": {"format": "pt"}, "tensors": {"b": ["I64", [5]], "w": ["F16", [3, 4]]}}
    assert "error" in report[str(bad)] and report[str(bad)]["error"]


def _model(**shapes):
    return ExpectedModel({n: Expected(n, dt, shape, []) for n, (dt, shape) in shapes.items()}, None)


def test_check_files_compares_the_childs_view_with_the_checkpoint(tmp_path):
    _write(tmp_path / "model.safetensors", w=np.zeros((3, 4), np.float16))
    errors, located = check.check_files(tmp_path, _model(w=("float16", (3, 4))), "model.safetensors.index.json")
    assert errors == [] and located["w"].shape == (3, 4)
    errors, _ = check.check_files(tmp_path, _model(w=("float32", (3, 4))), "model.safetensors.index.json")
    assert any("'w' is F16[3, 4] in model.safetensors, the checkpoint says F32[3, 4]" in e for e in errors)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])  # the data cut short: safetensors refuses it
    errors, _ = check.check_files(tmp_path, _model(w=("float16", (3, 4))), "model.safetensors.index.json")
    assert len(errors) >= 1 and errors[0].startswith("model.safetensors: safetensors cannot open it: ")


def test_a_child_that_cannot_start_or_fails_is_an_error_not_a_pass(tmp_path, monkeypatch):
    path = _write(tmp_path / "model.safetensors", w=np.zeros(2, np.float32))
    model = _model(w=("float32", (2,)))
    monkeypatch.setattr(stprobe.sys, "executable", str(tmp_path / "no-such-python"))
    errors, _ = check.check_files(tmp_path, model, "model.safetensors.index.json")
    assert len(errors) == 1 and errors[0].startswith("cannot start ") and "no-such-python" in errors[0]
    monkeypatch.undo()
    monkeypatch.setattr(stprobe, "_CHILD", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    errors, _ = check.check_files(tmp_path, model, "model.safetensors.index.json")
    assert errors == ["opening the files with safetensors failed (exit 3): boom"]
    monkeypatch.setattr(stprobe, "_CHILD", "print('not json')")
    errors, _ = check.check_files(tmp_path, model, "model.safetensors.index.json")
    assert len(errors) == 1 and "no readable report" in errors[0]
    assert path.is_file()
