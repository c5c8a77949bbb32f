"""A Qwen3-MoE fine-tuned from its directory comes back in the directory's own layout: per-expert tensors.

One real run (module-scoped): the tiny Qwen3-MoE replica of the family matrix
(tests/families/replicas.py, saved by ``save_pretrained`` with the hub's per-expert names),
fine-tuned 2 steps with FSDP2 on 2 gloo ranks through the real command, which saves DCP
checkpoints under transformers 5's fused in-memory names (``mlp.experts.gate_up_proj``
[E, 2I, H]) and consolidates them (verification on, the default). Then:

- the consolidated safetensors hold the directory's tensor names, shapes and dtypes;
- ``from_pretrained`` of it gives logits exactly equal (tolerance 0, in its dtype) to the
  trained weights read independently of the consolidator (torch's ``dcp_to_torch_save``,
  loaded into the class built from the directory's config.json), and not the base's;
- consolidated again with ``--full-verify`` in the stored fp32, every per-expert tensor is
  byte for byte its expert's rows of the trained fused tensor, and verification.json says
  every byte was compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch

from fsdp_workflow.core.rundir import list_checkpoints
from tests.families.replicas import BY_KEY, build

pytestmark = pytest.mark.slow

ROW = BY_KEY["qwen3-moe"]
RUN = ["train.max_steps=2", "train.seq_len=128", "optimizer.warmup_steps=0", "checkpoint.every_steps=0"]
ATTENTION = "eager"


def _env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    """(the replica's directory, the run directory of its fine-tuning)."""
    root = tmp_path_factory.mktemp("moe-run")
    base = build(ROW, root / "base")
    run_dir = root / "run"
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke_chat", f"model.name_or_path={base}",
            f"run_dir={run_dir}", "data.chat_template=null", *RUN, *ROW.run]
    proc = subprocess.run(argv, cwd=root, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return base, run_dir


def _layout(directory: Path) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in a model directory's safetensors (tiny models: loaded whole)."""
    from safetensors.torch import load_file

    return {k: (tuple(v.shape), v.dtype) for f in sorted(directory.glob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


def _trained(run_dir: Path) -> Dict[str, torch.Tensor]:
    """The model part of the last DCP checkpoint, read by torch's own converter: transformers 5's in-memory names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, last = list_checkpoints(run_dir / "checkpoints")[-1]
    dest = run_dir.parent / "trained.pt"
    if not dest.exists():
        dcp_to_torch_save(str(last), str(dest))
    return torch.load(str(dest), weights_only=False)["model"]


def test_names_shapes_and_dtypes_are_the_directorys(moe_run: Tuple[Path, Path]) -> None:
    base, run_dir = moe_run
    got, want = _layout(run_dir / "hf_model"), _layout(base)
    assert got == want
    assert any(".mlp.experts.3.up_proj.weight" in k for k in got)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _trained(run_dir)  # the checkpoint held them fused
    report = json.loads((run_dir / "hf_model" / "verification.json").read_text())
    assert report["ok"] and any("cut into 24 per-expert tensors" in n for n in report["notes"])


def _ids(base: Path) -> Any:
    from transformers import AutoTokenizer

    conv = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And times 3?"}]
    tok = AutoTokenizer.from_pretrained(str(base))
    return tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def _logits(model_dir: Path, base: Path, trained: Dict[str, torch.Tensor]) -> Tuple[Any, Any, Any]:
    """Logits of the consolidated model, of the trained weights loaded into the directory's class, and of the base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=ATTENTION).eval()
    config = AutoConfig.from_pretrained(str(base), attn_implementation=ATTENTION)
    ref = AutoModelForCausalLM.from_config(config, dtype=out.dtype).eval()
    missing, unexpected = ref.load_state_dict(trained, strict=False)
    assert not missing and not unexpected
    before = AutoModelForCausalLM.from_pretrained(str(base), attn_implementation=ATTENTION, dtype=out.dtype).eval()
    ids = _ids(base)
    with torch.no_grad():
        return out(input_ids=ids).logits, ref(input_ids=ids).logits, before(input_ids=ids).logits


def test_logits_equal_the_checkpoints(moe_run: Tuple[Path, Path]) -> None:
    base, run_dir = moe_run
    got, want, before = _logits(run_dir / "hf_model", base, _trained(run_dir))
    assert got.dtype == torch.bfloat16  # consolidate.dtype=auto: the directory's dtype
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(got, before)


def test_full_verify_in_fp32_every_expert_is_its_rows_of_the_fused_tensor(moe_run: Tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    base, run_dir = moe_run
    out = run_dir.parent / "hf_model_fp32"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run_dir), str(out), "--full-verify",
                           "--no-progress"], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["verified"] is True
    trained, got = _trained(run_dir), load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: s for k, (s, _) in _layout(base).items()}
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
    got32, want32, _ = _logits(out, base, trained)
    assert got32.dtype == torch.float32 and torch.equal(got32, want32)
