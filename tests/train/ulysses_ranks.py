"""The per-rank side of tests/train/test_ulysses_exact.py: real gloo ranks, the trainer's own pieces.

:func:`run` starts ``world`` processes (tests/forked_ranks.py), each joins a
gloo group and, for every case, builds a family's tiny replica (tests/families/replicas.py
rows: the config, at the replica shape, random weights from one seed) twice:

* the **reference** (cp = 1): the bare model with SDPA and the trainer's loss forward,
  each data-parallel rank's micro-batch of whole packed samples in its own forward, as
  cp = 1 trains them; the loss of the step and every parameter's gradient;
* the **run**: the trainer's mesh (:class:`~fsdp_workflow.train.mesh.TrainMesh`), its
  forward (:func:`~fsdp_workflow.train.loop.install_forward`: the loss forward and the
  Ulysses attention), FSDP2 over ``dp_shard x cp`` (:func:`~fsdp_workflow.train.parallel.apply_fully_shard`,
  tensor parallelism first when the case has ``tp``), the data loader's slices
  (:class:`~fsdp_workflow.train.data.RankBatches`) and the loop's loss scale; one
  backward, and the gradients gathered (``full_tensor``).

Rank 0 writes ``OUT/results.json``: per case, the step loss of both and the largest
gradient difference. The samples pack several documents (position ids restarting,
the first token of each untrained, a padded tail), one of them across the cut between
cp slices. ``docs_alone``: the packed sample's summed loss under cp equals the sum of its
documents' losses each run alone at cp = 1 (the isolation mask intact).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SEQ = 64
DOCS = (20, 23, 13)  # a packed sample: three documents and 8 positions of padding; 20 + 23 crosses SEQ / 2
PAD_ID = 0


@dataclass(frozen=True)
class Case:
    """One comparison: a family (tests/families key) on a mesh."""

    family: str
    dp_shard: int
    cp: int
    tp: int = 1
    dp_replicate: int = 1
    checkpointing: bool = False  # activation checkpointing (full) on the run: Ulysses recomputed in backward
    docs_alone: bool = False

    @property
    def name(self) -> str:
        extra = " + activation checkpointing" if self.checkpointing else ""
        rep = f"dp_replicate {self.dp_replicate} x " if self.dp_replicate > 1 else ""
        return f"{self.family} {rep}dp_shard {self.dp_shard} x cp {self.cp} x tp {self.tp}{extra}"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


class PackedSource:
    """Packed samples of :data:`DOCS` with random tokens, a pure function of the index."""

    seed = 0
    seq_len = SEQ

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def sample(self, index: int) -> Any:
        from fsdp_workflow.data.cache import IGNORE_INDEX, Sample

        g = torch.Generator().manual_seed(1000 + index)
        ids = torch.randint(1, self.vocab, (SEQ,), generator=g).numpy()
        labels, pos, at = ids.copy(), np.zeros(SEQ, dtype=np.int64), 0
        for n in DOCS:
            pos[at : at + n] = np.arange(n)
            labels[at] = IGNORE_INDEX  # nothing predicts a document's first token
            at += n
        pos[at:] = np.arange(SEQ - at)
        ids[at:], labels[at:] = PAD_ID, IGNORE_INDEX
        return Sample(ids, labels, pos)


def hf_config(family: str) -> Any:
    from transformers import AutoConfig

    from tests.families.replicas import BY_KEY, SHAPE

    row = BY_KEY[family]
    config = AutoConfig.for_model(row.model_type, **SHAPE, vocab_size=256, tie_word_embeddings=row.tied, **row.config)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    if hasattr(config, "router_aux_loss_coef"):  # large enough that a wrong router-loss gradient shows
        config.router_aux_loss_coef = 0.1
    return config


def build(family: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(family)).float()


def _loop_cfg() -> Any:
    """The two keys :func:`~fsdp_workflow.train.loop.install_forward` reads, at their defaults."""
    return SimpleNamespace(train=SimpleNamespace(compile=False), model=SimpleNamespace(router_aux_loss_coef=None))


def reference(case: Case, source: PackedSource, micro: int) -> tuple[float, dict[str, torch.Tensor], float]:
    """cp = 1: each data-parallel rank's micro-batch whole, as the loop weighs it; (loss, grads, aux coefficient)."""
    from fsdp_workflow.train.data import RankBatches
    from fsdp_workflow.train.loop import install_forward, loss_scale, micro_batch_loss
    from fsdp_workflow.train.loss import router_aux_coef

    model = build(case.family)
    install_forward(model, _loop_cfg(), None)
    coef = router_aux_coef(None, model.config)
    per_rank = [RankBatches(source, micro, r, case.dp).next() for r in range(case.dp)]
    trained = sum(int(b.num_trained()) for b in per_rank)
    total = 0.0
    for b in per_rank:  # the DP average of the gradients: each rank's loss / dp_shard
        out = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids)
        (micro_batch_loss(out, loss_scale(trained, case.dp, 1), coef) / case.dp).backward()
        total += float(out.ce.detach())
    return total / trained, {n: p.grad.detach().clone() for n, p in model.named_parameters()}, coef


