"""2-rank gloo FSDP2 training on CPU: loss falls, DCP layout, sharded DTensors, hf_assets, metrics.

Exact resume from this run's step-10 checkpoint (losses, weights and optimizer state equal
the straight run's at step 20) is proven on the resume after a kill -9 and corrupt newer
checkpoints: tests/train/test_preemption.py::test_kill_9_during_save_keeps_previous_checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.train.runner import log_text

pytestmark = pytest.mark.slow


def test_loss_falls_and_metrics_lines(straight_run: Path) -> None:
    recs = [json.loads(line) for line in (straight_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 21))
    for r in recs:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["mfu"] >= 0
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert "fully_shard on cpu" in log_text(straight_run)
    assert json.loads((straight_run / "train_exit.json").read_text())["exit_code"] == 0


def test_checkpoint_layout_one_shard_per_rank(straight_run: Path) -> None:
    ckpts = straight_run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-10", "step-20"]
    for step in (10, 20):
        files = sorted(p.name for p in (ckpts / f"step-{step}").iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_params_are_sharded_dtensors(straight_run: Path) -> None:
    """Every 2-D weight is stored as two chunks split on dim 0: each rank wrote its own shard."""
    md = FileSystemReader(str(straight_run / "checkpoints" / "step-20")).read_metadata()
    q = md.state_dict_metadata["model.model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.size) == (64, 64)
    shard_sizes = sorted(tuple(c.sizes) for c in q.chunks)
    assert shard_sizes == [(32, 64), (32, 64)] and all(s != tuple(q.size) for s in shard_sizes)
    keys = set(md.state_dict_metadata)
    assert "model.lm_head.weight" in keys
    assert "optimizer.state.model.layers.1.mlp.down_proj.weight.exp_avg" in keys
    assert any(k.startswith("trainer.") for k in keys) and any(k.startswith("scheduler.") for k in keys)
    assert not any("_checkpoint_wrapped_module" in k or "_orig_mod" in k for k in keys)


def test_hf_assets(straight_run: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assets = straight_run / "hf_assets"
    assert (assets / "generation_config.json").is_file()
    cfg = AutoConfig.from_pretrained(assets)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.vocab_size == 260
    tok = AutoTokenizer.from_pretrained(assets)
    assert tok.decode(tok("héllo")["input_ids"]) == "héllo"


def _load_model_tensors(run: Path, step: int = 20) -> dict[str, torch.Tensor]:
    """The full ``model.*`` tensors of a checkpoint, gathered in this process."""
    import torch.distributed.checkpoint as dcp

    path = str(run / "checkpoints" / f"step-{step}")
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith("model.") and hasattr(v, "size")}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd


def test_consolidated_model_matches_training_weights(straight_run: Path, tmp_path: Path) -> None:
    """Round trip: trainer checkpoint -> consolidator -> from_pretrained gives the trained tensors and logits."""
    import subprocess
    import sys

    pytest.importorskip("fsdp_workflow.consolidate.consolidation")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf_model"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(straight_run), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = _load_model_tensors(straight_run)
    got = model.state_dict()
    assert set(got) == {k.removeprefix("model.") for k in trained}
    assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in trained.items())
    ref = AutoModelForCausalLM.from_config(model.config)
    ref.load_state_dict({k.removeprefix("model."): v for k, v in trained.items()})
    ids = torch.arange(32).view(1, 32) % 260
    assert torch.equal(model(ids).logits, ref(ids).logits)
