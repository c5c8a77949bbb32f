"""Mean token loss and perplexity of a consolidated model on the run's held-out split."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Optional

from fsdp_workflow.config.schema import WorkflowConfig

MAX_EVAL_BLOCKS = 64  # held-out sequences per evaluation, at most


def perplexity(model_dir: Path, cfg: WorkflowConfig) -> Optional[Dict[str, float]]:
    """Loss, perplexity and token count on up to :data:`MAX_EVAL_BLOCKS` held-out sequences.

    Returns:
        None when the run has no held-out data (``data.eval_path`` / ``data.eval_fraction``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_workflow.train.data import build_sources
    from fsdp_workflow.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    _, held = build_sources(cfg.data, tokenizer, cfg.train.seq_len, cfg.model.vocab_size)
    if held is None:
        return None
    n = min(held.num_blocks or MAX_EVAL_BLOCKS, MAX_EVAL_BLOCKS)
    # bf16: the eval job's memory is sized for it (config.rules_env.eval_job_mem_gb)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            ids = held.sample(i).unsqueeze(0)
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.numel() - 1)
            count += ids.numel() - 1
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "num_tokens": count}
