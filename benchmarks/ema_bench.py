"""Step-time overhead of the EMA of the weights (``train.ema_decay``), measured in one process on CPU.

    python benchmarks/ema_bench.py --shape small
    python benchmarks/ema_bench.py --shape wide --tokens 512,1024

Each run builds a random fp32 Llama, times full training steps (forward and backward over
``T`` tokens, AdamW step) for each ``T`` of ``--tokens``, then times the EMA update
(:meth:`fsdp_workflow.train.ema.EmaState.after_optimizer_step`, one fused lerp over every
parameter) on the same model, and prints JSON with the overhead ``ema_s / step_s``.

One process holds every parameter, so this is the worst case: under FSDP2 each rank
averages 1/N of the parameters while its step still computes a whole micro-batch.
A step costs about ``a * T + b`` (``b``: the optimizer) and the EMA a constant, both
proportional to the parameter count, so the overhead depends on the tokens per step and
hardly on the depth. ``wide`` keeps the 0.85B benchmark's widths (hidden 2048,
intermediate 5632, vocab 32000, 32/4 heads) with 4 layers instead of 16 to fit this
machine; with two ``--tokens`` values the fit ``a * T + b`` gives the step at the
benchmark's 8192 tokens (sequence 2048 x micro-batch 4) and the overhead there. In any
case the overhead at the most tokens measured bounds the one at 8192 tokens from above.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "small": dict(hidden=256, layers=4, vocab=32000, heads=8, kv_heads=4, intermediate=688),
    "wide": dict(hidden=2048, layers=4, vocab=32000, heads=32, kv_heads=4, intermediate=5632),
}
BENCH_TOKENS = 2048 * 4  # benchmarks/train_throughput.py: sequence 2048 x micro-batch 4


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--tokens", default="512", help="tokens per step (one sequence), comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per token count (after one warm-up)")
    ap.add_argument("--ema-repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_workflow.train.ema import EmaState

    if args.threads:
        torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=4096, tie_word_embeddings=False))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ema = EmaState(model, decay=0.999)

    def train_step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = {}
    for t in [int(x) for x in args.tokens.split(",")]:
        ids = torch.randint(0, s["vocab"], (1, t))
        train_step(ids)  # warm-up: optimizer state, allocator
        steps[t] = median_time(lambda: train_step(ids), args.steps)
    ema_s = median_time(lambda: ema.after_optimizer_step(10), args.ema_repeat)
    out = {"shape": args.shape, **s, "params": params, "threads": torch.get_num_threads(), "ema_update_s": ema_s,
           "per_tokens": {t: {"step_s": v, "overhead_pct": 100 * ema_s / v} for t, v in steps.items()}}
    if len(steps) >= 2:
        (t1, s1), (t2, s2) = sorted(steps.items())[:2]
        a = (s2 - s1) / (t2 - t1)
        if a <= 0:
            # A shared machine can make the longer step the faster one; the overhead at the
            # most tokens measured still bounds the one at 8192 from above.
            out["fit"] = {"unusable": f"the step at {t2} tokens was not slower than at {t1} (a noisy machine)"}
        else:
            step_at_bench = s1 + a * (BENCH_TOKENS - t1)
            out["fit"] = {"s_per_token": a, "s_fixed": s1 - a * t1, "step_s_at_8192_tokens": step_at_bench,
                          "overhead_pct_at_8192_tokens": 100 * ema_s / step_at_bench}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
