"""Logits of a run's checkpoint on its own mesh, computed by the ranks themselves (a test helper).

    torchrun --nproc_per_node 4 tests/train/tp_logits.py RUN_DIR STEP OUT.pt

Builds the model exactly as the trainer does (the config's mesh: tensor
parallel, then FSDP2), loads ``checkpoints/step-STEP`` through the trainer's
checkpointer and runs the model's own forward (logits, not the installed loss)
on a fixed input; rank 0 saves them to ``OUT.pt`` (a plain tensor file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train.checkpoint import CheckpointDir
from fsdp_workflow.train.checkpointers import make_checkpointer
from fsdp_workflow.train.data import RankBatches, SyntheticSource
from fsdp_workflow.train.loop import Ranks, build_trainee
from fsdp_workflow.train.state import StepRng, trainer_parts

FIXED_INPUT = (torch.arange(48).view(2, 24) * 7) % 260  # two sequences, every rank the same


def main(run_dir: str, step: int, out: str) -> None:
    run = RunDir.of(Path(run_dir).resolve())
    cfg = load_run_config(run.root)
    ranks = Ranks.start(cfg, run)
    trainee = build_trainee(cfg, ranks)
    rng = StepRng(cfg.train.seed, ranks.mesh.dp_rank)
    batches = RankBatches(SyntheticSource(cfg.train.seq_len, 0, 260), 1, ranks.mesh.dp_rank, ranks.mesh.dp_size)
    parts = trainer_parts(trainee.prepared.model, trainee.prepared.torch_optimizer, trainee.scheduler, rng, batches)
    checkpointer = make_checkpointer(CheckpointDir(run, 0, ranks.rank), cfg.checkpoint, trainee.prepared,
                                     cfg.cluster.rdzv_timeout_s)
    checkpointer.load(run.step_dir(step), parts)
    model = trainee.prepared.model
    del model.forward  # the installed loss forward is an instance attribute: back to the class's (logits)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=FIXED_INPUT, use_cache=False).logits
    if ranks.rank == 0:
        torch.save({"logits": logits.detach().clone(), "input_ids": FIXED_INPUT, "step": rng.step}, out)
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
