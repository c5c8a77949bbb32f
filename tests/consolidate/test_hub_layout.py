"""MoE experts are written as ``save_pretrained`` writes them (consolidate/hub_layout.py), and verified so.

transformers 5 holds a layer's experts fused ([E, 2I, H] ``gate_up_proj``, [E, H, I]
``down_proj``) and saves them per expert. Every ``model_type`` of the consolidator's table is
built here with transformers and saved with ``save_pretrained``; the table must turn the
in-memory state dict into exactly those tensors (names, shapes, bytes), and the consolidator
must write exactly that file's tensors from a DCP checkpoint of the in-memory state dict,
whatever the sharding (FSDP2's dim 0, uneven, a second dimension split, replicas), cast or
averaged, with every byte verified. A writer that takes the wrong expert is caught by the
verifier; a table that names the wrong tensors is caught by the architecture check, which
asks transformers' own reverse conversion at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from safetensors.torch import load_file

from fsdp_workflow.consolidate import ConsolidationError, consolidate
from fsdp_workflow.consolidate import hub_layout
from fsdp_workflow.consolidate.hub_layout import MODEL_TYPES, Piece, hub_pieces
from fsdp_workflow.consolidate.reader import SourceTensor
from fsdp_workflow.consolidate.saved_names import saved_names
from fsdp_workflow.consolidate.synthetic import write_dcp
from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, step_name

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256)
_DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0, n_group=1,
                 topk_group=1)
# Each model_type of the table at a tiny shape, every layer a MoE one (4 experts).
FAMILIES: Dict[str, Dict[str, Any]] = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, bos_token_id=None),
    "deepseek_v2": dict(_DEEPSEEK, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
}


# Families whose transformers conversion only renames: no row of the table, transformers' own renamings
# reversed (consolidate/saved_names.py). Granite-MoE is in the family matrix; EXAONE 3 renames a dense model.
RENAMED: Dict[str, Dict[str, Any]] = {
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "exaone": dict(eos_token_id=1, bos_token_id=0, pad_token_id=0),
    "aria_text": dict(moe_num_experts=4, moe_topk=2, moe_intermediate_size=32, moe_num_shared_experts=1),
}


# Not rows of the table: transformers converts them exactly as one of its patterns (hub_layout.PATTERNS).
ALIKE: Dict[str, Dict[str, Any]] = {
    "cohere2_moe": dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        eos_token_id=1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False),
    # alike but for a plain renaming besides (the router's score-correction bias), reversed after the cut
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=0, pad_token_id=0),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, eos_token_id=1,
                       bos_token_id=0),
}


# Experts of several slabs each (gate and up 2 MiB, in 1 MiB slabs), for the fast verification's sampling.
LARGE = ("qwen3_moe", dict(SHAPE, hidden_size=512, num_hidden_layers=1, num_experts=2, num_experts_per_tok=1,
                           moe_intermediate_size=1024))


def _build(model_type: str, directory: Path) -> Dict[str, torch.Tensor]:
    """Save a tiny ``model_type`` into ``directory`` with save_pretrained; return its in-memory state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "large":
        config = AutoConfig.for_model(LARGE[0], **LARGE[1])
    else:
        config = AutoConfig.for_model(model_type, **SHAPE, **{**FAMILIES, **RENAMED, **ALIKE}[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tuple[Path, Dict[str, torch.Tensor]]]:
    """``built(model_type)``: (its save_pretrained directory, its in-memory state dict), built once."""
    root = tmp_path_factory.mktemp("moe-families")
    cache: Dict[str, Tuple[Path, Dict[str, torch.Tensor]]] = {}

    def get(model_type: str) -> Tuple[Path, Dict[str, torch.Tensor]]:
        if model_type not in cache:
            cache[model_type] = (root / model_type, _build(model_type, root / model_type))
        return cache[model_type]

    return get


def _saved(directory: Path) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _cut(t: torch.Tensor, p: Piece) -> torch.Tensor:
    for i in p.index:
        t = t[i]
    return t[p.rows[0]:p.rows[1]] if p.rows else t


def test_the_table_covers_the_families_built_here() -> None:
    assert set(FAMILIES) == set(MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_table_gives_what_save_pretrained_writes(built: Callable, model_type: str) -> None:
    """Names, shapes and bytes of the table's cut of the in-memory state dict = the file save_pretrained wrote."""
    directory, memory = built(model_type)
    config = json.loads((directory / "config.json").read_text())
    layout = hub_pieces({k: tuple(v.shape) for k, v in memory.items()}, config)
    got = {p.name: _cut(memory[p.source], p) for p in layout.pieces}
    want = _saved(directory)
    assert sorted(got) == sorted(want)
    assert any(not p.whole for p in layout.pieces), "no fused expert tensor: the family is not MoE at this shape"
    for name, tensor in want.items():
        assert tuple(got[name].shape) == tuple(tensor.shape) == next(p.shape for p in layout.pieces if p.name == name)
        assert torch.equal(got[name], tensor), name
    assert layout.notes and "save_pretrained" in layout.notes[0]


def test_every_moe_family_of_the_matrix_is_in_the_table() -> None:
    from tests.families.replicas import FAMILIES as MATRIX

    # a row of the table, or transformers' renamings reversed (Granite-MoE)
    assert {r.model_type for r in MATRIX if r.experts and r.model_type not in MODEL_TYPES} == {"granitemoe"}
    assert saved_names("granitemoe") is not None


@pytest.mark.parametrize("model_type", sorted(RENAMED))
def test_renamed_families_get_the_names_save_pretrained_writes(built: Callable, model_type: str) -> None:
    """No table row: transformers' reversed renamings turn the in-memory names into the saved ones, bytes untouched."""
    assert model_type not in MODEL_TYPES
    directory, memory = built(model_type)
    config = json.loads((directory / "config.json").read_text())
    layout = hub_pieces({k: tuple(v.shape) for k, v in memory.items()}, config)
    want = _saved(directory)
    assert all(p.whole for p in layout.pieces)
    assert {p.name: p.shape for p in layout.pieces} == {k: tuple(v.shape) for k, v in want.items()}
    assert set(want) != set(memory)  # transformers really renames this family
    assert all(torch.equal(memory[p.source], want[p.name]) for p in layout.pieces)
    assert "renamings, reversed" in layout.notes[0] and "tensor(s) renamed" in layout.notes[0]


def test_a_granite_moe_checkpoint_consolidates_to_what_save_pretrained_writes(built: Callable, tmp_path: Path) -> None:
    """Issue 49: Granite-MoE came back as experts.gate_up_proj / router.weight, not its input_linear / router.layer."""
    directory, memory = built("granitemoe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=2)
    consolidate(ckpt, tmp_path / "out", reference=directory, progress=False)
    got, want = _saved(tmp_path / "out"), _saved(directory)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in got
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and report["from_pretrained"] == {"ok": True}
    assert report["keys"]["missing"] == report["keys"]["unexpected"] == []
    assert any("revert_weight_conversion" in n for n in report["architecture"]["notes"])


def test_names_unlike_the_reference_weights_are_a_note(built: Callable, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With --reference at the directory training started from, its own weights' names are compared.

    Names left as held in memory (the rule before issue 49, restored here by turning the
    renamings off) still load with transformers, so they pass; the note names the difference.
    """
    from fsdp_workflow.consolidate.verify import architecture

    directory, memory = built("granitemoe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=2)
    result = consolidate(ckpt, tmp_path / "ok", reference=directory, progress=False)
    assert not any("reference directory" in n for n in result.verification["notes"])
    monkeypatch.setattr(hub_layout, "saved_names", lambda model_type: None)
    monkeypatch.setattr(architecture, "saved_names", lambda model_type: None)
    monkeypatch.setenv("FSDP_WORKFLOW_NO_CACHE", "1")
    result = consolidate(ckpt, tmp_path / "held", reference=directory, progress=False)
    assert result.verification["ok"]
    note = next(n for n in result.verification["notes"] if "reference directory" in n)
    assert "6 only in the output (e.g. ['model.layers.0.block_sparse_moe.experts.down_proj'" in note, note
    assert "6 only in the reference (e.g. ['model.layers.0.block_sparse_moe.input_linear.weight'" in note, note


@pytest.mark.parametrize("model_type", sorted(ALIKE))
def test_a_model_type_transformers_converts_as_a_pattern_takes_its_cut(built: Callable, tmp_path: Path,
                                                                       model_type: str) -> None:
    """No table row: transformers' own conversion for it is Qwen2-MoE's or Mixtral's (plus plain renamings, reversed
    after the cut), so the experts are cut alike and written as save_pretrained writes them."""
    assert model_type not in MODEL_TYPES
    directory, memory = built(model_type)
    config = json.loads((directory / "config.json").read_text())
    layout = hub_pieces({k: tuple(v.shape) for k, v in memory.items()}, config)
    want = _saved(directory)
    assert any(not p.whole for p in layout.pieces)
    assert {p.name: _cut(memory[p.source], p).shape for p in layout.pieces} == {k: v.shape for k, v in want.items()}
    assert all(torch.equal(_cut(memory[p.source], p), want[p.name]) for p in layout.pieces)
    consolidate(_dcp(tmp_path / "ckpt", memory, dp=2), tmp_path / "out", reference=directory, progress=False)
    got = _saved(tmp_path / "out")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and report["from_pretrained"] == {"ok": True}
    assert any("revert_weight_conversion" in n for n in report["architecture"]["notes"])


def test_other_models_are_written_as_they_are() -> None:
    shapes = {"model.embed_tokens.weight": (8, 4), "model.layers.0.mlp.gate_proj.weight": (6, 4), "lm_head.weight": (8, 4)}
    for config in (None, {"model_type": "llama", "hidden_size": 4}):
        layout = hub_pieces(shapes, config)
        assert [(p.name, p.source, p.shape, p.whole) for p in layout.pieces] == [(n, n, s, True) for n, s in shapes.items()]
        assert layout.notes == []


def test_fused_experts_of_a_model_type_not_in_the_table_are_kept_with_a_note() -> None:
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (4, 8, 4), "model.layers.0.mlp.experts.down_proj": (4, 4, 4)}
    layout = hub_pieces(shapes, {"model_type": "some_future_moe"})  # one transformers does not know either
    assert [p.name for p in layout.pieces] == list(shapes)
    assert "'some_future_moe' is not in the consolidator's table" in layout.notes[0]


def test_a_fused_shape_the_layout_does_not_know_is_refused() -> None:
    """[E, H, 2I] (a transposed layout a future transformers might hold) is named, not cut wrongly."""
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (4, 4, 16), "model.layers.0.mlp.experts.down_proj": (4, 8, 4)}
    with pytest.raises(ConsolidationError, match=r"gate_up_proj' has shape \[4, 4, 16\].*hub_layout.py"):
        hub_pieces(shapes, {"model_type": "qwen3_moe", "hidden_size": 4})


# dp: ranks on dim 0 (FSDP2); tp on tp_dim; replicas: chunks listed several times (2-D mesh)
SHARDINGS = {"fsdp2": dict(dp=2), "uneven-3": dict(dp=3), "hidden-split": dict(dp=2, tp=2, tp_dim=2),
             "rows-split-replicated": dict(dp=1, tp=4, tp_dim=1, replicas=2)}


def _dcp(path: Path, memory: Dict[str, torch.Tensor], scale: float = 1.0, **sharding: Any) -> Path:
    """A DCP checkpoint of the in-memory state dict under the trainer's ``model.`` root."""
    write_dcp(path, [(f"model.{k}", tuple(v.shape), v.dtype) for k, v in memory.items()],
              lambda f, o, s, d: (memory[f[len("model."):]] * scale)[tuple(slice(a, a + n) for a, n in zip(o, s))],
              **sharding)
    return path


@pytest.mark.parametrize("model_type,sharding", [("qwen3_moe", "fsdp2"), ("qwen3_moe", "uneven-3"),
                                                 ("qwen3_moe", "hidden-split"), ("mixtral", "rows-split-replicated"),
                                                 ("phimoe", "fsdp2"), ("qwen2_moe", "hidden-split")])
def test_the_consolidated_model_is_what_save_pretrained_writes(built: Callable, tmp_path: Path, model_type: str,
                                                               sharding: str) -> None:
    directory, memory = built(model_type)
    ckpt = _dcp(tmp_path / "ckpt", memory, **SHARDINGS[sharding])
    result = consolidate(ckpt, tmp_path / "out", reference=directory, progress=False, full_verify=True)
    got, want = _saved(tmp_path / "out"), _saved(directory)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and all(t["equal_to_source"] for t in report["tensors"].values())
    assert report["keys"]["missing"] == report["keys"]["unexpected"] == report["keys"]["shape_mismatch"] == []
    assert report["from_pretrained"] == {"ok": True}
    assert any("revert_weight_conversion" in n for n in report["architecture"]["notes"])
    assert any("per-expert tensors" in n for n in report["notes"])
    assert result.num_tensors == len(want)


def test_cast_and_fast_verification_on_experts(built: Callable, tmp_path: Path) -> None:
    directory, memory = built("qwen3_moe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=3, tp=2, tp_dim=2)
    consolidate(ckpt, tmp_path / "out", reference=directory, progress=False, dtype="bf16")
    got, want = _saved(tmp_path / "out"), _saved(directory)
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and {t["check"] for t in report["tensors"].values()} == {"rounding"}


def test_fast_verification_samples_large_experts_and_finds_a_wrong_one(built: Callable, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts of several slabs, their rows split over 3 ranks (chunk edges inside gate and up): sampled, equal."""
    directory, memory = built("large")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=1, tp=3, tp_dim=1)
    consolidate(ckpt, tmp_path / "out", reference=directory, progress=False)
    got, want = _saved(tmp_path / "out"), _saved(directory)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    tensors = json.loads((tmp_path / "out" / "verification.json").read_text())["tensors"]
    gate = tensors["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert gate["shape"] == [1024, 512] and gate["equal_to_source"] is None and 0 < gate["compared_fraction"] < 1
    select = SourceTensor.select
    monkeypatch.setattr(SourceTensor, "select", lambda self, index, rows: select(self, (1 - index[0],), rows))
    with pytest.raises(ConsolidationError, match=r"output differs from the source for 6 tensor\(s\)"):
        consolidate(ckpt, tmp_path / "out2", reference=directory, progress=False)


def test_averaged_experts(built: Callable, tmp_path: Path) -> None:
    directory, memory = built("mixtral")
    ckpts = tmp_path / "run" / CHECKPOINTS_DIR
    _dcp(ckpts / step_name(1), memory, dp=2)
    _dcp(ckpts / step_name(2), memory, scale=2.0, dp=3)  # a different sharding per step, as after a resize
    consolidate(ckpts, tmp_path / "out", reference=directory, progress=False, average_last=2, full_verify=True)
    got, want = _saved(tmp_path / "out"), _saved(directory)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], 0.5 * want[k] + 0.5 * (want[k] * 2.0)) for k in want)
    report = json.loads((tmp_path / "out" / "verification.json").read_text())
    assert report["ok"] and {t["check"] for t in report["tensors"].values()} == {"average"}


def test_a_writer_taking_the_wrong_expert_is_caught(built: Callable, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    directory, memory = built("qwen3_moe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=2)
    select = SourceTensor.select

    def off_by_one(self: SourceTensor, index: Tuple[int, ...], rows: Tuple[int, int]) -> SourceTensor:
        return select(self, ((index[0] + 1) % self.shape[0],), rows)

    monkeypatch.setattr(SourceTensor, "select", off_by_one)
    with pytest.raises(ConsolidationError, match=r"output differs from the source for 24 tensor\(s\): "
                                                 r"'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight'"):
        consolidate(ckpt, tmp_path / "out", reference=directory, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_table_naming_the_wrong_tensors_is_caught_by_transformers(built: Callable, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The architecture check expects what transformers' own revert_weight_conversion saves, not the table's names."""
    directory, memory = built("qwen3_moe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=2)
    monkeypatch.setitem(MODEL_TYPES, "qwen3_moe", hub_layout.MIXTRAL)  # w1/w3/w2 under block_sparse_moe: wrong here
    monkeypatch.setenv("FSDP_WORKFLOW_NO_CACHE", "1")
    with pytest.raises(ConsolidationError, match=r"does not match the architecture in config.json: missing "
                                                 r"\['model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight'"):
        consolidate(ckpt, tmp_path / "out", reference=directory, progress=False)
    assert not (tmp_path / "out").exists()


def test_without_a_reference_the_checkpoint_names_are_kept_with_a_note(built: Callable, tmp_path: Path) -> None:
    _directory, memory = built("qwen3_moe")
    ckpt = _dcp(tmp_path / "ckpt", memory, dp=2)
    consolidate(ckpt, tmp_path / "out", progress=False)
    got = _saved(tmp_path / "out")
    assert sorted(got) == sorted(memory)
    notes = json.loads((tmp_path / "out" / "verification.json").read_text())["notes"]
    assert any("fused expert tensor(s)" in n and "hub_layout.py" in n for n in notes)
