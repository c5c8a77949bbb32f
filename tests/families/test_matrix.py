"""The family matrix: each replica fine-tuned from its directory alone, as a user would, then loaded back.

One run per family (conftest's ``family_runs``, once per session: every test of a family
shares it): ``python -m fsdp_workflow +experiment=smoke_chat model.name_or_path=DIR`` on the
shipped conversations rendered by the family's own template, which prepares the
data, trains 2 steps with FSDP2 (the default strategy) on 2 gloo ranks, and
consolidates (verification on, the default). Then the consolidated model against
the directory it started from:

- the same tensor names, shapes and dtypes in its safetensors, and the same tie; the names
  are also those transformers' ``save_pretrained`` writes back for the loaded model;
- the same config, but for what training changes; the tokenizer (vocabulary,
  special tokens, template) and the generation config as they were;
- its logits after ``from_pretrained`` equal, exactly (tolerance 0, in the output's
  dtype), those of the trained weights read independently of our consolidator: the
  last DCP checkpoint through torch's own ``dcp_to_torch_save``, loaded strictly into
  the class transformers builds from the original ``config.json``;
- ``generate()`` runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest

from fsdp_workflow.data.templates import SHIPPED_TEMPLATES
from tests.data.test_families import TEMPLATES

from .conftest import FamilyRun, group
from .replicas import FAMILIES, Replica

pytestmark = [pytest.mark.slow]  # each row's tests in its run's xdist group (conftest.group), with test_moe_experts

# What may differ in config.json as transformers reads it: where it was loaded from, and which release wrote it.
CONFIG_CHANGES = frozenset({"_name_or_path", "transformers_version"})
ATTENTION = "eager"  # one implementation every family has, for both sides of the logits comparison


@pytest.fixture(scope="module", params=[pytest.param(r, id=r.key, marks=pytest.mark.xdist_group(group(r))) for r in FAMILIES])
def family_run(request: pytest.FixtureRequest, family_runs: Callable[[Replica], FamilyRun]) -> FamilyRun:
    return family_runs(request.param)


def _layout(directory: Path) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Every tensor of a model directory's safetensors: name -> (shape, dtype), as other tools read them."""
    from safetensors import safe_open

    out: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _differences(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, Any]:
    """What differs between two name -> value maps, named briefly for a failure message."""
    return {"only in the consolidated model": sorted(set(got) - set(want)),
            "only in the directory": sorted(set(want) - set(got)),
            "different": {k: (got[k], want[k]) for k in set(got) & set(want) if got[k] != want[k]}}


def test_same_tensor_names_shapes_and_tie(family_run: FamilyRun) -> None:
    got, want = _layout(family_run.out), _layout(family_run.base)
    shapes, want_shapes = {k: s for k, (s, _) in got.items()}, {k: s for k, (s, _) in want.items()}
    assert shapes == want_shapes, _differences(shapes, want_shapes)
    tied = json.loads((family_run.out / "config.json").read_text())["tie_word_embeddings"]
    assert tied is family_run.row.tied
    assert ("lm_head.weight" in got) is not family_run.row.tied  # tied: one tensor for both, as transformers writes
    report = json.loads((family_run.out / "verification.json").read_text())
    assert report["ok"] and report["from_pretrained"]["ok"], report
    tie = {"dropped": "lm_head.weight", "kept": "model.embed_tokens.weight", "identical": True}
    assert report.get("tied_lm_head") == (tie if family_run.row.tied else None), report


def test_save_pretrained_writes_back_the_same_names(family_run: FamilyRun, tmp_path: Path) -> None:
    """The consolidated names are the ones transformers itself writes back for the model it loads from them.

    Issue 49: the consolidated Granite-MoE held the in-memory ``experts.gate_up_proj`` and
    ``router.weight``; transformers loaded them, but its ``save_pretrained`` (like the directory)
    has ``input_linear.weight`` and ``router.layer.weight``. Names and shapes, per family.
    """
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(family_run.out)).save_pretrained(str(tmp_path))
    got = {k: s for k, (s, _) in _layout(family_run.out).items()}
    again = {k: s for k, (s, _) in _layout(tmp_path).items()}
    assert got == again, _differences(got, again)