def distributed(case: Case, source: PackedSource, micro: int, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The trainer's path on ``case``'s mesh: (step loss, full gradients)."""
    from fsdp_workflow.config.schema import ActivationCheckpointing, MixedPrecision
    from fsdp_workflow.train.data import RankBatches
    from fsdp_workflow.train.loop import install_forward, loss_scale, micro_batch_loss
    from fsdp_workflow.train.loss import router_aux_coef
    from fsdp_workflow.train.mesh import MeshDims, TrainMesh, apply_tensor_parallel
    from fsdp_workflow.train.parallel import ShardOptions, apply_fully_shard

    dims = MeshDims(case.dp_replicate, case.dp_shard, case.cp, case.tp)
    mesh = TrainMesh(dims, rank, "cpu")
    model = build(case.family)
    install_forward(model, _loop_cfg(), mesh.sequence_shards())
    if case.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh())
    ac = ActivationCheckpointing.full if case.checkpointing else ActivationCheckpointing.none
    options = ShardOptions(None, True, False, MixedPrecision.no, ac, 2, False)
    apply_fully_shard(model, options, torch.device("cpu"), mesh.fsdp_mesh())
    batch = RankBatches(source, micro, mesh.dp_rank, dims.dp_size, seq_shard=(mesh.cp_rank, dims.cp)).next()
    trained = torch.tensor(int(batch.num_trained()))
    dist.all_reduce(trained)
    trained = int(trained) // dims.token_copies
    out = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)
    coef = router_aux_coef(None, model.config)
    micro_batch_loss(out, loss_scale(trained, dims.grad_averaged_over, 1), coef).backward()
    ce = out.ce.detach().reshape(1)
    dist.all_reduce(ce)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                                             else p.grad).detach()
             for n, p in model.named_parameters()}
    return float(ce) / dims.token_copies / trained, grads


def docs_alone(case: Case, source: PackedSource, rank: int) -> tuple[float, float]:
    """(a packed sample's summed loss under cp, the sum of its documents' losses each alone at cp = 1)."""
    from fsdp_workflow.train.data import RankBatches
    from fsdp_workflow.train.loop import install_forward
    from fsdp_workflow.train.mesh import MeshDims, TrainMesh

    mesh = TrainMesh(MeshDims(1, 1, case.cp, 1), rank, "cpu")
    model = build(case.family)
    install_forward(model, _loop_cfg(), mesh.sequence_shards())
    with torch.no_grad():
        b = RankBatches(source, 1, 0, 1, seq_shard=(mesh.cp_rank, case.cp)).next()
        packed = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids).ce.reshape(1)
        dist.all_reduce(packed)
        if rank:
            return float(packed), float("nan")
        alone_model = build(case.family)
        install_forward(alone_model, _loop_cfg(), None)
        whole, at, alone = RankBatches(source, 1, 0, 1).next(), 0, 0.0
        for n in DOCS:
            ids, labels, pos = (t[:, at : at + n] for t in (whole.input_ids, whole.labels, whole.position_ids))
            alone += float(alone_model(input_ids=ids, labels=labels, position_ids=pos).ce)
            at += n
    return float(packed), alone


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(largest absolute gradient difference, the largest gradient element, where the difference is largest)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = max(a, key=lambda n: float((a[n] - b[n]).abs().max()))
    return float((a[worst] - b[worst]).abs().max()), max(float(g.abs().max()) for g in b.values()), worst


def _worker(cases: list[Case], out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # tests/forked_ranks.py sets them
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for case in cases:
            assert case.dp * case.cp * case.tp == world, case
            source = PackedSource(256)
            loss, grads = distributed(case, source, 1, rank)
            if rank == 0:  # the reference once (the ranks share two cores)
                ref_loss, ref_grads, coef = reference(case, source, 1)
                diff, scale, where = _max_diff(grads, ref_grads)
                results[case.name] = {"loss": loss, "reference_loss": ref_loss, "grad_max_abs_diff": diff,
                                      "grad_max_abs": scale, "worst_parameter": where, "router_aux_coef": coef,
                                      "parameters": len(grads)}
            dist.barrier()
            if case.docs_alone:
                packed, alone = docs_alone(case, source, rank)
                if rank == 0:
                    results[case.name].update(packed_sum=packed, documents_alone_sum=alone)
    finally:
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


def run(world: int, cases: list[Case], out: Path) -> dict[str, Any]:
    """Run ``cases`` on ``world`` gloo ranks forked from a preloaded server (tests/forked_ranks.py);
    rank 0's results."""
    from tests.forked_ranks import run as run_ranks

    run_ranks(_worker, (cases, str(out)), world, preload=[__name__])
    return json.loads((out / "results.json").read_text())


TWO_RANKS = [Case("llama-3.1", 1, 2, docs_alone=True), Case("qwen3-untied", 1, 2), Case("qwen3-moe", 1, 2)]
FOUR_RANKS = [Case("llama-3.1", 2, 2), Case("qwen3-untied", 2, 2, checkpointing=True), Case("qwen3-moe", 2, 2),
              Case("llama-3.1", 1, 4), Case("llama-3.1", 1, 2, tp=2), Case("qwen3-untied", 1, 2, dp_replicate=2)]


if __name__ == "__main__":  # pragma: no cover - by hand: python -m tests.train.ulysses_ranks 2|4
    import sys
    import tempfile

    n = int(sys.argv[1])
    print(json.dumps(run(n, TWO_RANKS if n == 2 else FOUR_RANKS, Path(tempfile.mkdtemp())), indent=1))
