"""DeepSpeed ZeRO checkpoints written by this project's trainer on a GPU (see fixtures/DEEPSPEED_FIXTURES.md).

The reference for every fixture is DeepSpeed's own ``zero_to_fp32`` output, computed on
the machine that trained it and stored as ``expected.safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fsdp_workflow.consolidate import consolidation as api
from fsdp_workflow.consolidate.consolidation_errors import ConsolidationError

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ["deepspeed_zero3/tiny_llama", "deepspeed_zero3/tiny_qwen2", "deepspeed_zero2/tiny_qwen2"]
TAG = Path("checkpoints/step-4/global_step4")


def _copy(case: str, tmp_path: Path) -> Path:
    run = tmp_path / "run dir; with spaces"
    shutil.copytree(FIXTURES / case, run)
    return run


def _cli(src: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(src), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_matches_deepspeed_zero_to_fp32(case, tmp_path):
    out = tmp_path / "hf"
    res = api.consolidate(FIXTURES / case / "checkpoints", out, progress=False)
    got = load_file(out / "model.safetensors")
    want = load_file(FIXTURES / case / "expected.safetensors")
    tied = json.loads((FIXTURES / case / "hf_assets/config.json").read_text())["tie_word_embeddings"]
    assert set(want) - set(got) == ({"lm_head.weight"} if tied else set())
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k
    v = res.verification
    assert v["ok"] and v["layout"] == "deepspeed" and v["from_pretrained"]["ok"]
    ds = v["deepspeed"][0]
    assert ds["source"].startswith("fp32 master weights") and ds["zero_stage"] == int(case[len("deepspeed_zero")])
    if tied:
        assert v["tied_lm_head"]["identical"] and ds["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    if ds["zero_stage"] == 2:  # the saved bf16 module is the rounding of the rebuilt fp32 masters
        assert ds["16bit_module_matches_fp32"] == {"matching": len(got), "differing": []}
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".deepspeed-staging-*"))


@pytest.mark.parametrize("case", ["deepspeed_zero3/tiny_qwen2", "deepspeed_zero2/tiny_qwen2"])
def test_from_pretrained_logits_match_reference(case, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "hf"
    api.consolidate(FIXTURES / case / "checkpoints", out, dtype="bf16", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / case / "hf_assets")).eval()
    want = {k: v.to(torch.bfloat16).float() for k, v in load_file(FIXTURES / case / "expected.safetensors").items()}
    ref.load_state_dict(want, strict=False)
    ids = torch.arange(3, 67).reshape(2, 32)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.slow  # a whole chain: its module is handed out with the long groups (tests/conftest.py)
def test_pipeline_command_on_run_dir(tmp_path):
    """``consolidate.sbatch`` runs ``python -m fsdp_workflow.consolidate RUN_DIR/checkpoints OUT``."""
    run = _copy("deepspeed_zero3/tiny_llama", tmp_path)
    proc = _cli(run / "checkpoints", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    v = json.loads((tmp_path / "out/verification.json").read_text())
    assert v["ok"] and v["layout"] == "deepspeed" and v["assets_copied"]
    for src in (run, run / "checkpoints/step-4", run / TAG):  # any level resolves the same
        res = api.consolidate(src, tmp_path / f"o-{src.name}", progress=False, verify=False)
        assert res.layout == "deepspeed" and res.sources == [run / TAG]


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    run = _copy("deepspeed_zero3/tiny_llama", tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch '{marker}'",))

    target = run / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": {}, "param_shapes": [], "payload": Evil()}, target)
    proc = _cli(run / "checkpoints", tmp_path / "out")
    assert proc.returncode == 2 and "refused to unpickle" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_truncated_rank_file_is_a_clear_error(tmp_path):
    run = _copy("deepspeed_zero2/tiny_qwen2", tmp_path)
    f = run / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = _cli(run, tmp_path / "out")
    assert proc.returncode == 2 and "truncated or corrupt" in proc.stderr and f.name in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_rank_file_is_a_clear_error(tmp_path):
    run = _copy("deepspeed_zero3/tiny_qwen2", tmp_path)
    # Claim two data-parallel ranks: rank 1's optimizer partitions are then missing.
    model = run / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(model) as z:
        assert any(n.endswith("data.pkl") for n in z.namelist())
    from fsdp_workflow.consolidate.deepspeed import load_safely

    state = dict(load_safely(model))
    state["dp_world_size"] = 2
    torch.save(state, model)
    proc = _cli(run, tmp_path / "out")
    assert proc.returncode == 2 and "rank(s) [1] are missing" in proc.stderr, proc.stderr


def test_latest_naming_a_missing_tag(tmp_path):
    run = _copy("deepspeed_zero3/tiny_llama", tmp_path)
    (run / "checkpoints/step-4/latest").write_text("global_step9")
    with pytest.raises(ConsolidationError, match="'latest' names this DeepSpeed tag"):
        api.consolidate(run / "checkpoints", tmp_path / "out", progress=False)
    (run / "checkpoints/step-4/latest").write_text("../../etc")
    with pytest.raises(ConsolidationError, match="not a DeepSpeed tag"):
        api.consolidate(run / "checkpoints", tmp_path / "out", progress=False)


def test_zero3_two_rank_partitioning(tmp_path):
    """The world-1 ZeRO-3 fixture re-split as DeepSpeed lays out 2 ranks (ceil(n/2) per rank, padded).

    Not DeepSpeed-written (no multi-GPU fixture yet): checks the cross-rank walk and padding.
    """
    from fsdp_workflow.consolidate.deepspeed import load_safely

    run = _copy("deepspeed_zero3/tiny_qwen2", tmp_path)
    tag = run / TAG
    model = dict(load_safely(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    optim = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flat = torch.cat(list(load_safely(optim)["optimizer_state_dict"]["fp32_flat_groups"]))
    ranks: list[list[torch.Tensor]] = [[], []]
    off = 0
    for group in model["param_shapes"]:
        for shape in group.values():
            n = shape.numel()
            half = -(-n // 2)
            padded = torch.cat([flat[off:off + n], torch.full((2 * half - n,), 7.0)])
            ranks[0].append(padded[:half])
            ranks[1].append(padded[half:])
            off += n
    model["dp_world_size"] = 2
    for r in (0, 1):
        torch.save(model, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        state = {"zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [torch.cat(ranks[r])]}
        torch.save({"optimizer_state_dict": state}, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    res = api.consolidate(run, tmp_path / "hf", progress=False)
    got = load_file(tmp_path / "hf/model.safetensors")
    want = load_file(FIXTURES / "deepspeed_zero3/tiny_qwen2/expected.safetensors")
    assert res.verification["deepspeed"][0]["world_size"] == 2
    assert all(torch.equal(v, want[k]) for k, v in got.items())
