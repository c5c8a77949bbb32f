"""Averaging checkpoints: fp32 accumulation, weights, explicit steps."""

from __future__ import annotations

import pytest
import torch

from fsdp_workflow.consolidate import ConsolidationError, consolidate

from .conftest import assert_same_tensors, expected, load_out

pytestmark = pytest.mark.slow


def _mean(run, steps, weights):
    out = {}
    for k, v in expected(run, steps[0]).items():
        if not v.is_floating_point():
            out[k] = expected(run, steps[-1])[k]
            continue
        acc = torch.zeros(v.shape, dtype=torch.float32)
        for s, w in zip(steps, weights):
            acc += torch.tensor(w, dtype=torch.float32) * expected(run, s)[k].float()
        out[k] = acc.to(v.dtype)
    return out


def test_average_last_two_equal_weights(trained, tmp_path):
    run = trained / "llama"
    res = consolidate(run, tmp_path / "out", average_last=2, progress=False)
    assert [p.name for p in res.sources] == ["step-2", "step-4"]
    assert_same_tensors(load_out(tmp_path / "out"), _mean(run, [2, 4], [0.5, 0.5]))
    assert res.verification["from_pretrained"]["ok"]


def test_explicit_steps_and_weights_bf16(trained, tmp_path):
    run = trained / "mistral"
    consolidate(run / "checkpoints", tmp_path / "out", steps=[2, 4], weights=[1, 3], progress=False)
    assert_same_tensors(load_out(tmp_path / "out"), _mean(run, [2, 4], [0.25, 0.75]))


def test_average_bad_requests(trained, tmp_path):
    run = trained / "llama"
    with pytest.raises(ConsolidationError, match=r"--average-last 5: only 2 steps"):
        consolidate(run, tmp_path / "o", average_last=5, progress=False)
    with pytest.raises(ConsolidationError, match=r"--weights has 3 values but 2 checkpoints"):
        consolidate(run, tmp_path / "o", steps=[2, 4], weights=[1, 1, 1], progress=False)
    with pytest.raises(ConsolidationError, match=r"--steps \[6\]: not found.*\[2, 4\]"):
        consolidate(run, tmp_path / "o", steps=[2, 6], progress=False)
