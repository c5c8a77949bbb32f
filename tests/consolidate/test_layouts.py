"""Every supported layout consolidates to the trained tensors; ambiguous dirs are explained."""

from __future__ import annotations

import shutil

import pickle

import pytest
import torch
from safetensors.torch import load_file

from fsdp_workflow.consolidate import ConsolidationError, consolidate
from fsdp_workflow.consolidate import reader

from . import layouts
from .conftest import assert_same_tensors, expected, load_out, logits_equal

pytestmark = pytest.mark.slow


def test_accelerate_save_state(trained, tmp_path):
    run = trained / "llama"
    root = layouts.accelerate(run, tmp_path / "acc")
    res = consolidate(root, tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert res.layout == "accelerate" and res.sources[0].name == "pytorch_model_fsdp_0"
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 4))
    logits_equal(tmp_path / "out", expected(run, 4), run / "hf_assets")


def test_accelerate_ema_subtree(trained, tmp_path):
    run = trained / "llama"
    root = layouts.accelerate(run, tmp_path / "acc")
    res = consolidate(root, tmp_path / "out", subtree="ema", reference=run / "hf_assets", progress=False)
    assert res.sources[0].name == "pytorch_ema_model_fsdp_0"
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 2))


def test_hf_trainer_output_dir(trained, tmp_path):
    run = trained / "qwen2"
    root = layouts.hf_trainer(run, tmp_path / "trainer-out")
    res = consolidate(root, tmp_path / "out", step=2, progress=False)  # reference found in checkpoint-2/
    assert res.layout == "hf-trainer" and res.sources[0].parent.name == "checkpoint-2"
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 2), skip=("lm_head.weight",))
    logits_equal(tmp_path / "out", expected(run, 2), run / "hf_assets")


def test_torchtitan_step_dir_skips_optimizer(trained, tmp_path):
    run = trained / "mistral"
    root = layouts.torchtitan(expected(run, 4), tmp_path / "titan")
    consolidate(root, tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 4))


def test_lightning_meta_pt(trained, tmp_path):
    run = trained / "llama"
    layouts.lightning(expected(run, 4), tmp_path / "pl", {"global_step": 4, "epoch": 0, "hparams": {"lr": 0.1}})
    res = consolidate(tmp_path / "pl", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert res.layout == "lightning"
    assert res.verification["meta_pt"]["global_step"] == 4
    assert_same_tensors(load_out(tmp_path / "out"), expected(run, 4))


def test_nemo2_weights_dir(trained, tmp_path):
    run = trained / "qwen2"
    want = expected(run, 4)
    layouts.nemo2(want, tmp_path / "nemo")
    res = consolidate(tmp_path / "nemo", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert res.layout == "nemo2"
    assert_same_tensors(load_out(tmp_path / "out"), want, skip=("lm_head.weight",))


def test_dtensor_shard_dim1_uneven_and_replicated(trained, tmp_path):
    res = consolidate(trained / "dtensor" / "ckpt", tmp_path / "out", progress=False)
    assert "no reference config.json" in " ".join(res.verification["notes"])
    assert all(t["equal_to_source"] for t in res.verification["tensors"].values())
    assert_same_tensors(load_out(tmp_path / "out"), load_file(str(trained / "dtensor" / "expected.safetensors")))


@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_2d_mesh_with_replicas_and_wrapper_prefixes(trained, tmp_path, dtype):
    run = trained / "mistral"
    want = expected(run, 4)
    ckpt = layouts.mesh_2d(want, tmp_path / "mesh")
    meta = pickle.load(open(ckpt / ".metadata", "rb"))
    sample = meta.state_dict_metadata[next(iter(meta.state_dict_metadata))]
    assert len(sample.chunks) == 8  # 4 shards, each listed twice
    consolidate(ckpt, tmp_path / "out", reference=run / "hf_assets", dtype=dtype, progress=False)
    if dtype:
        want = {k: v.to(torch.float16) for k, v in want.items()}
    assert_same_tensors(load_out(tmp_path / "out"), want)


def test_stream_transformed_items_use_dcp_reader(trained, tmp_path, monkeypatch):
    run = trained / "llama"
    want = expected(run, 4)
    layouts.save({"model": {k: v.clone() for k, v in want.items()}}, tmp_path / "z", [layouts.ZlibTransform()])
    meta = pickle.load(open(tmp_path / "z" / ".metadata", "rb"))
    assert all(i.transform_descriptors for i in meta.storage_data.values())
    monkeypatch.setattr(reader, "EXTRA_EXTENSIONS", [layouts.ZlibTransform])
    consolidate(tmp_path / "z", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert_same_tensors(load_out(tmp_path / "out"), want)


def test_parent_with_several_checkpoints_lists_them(trained, tmp_path):
    run = trained / "llama"
    shutil.copytree(run / "checkpoints" / "step-2", tmp_path / "p" / "a")
    shutil.copytree(run / "checkpoints" / "step-4", tmp_path / "p" / "b")
    with pytest.raises(ConsolidationError, match=r"several DCP checkpoints inside: \['a', 'b'\]"):
        consolidate(tmp_path / "p", tmp_path / "out", progress=False)
    res = consolidate(tmp_path / "p", tmp_path / "out", subtree="b", reference=run / "hf_assets", progress=False)
    assert res.sources[0].name == "b"


def test_empty_dir_says_what_exists(tmp_path):
    (tmp_path / "src" / "logs").mkdir(parents=True)
    with pytest.raises(ConsolidationError, match=r"no DCP checkpoint found.*\['logs'\]"):
        consolidate(tmp_path / "src", tmp_path / "out", progress=False)


def test_deepspeed_checkpoint_with_corrupt_files_is_explained(tmp_path):
    """DeepSpeed checkpoints are read (test_deepspeed.py); a 1-byte rank file is named as corrupt."""
    ds = tmp_path / "ds"
    (ds / "global_step10").mkdir(parents=True)
    (ds / "latest").write_text("global_step10")
    (ds / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ds / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    with pytest.raises(ConsolidationError, match=r"mp_rank_00_model_states\.pt: cannot be read.*truncated or corrupt"):
        consolidate(ds, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_real_zstd_items_use_dcp_reader(trained, tmp_path):
    """DCP's own ZStandard stream transform (needs `zstandard`, in the dev extra) round-trips exactly."""
    from torch.distributed.checkpoint._extension import ZStandard

    run = trained / "llama"
    want = expected(run, 4)
    layouts.save({"model": {k: v.clone() for k, v in want.items()}}, tmp_path / "z", [ZStandard()])
    meta = pickle.load(open(tmp_path / "z" / ".metadata", "rb"))  # written by this test: trusted
    assert all(i.transform_descriptors for i in meta.storage_data.values())
    consolidate(tmp_path / "z", tmp_path / "out", reference=run / "hf_assets", progress=False)
    assert_same_tensors(load_out(tmp_path / "out"), want)
