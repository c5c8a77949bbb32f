"""A MoE fine-tuned from its directory comes back with per-expert tensors, byte for byte its trained experts.

The matrix (:mod:`.test_matrix`) shows every family's names, shapes, dtypes and logits;
this module takes the Qwen3-MoE row's run (the same run, shared through conftest's
``family_runs``) further, where a mistake would hide behind bf16 rounding:

- the DCP checkpoint held transformers 5's fused in-memory experts
  (``mlp.experts.gate_up_proj`` [E, 2I, H]), and verification.json says they were cut
  into the hub's per-expert tensors;
- consolidated again with ``--full-verify`` in the stored fp32, every per-expert tensor
  is byte for byte its expert's rows of the trained fused tensor, verification.json says
  every byte was compared, and ``from_pretrained`` gives exactly the trained logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

import pytest
import torch


from .conftest import FamilyRun, family_env, group
from .replicas import BY_KEY, Replica

ROW = BY_KEY["qwen3-moe"]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(group(ROW))]  # the run is the matrix's, on its worker
ATTENTION = "eager"


@pytest.fixture(scope="module")
def moe(family_runs: Callable[[Replica], FamilyRun]) -> FamilyRun:
    return family_runs(ROW)


def test_the_checkpoint_held_fused_experts_and_verification_says_it_cut_them(moe: FamilyRun) -> None:
    assert "model.layers.0.mlp.experts.gate_up_proj" in moe.trained_weights()
    report = json.loads((moe.out / "verification.json").read_text())
    per_layer = 3 * ROW.experts  # gate, up and down of each expert
    assert report["ok"] and any(f"cut into {2 * per_layer} per-expert tensors" in n for n in report["notes"]), report


def test_full_verify_in_fp32_every_expert_is_its_rows_of_the_fused_tensor(moe: FamilyRun) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = moe.run_dir.parent / "hf_model_fp32"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(moe.run_dir), str(out),
                           "--full-verify", "--no-progress", "--dtype", "fp32"], env=family_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["verified"] is True
    trained, got = moe.trained_weights(), load_file(str(out / "model.safetensors"))
    assert {k for k in got if ".experts." in k} == {
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
        for layer in range(2) for e in range(ROW.experts) for p in ("gate", "up", "down")}
    inter = ROW.config["moe_intermediate_size"]
    for layer in range(2):
        fused = f"model.layers.{layer}.mlp.experts."
        for e in range(ROW.experts):
            gate_up, down = trained[fused + "gate_up_proj"][e], trained[fused + "down_proj"][e]
            assert torch.equal(got[f"{fused}{e}.gate_proj.weight"], gate_up[:inter])
            assert torch.equal(got[f"{fused}{e}.up_proj.weight"], gate_up[inter:])
            assert torch.equal(got[f"{fused}{e}.down_proj.weight"], down)
    report = json.loads((out / "verification.json").read_text())
    assert report["ok"] and all(t["equal_to_source"] is True for t in report["tensors"].values())
    assert report["from_pretrained"] == {"ok": True}
    model = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation=ATTENTION).eval()
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(moe.base), attn_implementation=ATTENTION),
                                           dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(trained, strict=False)
    assert not missing and not unexpected
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = AutoTokenizer.from_pretrained(str(moe.base)).apply_chat_template(
        conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        got_logits, want_logits = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert got_logits.dtype == torch.float32 and torch.equal(got_logits, want_logits)
