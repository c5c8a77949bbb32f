"""Mean token loss and perplexity of a consolidated model on the run's held-out split.

The held-out samples are the ones the trainer evaluates, read through the trainer's public
face for this (:mod:`fsdp_workflow.train.heldout`): the ``eval`` split of the prepared token
cache, packed documents with their labels and position ids. Only trained tokens count
(prompt tokens, document starts and padding carry label -100), and attention stays inside
each document, as in training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, TypedDict

from fsdp_workflow.config.schema import WorkflowConfig

MAX_EVAL_SAMPLES = 64  # held-out packed samples per evaluation, at most
_MAX_EXP = 700.0  # exp() of more overflows a float; such a loss means "diverged" anyway


class Measured(TypedDict):
    """What one model scored on the held-out samples."""

    loss: float  # mean loss per trained token
    perplexity: float  # exp(loss)
    num_tokens: int  # trained tokens measured


def perplexity(model_dir: Path, cfg: WorkflowConfig) -> Optional[Measured]:
    """Loss per trained token, perplexity and trained-token count on up to :data:`MAX_EVAL_SAMPLES` samples.

    Args:
        model_dir: a consolidated Hugging Face model directory.
        cfg: the run's config (its data cache and tokenizer).

    Returns:
        None when the run has no held-out data (``data.eval_path`` / ``data.eval_fraction``),
        or when the held-out samples carry no trained token.

    Raises:
        DataError: the run's data was never prepared (the message names the command).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_workflow.train.heldout import IGNORE_INDEX, held_out_samples, token_loss_sum

    held = held_out_samples(cfg)
    if held is None:
        return None
    n = min(getattr(held, "num_samples", None) or MAX_EVAL_SAMPLES, MAX_EVAL_SAMPLES)
    # bf16: the eval job's memory is sized for it (config.rules_env.eval_job_mem_gb)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            s = held.sample(i)
            ids, labels, positions = (torch.from_numpy(a).unsqueeze(0) for a in (s.input_ids, s.labels, s.position_ids))
            # No attention mask and no cache: transformers then reads the document
            # boundaries from the restarting position ids.
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            total += token_loss_sum(logits, labels).item()
            count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    if count == 0:
        return None
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, _MAX_EXP)), "num_tokens": count}
