"""Our loss forward equals each family's own loss (transformers' ``model(input_ids, labels=...)``).

For a tiny random replica of every family in the chunked route's table
(``fsdp_workflow.train.loss.CHUNKED_MODEL_TYPES``: the test and the table cannot
disagree), our installed forward's cross-entropy sum over the trained tokens, divided
by their number, equals the loss the family's own forward computes, with the family's
logit processing (Gemma's soft-capping, Granite's scaling, Cohere's scale), to
``TOL``. The configs make that processing bite (a small cap, a large init) and the
test checks that leaving it out would miss by far more than ``TOL``. For MoE families
the router's load-balancing loss equals the family's ``aux_loss``, and ce + coef * aux
its ``labels=`` loss with ``output_router_logits=True``. One document per row (the
packed position ids restarting at 0 are ours: tests/train/test_packing.py). One
process, a few seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_workflow.train.loop import loss_scale, micro_batch_loss
from fsdp_workflow.train.loss import (
    CHUNKED_MODEL_TYPES,
    LogitRule,
    LossConfigError,
    install_chunked_loss_forward,
    install_loss_forward,
    loss_sum,
    router_aux_coef,
)

# fp32 throughout; our sum/N against transformers' mean, several chunks against one logits tensor.
TOL = 1e-5  # measured: at most 1e-6 on every family
VOCAB, SEQ = 128, 24
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)
# Per family: config fields beyond SHAPE, and the attention implementation it runs with.
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "llama": ({}, "sdpa"),
    "mistral": ({"sliding_window": 16}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "qwen3": ({}, "sdpa"),
    "phi3": ({}, "sdpa"),
    "olmo2": ({}, "sdpa"),
    "gemma": ({}, "sdpa"),
    "gemma2": ({"final_logit_softcapping": 2.0}, "eager"),  # transformers 5.24: no sdpa for Gemma 2
    "gemma3_text": ({"final_logit_softcapping": 2.0, "sliding_window": 8}, "sdpa"),
    "granite": ({"logits_scaling": 4.0}, "sdpa"),
    "cohere": ({"logit_scale": 0.25}, "sdpa"),
    "cohere2": ({"logit_scale": 0.25, "sliding_window": 8}, "sdpa"),
    "mixtral": ({**MOE, "num_local_experts": 4}, "sdpa"),
    "qwen2_moe": ({**MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
                  "sdpa"),
    "qwen3_moe": ({**MOE, "num_experts": 4, "moe_intermediate_size": 32}, "sdpa"),
    "olmoe": ({**MOE, "num_experts": 4}, "sdpa"),
    "granitemoe": ({**MOE, "num_local_experts": 4, "logits_scaling": 4.0}, "sdpa"),
}


def tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, attn = FAMILIES[model_type]
    config = AutoConfig.for_model(model_type, **SHAPE, **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()  # eval: no dropout on either side


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two documents, one per row; the first row's prompt untrained."""
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :7] = -100
    return ids, labels, torch.arange(SEQ).expand(2, SEQ)


