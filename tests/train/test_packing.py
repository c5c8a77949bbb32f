"""The trainer's forward on packed samples: documents stay apart, -100 labels carry nothing, sums never NaN."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_workflow.config.load import compose
from fsdp_workflow.train.data import CacheSource, RankBatches
from fsdp_workflow.train.loop import forward
from fsdp_workflow.train.loss import install_chunked_loss_forward, install_logits_loss_forward, install_loss_forward
from fsdp_workflow.train.model import build_model
from tests.train.caches import build_cache

A = [5, 66, 71, 12, 90, 33, 7]  # the document under test
B = [100, 101, 102, 103, 104]  # its neighbour ...
B2 = [200, 17, 3]  # ... replaced by another one, of another length


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    cfg = compose(["+experiment=smoke"])
    model = build_model(cfg.model, seed=0)
    model.eval()
    return model


def _logits(model: torch.nn.Module, ids: list, positions: list) -> torch.Tensor:
    """Logits through the call the trainer's forward makes: position ids, no mask, no cache."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=False).logits[0]


def test_a_documents_logits_ignore_its_packed_neighbour(tiny: torch.nn.Module) -> None:
    alone = _logits(tiny, A, list(range(len(A))))
    for neighbour in (B, B2):
        ids = neighbour + A
        packed = _logits(tiny, ids, list(range(len(neighbour))) + list(range(len(A))))
        torch.testing.assert_close(packed[len(neighbour):], alone, rtol=1e-5, atol=1e-5)
    # The control: positions that do not restart let A attend to its neighbour.
    leaky = _logits(tiny, B + A, list(range(len(B) + len(A))))
    assert not torch.allclose(leaky[len(B):], alone, atol=1e-3)


def _batch_from_cache(tmp_path: Path, docs: list, seq_len: int = 16, trained: list = ()) -> object:
    cache = build_cache(tmp_path, docs, seq_len=seq_len, trained=trained)
    return RankBatches(CacheSource(cache.split("train"), seed=0), 1, 0, 1).next()


def test_the_loss_of_a_document_ignores_its_neighbour(tiny: torch.nn.Module, tmp_path: Path) -> None:
    """Through the cache, the batch and the installed forward: only A trained, B or B2 beside it."""
    model = copy.deepcopy(tiny)
    install_loss_forward(model)
    losses = []
    for i, neighbour in enumerate((B, B2)):
        batch = _batch_from_cache(tmp_path / f"c{i}", [neighbour, A],
                                  trained=[[False] * len(neighbour), [True] * len(A)])
        n = len(neighbour)
        assert batch.position_ids[0, : n + len(A)].tolist() == list(range(n)) + list(range(len(A)))
        with torch.no_grad():
            losses.append(forward(model, batch).ce)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    # ... and equals A's loss computed alone (its first token predicts nothing).
    logits = _logits(tiny, A, list(range(len(A))))
    torch.testing.assert_close(losses[0], F.cross_entropy(logits[:-1], torch.tensor(A[1:]), reduction="sum"),
                               rtol=1e-5, atol=1e-5)


def _grads(model: torch.nn.Module) -> list:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("chunk_tokens", [8192, 5])  # one chunk; several, recomputed in backward
def test_an_all_masked_micro_batch_is_a_zero_loss_with_zero_gradients(tiny: torch.nn.Module, chunk_tokens: int) -> None:
    model = copy.deepcopy(tiny)
    model.train()
    install_chunked_loss_forward(model, chunk_tokens=chunk_tokens)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=torch.full_like(ids, -100), position_ids=torch.arange(12).expand(2, 12)).ce
    assert torch.isfinite(loss) and loss.item() == 0.0 and loss.requires_grad
    loss.backward()  # a graph: FSDP's gradient reduction on every rank still runs
    assert all(torch.count_nonzero(g) == 0 for g in _grads(model))


def test_masked_tokens_contribute_nothing(tiny: torch.nn.Module) -> None:
    """Loss and gradients equal those of the trained tokens alone, on both forward paths."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    positions = torch.arange(12).expand(2, 12)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt
    labels[1, :] = -100  # a row with nothing trained
    with torch.no_grad():
        logits = tiny(input_ids=ids, position_ids=positions, use_cache=False).logits
    expected = F.cross_entropy(logits[0, 6:-1], ids[0, 7:], reduction="sum")

    results = []
    for install in (lambda m: install_chunked_loss_forward(m, chunk_tokens=4), install_logits_loss_forward):
        model = copy.deepcopy(tiny)
        install(model)
        loss = model(input_ids=ids, labels=labels, position_ids=positions).ce
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
        results.append(_grads(model))
    # The gradient of the same loss written by hand over the trained tokens only.
    ref = copy.deepcopy(tiny)
    out = ref(input_ids=ids[:1], position_ids=positions[:1], use_cache=False).logits
    F.cross_entropy(out[0, 6:-1], ids[0, 7:], reduction="sum").backward()
    for got in results:
        for g, r in zip(got, _grads(ref)):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_synthetic_batches_train_every_position(tiny: torch.nn.Module) -> None:
    from fsdp_workflow.train.data import SyntheticSource

    model = copy.deepcopy(tiny)
    install_loss_forward(model)
    batch = RankBatches(SyntheticSource(10, seed=0, vocab_size=256), 2, 0, 1).next()
    with torch.no_grad():
        loss = forward(model, batch).ce
        logits = tiny(input_ids=batch.input_ids, use_cache=False).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch.input_ids[:, 1:].reshape(-1),
                               reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    assert np.isfinite(loss.item())


def test_the_step_gradient_weighs_every_trained_token_the_same(tiny: torch.nn.Module) -> None:
    """Two micro-batches with 10 and 1 trained tokens: the step's gradient is the mean over all 11 tokens."""
    from fsdp_workflow.train.data import Batch
    from fsdp_workflow.train.loop import loss_scale

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :2] = -100  # 10 trained targets
    labels[1, :11] = -100  # 1 trained target
    micro = [Batch(ids[i:i + 1], labels[i:i + 1], torch.arange(12).view(1, 12)) for i in range(2)]
    model = copy.deepcopy(tiny)
    install_loss_forward(model)
    scale = loss_scale(sum(int(b.num_trained()) for b in micro), world=1, grad_accum=2)
    for b in micro:
        (forward(model, b).ce * scale / 2).backward()  # what accelerator.backward does with grad_accum=2
    ref = copy.deepcopy(tiny)
    install_loss_forward(ref)
    (forward(ref, Batch(ids, labels, torch.arange(12).expand(2, 12))).ce / 11).backward()
    for g, r in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)
