"""The safetensors check that runs in a child process (``consolidate/verify/safetensors_probe.py``) and what ``check_files`` makes of it.

Real files written with ``safetensors.numpy.save_file``: a truncated file is reported naming
the file; a child that cannot start, fails or answers garbage falls back to opening the files
in this process, with a warning, and the check still finds what is wrong.
"""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from fsdp_workflow.consolidate.verify import files, safetensors_probe
from fsdp_workflow.consolidate.verify.expected import Expected, ExpectedModel


def _write(path, **tensors):
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_the_child_reports_what_safetensors_reads(tmp_path):
    good = _write(tmp_path / "model.safetensors", w=np.zeros((3, 4), np.float16), b=np.zeros(5, np.int64))
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(good.read_bytes()[:20])  # the header cut short
    report, problem = safetensors_probe.SafetensorsProbe([good, bad])._from_child()  # the child's own answer
    assert problem == ""
    assert report[str(good)] == {"metadata": {"format": "pt"}, "tensors": {"b": ["I64", [5]], "w": ["F16", [3, 4]]}}
    assert "error" in report[str(bad)] and report[str(bad)]["error"]


def _model(**shapes):
    return ExpectedModel({n: Expected(n, dt, shape, []) for n, (dt, shape) in shapes.items()}, None)


def test_check_files_compares_the_childs_view_with_the_checkpoint(tmp_path):
    _write(tmp_path / "model.safetensors", w=np.zeros((3, 4), np.float16))
    errors, located = files.check_files(tmp_path, _model(w=("float16", (3, 4))), "model.safetensors.index.json")
    assert errors == [] and located["w"].shape == (3, 4)
    errors, _ = files.check_files(tmp_path, _model(w=("float32", (3, 4))), "model.safetensors.index.json")
    assert any("'w' is F16[3, 4] in model.safetensors, the checkpoint says F32[3, 4]" in e for e in errors)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])  # the data cut short: safetensors refuses it
    errors, _ = files.check_files(tmp_path, _model(w=("float16", (3, 4))), "model.safetensors.index.json")
    assert len(errors) >= 1 and errors[0].startswith("model.safetensors: safetensors cannot open it: ")


def test_a_child_that_cannot_start_or_fails_falls_back_to_opening_the_files_here(tmp_path, monkeypatch, caplog):
    # the child is an optimisation: an environment where it cannot run costs speed, never the check
    _write(tmp_path / "model.safetensors", w=np.zeros(2, np.float32))
    good, bad = _model(w=("float32", (2,))), _model(w=("float16", (2,)))
    monkeypatch.setattr(safetensors_probe.sys, "executable", str(tmp_path / "no-such-python"))
    assert files.check_files(tmp_path, good, "model.safetensors.index.json")[0] == []
    assert "cannot start" in caplog.text and "opening them in this process instead" in caplog.text
    monkeypatch.undo()
    for child, said in [("import sys; print('boom', file=sys.stderr); sys.exit(3)", "failed (exit 3): boom"),
                        ("print('not json')", "no readable report")]:
        caplog.clear()
        monkeypatch.setattr(safetensors_probe, "_RUN_CHILD", child)
        assert files.check_files(tmp_path, good, "model.safetensors.index.json")[0] == []
        errors, _ = files.check_files(tmp_path, bad, "model.safetensors.index.json")  # and it still finds faults
        assert any("the checkpoint says F16[2]" in e for e in errors)
        assert said in caplog.text


def test_the_child_does_not_see_modules_beside_it_or_in_the_working_directory(tmp_path, monkeypatch):
    # a json.py in the working directory (or a schema.py beside safetensors_probe.py) must not shadow the library's
    (tmp_path / "json.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "model.safetensors", w=np.zeros(2, np.float32))
    report, problem = safetensors_probe.SafetensorsProbe([path])._from_child()
    assert problem == "" and report[str(path)]["tensors"] == {"w": ["F32", [2]]}