def test_the_table_is_the_tested_families() -> None:
    assert set(FAMILIES) == set(CHUNKED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_our_loss_is_the_family_loss(model_type: str) -> None:
    model = tiny(model_type)
    ids, labels, positions = batch()
    trained = int((labels[:, 1:] != -100).sum())
    moe = hasattr(model.config, "router_aux_loss_coef")
    with torch.no_grad():
        theirs = model(input_ids=ids, labels=labels, output_router_logits=False) if moe else \
            model(input_ids=ids, labels=labels)
        raw = torch.nn.functional.linear(model.model(input_ids=ids).last_hidden_state, model.lm_head.weight)
        assert install_loss_forward(model) == "chunked"
        ours = model(input_ids=ids, labels=labels, position_ids=positions)
    assert ours.aux is None  # no router loss asked for
    assert abs(ours.ce.item() / trained - theirs.loss.item()) < TOL, (ours.ce.item() / trained, theirs.loss.item())
    rule = LogitRule.of(model.config)
    if rule != LogitRule():  # the family's processing matters here: leaving it out would fail the test
        assert abs(loss_sum(raw, labels).item() / trained - theirs.loss.item()) > 100 * TOL


MOE_FAMILIES = sorted(t for t in FAMILIES if "router_aux_loss_coef" in FAMILIES[t][0])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_the_router_loss_trains_the_family_objective(model_type: str) -> None:
    """The router loss equals the family's ``aux_loss``; the loop's micro-batch loss
    (``micro_batch_loss``: ce * loss_scale + coef * aux, one micro-batch on one rank) has the
    gradient of transformers' own ``labels=`` loss with ``output_router_logits=True``, in every
    parameter; and the router term moves the router's gradient (dropping it would fail this)."""
    ids, labels, positions = batch()
    trained = int((labels[:, 1:] != -100).sum())
    ref = tiny(model_type)
    theirs = ref(input_ids=ids, labels=labels, output_router_logits=True)
    theirs.loss.backward()
    coef = router_aux_coef(None, ref.config)
    model = tiny(model_type)
    assert install_loss_forward(model, router_loss=True) == "chunked"
    ours = model(input_ids=ids, labels=labels, position_ids=positions)
    assert coef == 0.02 and ours.aux is not None and ours.aux.item() > 0
    assert abs(ours.aux.item() - theirs.aux_loss.item()) < TOL
    micro_batch_loss(ours, loss_scale(trained, world=1, grad_accum=1), coef).backward()
    want, got = _grads(ref), _grads(model)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    ce_only = tiny(model_type)
    install_loss_forward(ce_only)
    (ce_only(input_ids=ids, labels=labels, position_ids=positions).ce / trained).backward()
    router = [n for n in want if n.endswith((".gate.weight", ".router.weight"))]  # not shared_expert_gate
    assert router and all((_grads(ce_only)[n] - got[n]).abs().max() > 1e-4 for n in router)


def test_chunks_sum_to_the_whole() -> None:
    """Several chunks (7 positions each, recomputed in backward on long sequences) give the one-chunk sum."""
    ids, labels, positions = batch()
    whole, chunked = tiny("qwen3_moe"), tiny("qwen3_moe")
    install_loss_forward(whole)
    install_chunked_loss_forward(chunked, chunk_tokens=7)
    with torch.no_grad():
        one = whole(input_ids=ids, labels=labels, position_ids=positions).ce
        many = chunked(input_ids=ids, labels=labels, position_ids=positions).ce
    assert abs(one.item() - many.item()) < TOL * int((labels[:, 1:] != -100).sum())


def test_a_family_outside_the_table_takes_its_own_forward() -> None:
    """GPT-2 (learned positions, a ``transformer`` backbone) is not in the table: the logits route, still exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()
    ids, labels, positions = batch()
    with torch.no_grad():
        theirs = model(input_ids=ids, labels=labels).loss
        assert install_loss_forward(model) == "logits"
        ours = model(input_ids=ids, labels=labels, position_ids=positions)
    assert abs(ours.ce.item() / int((labels[:, 1:] != -100).sum()) - theirs.item()) < TOL


def test_router_aux_coef_rules() -> None:
    """None: the model's own; 0: off; a value: that value; refused below 0 or on a model without a router loss."""
    from transformers import AutoConfig

    moe = AutoConfig.for_model("qwen3_moe", router_aux_loss_coef=0.003)
    dense = AutoConfig.for_model("llama")
    assert router_aux_coef(None, moe) == 0.003 and router_aux_coef(0, moe) == 0 and router_aux_coef(0.1, moe) == 0.1
    assert router_aux_coef(None, dense) == 0 and router_aux_coef(0, dense) == 0
    with pytest.raises(LossConfigError, match=r"model.router_aux_loss_coef=0.1, but llama has no router"):
        router_aux_coef(0.1, dense)
    with pytest.raises(LossConfigError, match=r"model.router_aux_loss_coef=-1.0: a coefficient is >= 0"):
        router_aux_coef(-1.0, moe)


def test_bf16_fsdp2_returns_the_loss_sums_in_fp32() -> None:
    """Under ``train.mixed_precision=bf16`` our FSDP2 path casts layer outputs to bf16, but not the
    root's: the installed forward's fp32 sums come back as fp32 (in bf16 a sum over many tokens keeps
    8 bits, up to 0.4% off in the logged loss and the gradient's scale). One gloo rank, in process."""
    import torch.distributed as dist

    from fsdp_workflow.config.load import compose
    from fsdp_workflow.train import model as model_lib
    from fsdp_workflow.train.parallel import ShardOptions, apply_fully_shard

    cfg = compose(["+experiment=smoke", "train.mixed_precision=bf16"])
    model = model_lib.build_model(cfg.model, seed=0)
    install_loss_forward(model)
    ids = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        apply_fully_shard(model, ShardOptions.of(cfg), torch.device("cpu"))
        out = model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ).expand(2, SEQ))
    finally:
        dist.destroy_process_group()
    assert out.ce.dtype == torch.float32 and out.ce.item() != out.ce.bfloat16().float().item()  # more than 8 bits