def test_same_dtype_as_the_directory(family_run: FamilyRun) -> None:
    got, want = _layout(family_run.out), _layout(family_run.base)
    assert {d for _, d in got.values()} == {d for _, d in want.values()}
    config = json.loads((family_run.out / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == family_run.row.dtype


def test_config_kept_but_for_what_training_changes(family_run: FamilyRun) -> None:
    from transformers import AutoConfig

    got = AutoConfig.from_pretrained(str(family_run.out)).to_dict()
    want = AutoConfig.from_pretrained(str(family_run.base)).to_dict()
    changed = {k: (want.get(k), got.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    assert set(changed) <= CONFIG_CHANGES, changed


def test_tokenizer_and_generation_config_as_they_were(family_run: FamilyRun) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    def gen(d: Path) -> Dict[str, Any]:
        return {k: v for k, v in GenerationConfig.from_pretrained(str(d)).to_dict().items()
                if k != "transformers_version"}

    assert (family_run.out / "generation_config.json").is_file()
    assert gen(family_run.out) == gen(family_run.base)
    got, want = AutoTokenizer.from_pretrained(str(family_run.out)), AutoTokenizer.from_pretrained(str(family_run.base))
    assert (family_run.out / "tokenizer.json").is_file() and (family_run.out / "tokenizer_config.json").is_file()
    assert got.get_vocab() == want.get_vocab()
    assert got.special_tokens_map == want.special_tokens_map
    if family_run.row.chat:
        assert got.chat_template == (TEMPLATES / family_run.row.template_file).read_text()
    else:  # a base model ships the template it was trained on: smoke_chat's fallback
        assert got.chat_template == SHIPPED_TEMPLATES["chatml"] and want.chat_template is None


def test_the_data_was_rendered_by_the_family_template(family_run: FamilyRun) -> None:
    """The prepare step used the directory's own template (or the one named for a base model)."""
    pointer = json.loads((family_run.run_dir / "data.json").read_text())
    meta = json.loads((Path(pointer["cache"]) / "meta.json").read_text())
    row = family_run.row
    want = (TEMPLATES / row.template_file).read_text() if row.chat else SHIPPED_TEMPLATES["chatml"]
    assert meta["chat_template"] == want
    assert meta["splits"]["train"]["trained_tokens"] > 0


def test_the_card_names_the_template_that_trained_and_ships(family_run: FamilyRun) -> None:
    """The model card's row: the family's own template, or the fallback a base model trained (and ships) on."""
    card = (family_run.out / "README.md").read_text()
    want = (f"| chat template | the base model's own ({family_run.base})" if family_run.row.chat else
            "| chat template | `chatml` (`data.fallback_chat_template`: the tokenizer has none of its own)")
    assert want in card, card


def test_the_run_trained_every_step(family_run: FamilyRun) -> None:
    """Both steps logged with a finite loss over trained tokens; a MoE family's router loss beside it."""
    records = [json.loads(line) for line in (family_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    for r in steps:
        assert math.isfinite(r["loss"]) and r["trained_tokens"] > 0, r
        if family_run.row.experts:
            assert math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0, r
        else:
            assert "aux_loss" not in r, r


def _prompt(tokenizer: Any, row: Replica) -> Any:
    # Every template accepts user/assistant turns; the one refusing system turns (Gemma 2) gets none.
    conv = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And times 3?"}]
    template = None if row.chat else SHIPPED_TEMPLATES["chatml"]
    return tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                         chat_template=template)["input_ids"]


def test_logits_equal_the_trained_weights(family_run: FamilyRun) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = AutoModelForCausalLM.from_pretrained(str(family_run.out), attn_implementation=ATTENTION).eval()
    config = AutoConfig.from_pretrained(str(family_run.base), attn_implementation=ATTENTION)
    # Built in the output's dtype, as from_pretrained builds it (rotary tables stay fp32); the trained
    # fp32 weights are rounded into it by load_state_dict's copy, as torch rounds.
    ref = AutoModelForCausalLM.from_config(config, dtype=out.dtype).eval()
    missing, unexpected = ref.load_state_dict(family_run.trained_weights(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or family_run.row.tied)
    ref.tie_weights()
    base = AutoModelForCausalLM.from_pretrained(str(family_run.base), attn_implementation=ATTENTION,
                                                dtype=out.dtype).eval()
    ids = _prompt(AutoTokenizer.from_pretrained(str(family_run.base)), family_run.row)
    with torch.no_grad():
        got, want, before = out(input_ids=ids).logits, ref(input_ids=ids).logits, base(input_ids=ids).logits
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(got, before)  # the run trained: the reference is not the starting point


def test_generate_runs(family_run: FamilyRun) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(family_run.out)).eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is family_run.row.tied
    ids = _prompt(AutoTokenizer.from_pretrained(str(family_run.out)), family_run.row)
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False)
    assert new.shape == (1, ids.shape[1] + 4) and torch.equal(new[:, : ids.shape[1]], ids)
