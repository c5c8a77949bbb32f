"""Losses, gradients and backward matmuls under each activation-checkpointing mode (a test helper).

    torchrun --nproc_per_node 2 tests/train/ac_equivalence.py OUT.pt OVERRIDE...   (by hand)

The test runs :func:`main` on 2 ranks forked from a preloaded server (tests/forked_ranks.py).

For each mode of ``strategy.activation_checkpointing`` the ranks build the tiny
Llama through the trainer's own :func:`fsdp_workflow.train.strategies.prepare`
(FSDP2 over the 2 gloo ranks, the mode applied from the composed config), run
``STEPS`` optimizer steps on fixed per-rank batches, and record the summed loss
(all ranks), every parameter's full gradient (``full_tensor``) and how many
``aten.mm`` calls the first backward made. Rank 0 saves ``{mode: record}`` to
``OUT.pt`` for ``tests/train/test_activation_checkpointing.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.schema import ActivationCheckpointing
from fsdp_workflow.train import model as model_lib
from fsdp_workflow.train import strategies
from fsdp_workflow.train.loss import install_loss_forward

STEPS = 3
SEQ = 32


class MatmulCounter(TorchDispatchMode):
    """Counts ``aten.mm`` calls (the linear layers' matmuls) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def run_mode(accelerator: Any, overrides: list[str], mode: ActivationCheckpointing) -> dict[str, Any]:
    cfg = compose([*overrides, f"strategy.activation_checkpointing={mode.value}"])
    prepared = strategies.prepare(
        accelerator, cfg,
        lambda meta: model_lib.build_model(cfg.model, seed=cfg.train.seed, meta=meta),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        install_loss_forward,
    )
    model, opt = prepared.model, prepared.optimizer
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batches, the same in every mode
    record: dict[str, Any] = {"losses": [], "grads": [], "layers": prepared.checkpointed_layers}
    for step in range(STEPS):
        ids = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids.clone(), position_ids=torch.arange(SEQ).expand(2, SEQ)).ce
        counter = MatmulCounter()
        with counter:
            loss.backward()
        if step == 0:
            record["backward_mm"] = counter.count
        total = loss.detach().clone()
        dist.all_reduce(total)
        record["losses"].append(total.item())
        record["grads"].append({
            name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor().clone()
            for name, p in model.named_parameters()
        })
        opt.step()
        opt.zero_grad(set_to_none=True)
    return record


def main(out: str, overrides: list[str]) -> None:
    dist.init_process_group("gloo")
    from accelerate import Accelerator

    accelerator = Accelerator()
    results = {mode.value: run_mode(accelerator, overrides, mode) for mode in ActivationCheckpointing}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
