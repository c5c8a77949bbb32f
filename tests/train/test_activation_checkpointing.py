"""``strategy.activation_checkpointing``: every mode trains exactly like none, and recomputes what it says.

One run of ``tests/train/ac_equivalence.py`` on 2 gloo ranks (tests/forked_ranks.py) (FSDP2 through
the trainer's ``strategies.prepare``, a 4-layer tiny Llama, fp32, 3 AdamW steps)
records each mode's losses, full gradients and the first backward's ``aten.mm``
calls.

Tolerance: none. Recomputation runs the same CPU kernels on the same inputs, so
losses and gradients are expected bit for bit; the comparison is exact
(``torch.equal``), stricter than the 1e-6 the issue allows, and held when written.

The matmul count proves each mode does its own thing (equal gradients alone would
also hold if the mode were ignored): ``full`` reruns every layer's forward
matmuls in backward, ``every_n_layers=2`` half the layers', and ``ops`` the three of
each layer its policy does not keep (q, v, gate; tests/train/test_ac_policy.py names
them). Measured: none 58, ops 70, every_n_layers 70, full 82.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

OVERRIDES = ["+experiment=smoke", "model.num_hidden_layers=4", "train.mixed_precision=no",
             "strategy.activation_checkpointing_every_n_layers=2"]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.forked_ranks import run
    from tests.train import ac_equivalence

    out = tmp_path_factory.mktemp("ac") / "records.pt"
    run(ac_equivalence.main, (str(out), OVERRIDES), world=2, preload=[ac_equivalence.__name__])
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("mode", ["full", "every_n_layers", "ops"])
def test_losses_and_gradients_equal_no_checkpointing(records: dict, mode: str) -> None:
    ref, got = records["none"], records[mode]
    assert got["losses"] == ref["losses"]
    for step, (a, b) in enumerate(zip(ref["grads"], got["grads"])):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step + 1}: {name} differs by {(a[name] - b[name]).abs().max()}"


def test_each_mode_wraps_the_layers_it_names(records: dict) -> None:
    assert records["none"]["layers"] == []
    assert records["full"]["layers"] == [0, 1, 2, 3]
    assert records["every_n_layers"]["layers"] == [1, 3]  # the 2nd and 4th, as torchtitan counts
    assert records["ops"]["layers"] == [0, 1, 2, 3]


def test_each_mode_recomputes_what_it_says(records: dict) -> None:
    mm = {mode: r["backward_mm"] for mode, r in records.items()}
    # The forward matmuls of one decoder layer, rerun in backward: 6 with torch 2.13 (q, k, v, o, gate, up;
    # the non-reentrant recompute stops early, and nothing in backward needs down_proj's output).
    per_layer = (mm["full"] - mm["none"]) / 4
    assert per_layer >= 6, mm
    assert mm["every_n_layers"] - mm["none"] == 2 * per_layer, mm
    assert mm["ops"] - mm["none"] == 3 * 4, mm  # the policy keeps every second matmul: 3 of 7 rerun per layer
