"""The trainer's held-out samples and token loss, for measuring a model outside the training loop.

The evaluation stage (:mod:`fsdp_workflow.evaluate`) measures each consolidated checkpoint
on the very tokens the trainer evaluates on, with the very loss it trains with, so its
numbers line up with ``eval_loss`` in ``metrics.jsonl``. This module is what it uses of the
trainer, so the trainer's data pipeline (:mod:`.data`) and loss (:mod:`.loss`) can
change inside ``train/`` without another stage noticing.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_workflow.config.schema import WorkflowConfig

from .data import DataError, SampleSource, open_sources, pad_token_id
from .loss import IGNORE_INDEX, loss_sum

__all__ = ["DataError", "IGNORE_INDEX", "SampleSource", "held_out_samples", "token_loss_sum"]


def held_out_samples(cfg: WorkflowConfig) -> Optional[SampleSource]:
    """The run's held-out split, in the order the trainer evaluates it (seed ``data.seed + 1``).

    Args:
        cfg: the run's config (its data cache, tokenizer, ``train.seq_len``).

    Returns:
        The packed held-out samples (input ids, labels with ``-100`` where no loss, position
        ids restarting at each document); None when the run keeps no held-out data
        (``data.eval_path`` / ``data.eval_fraction`` unset).

    Raises:
        DataError: the run's data was never prepared, or was packed for another
            ``seq_len``; the message names the command that prepares it.
    """
    from fsdp_workflow.data.tokenizer import load_tokenizer

    _, held = open_sources(cfg, pad_token_id(load_tokenizer(cfg.model)))
    return held


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss, summed: position ``t`` predicts ``labels[t + 1]``; ``-100`` targets are skipped.

    Args:
        logits: ``[batch, seq, vocab]``.
        labels: ``[batch, seq]``, aligned with the input ids (the shift happens here).

    Returns:
        A float32 scalar (divide by the trained-token count for the mean).
    """
    return loss_sum(logits, labels)
