"""Throughput of this trainer against a plain Accelerate + FSDP2 loop, in one run (GPU only, never CI).

Run on a machine with one CUDA GPU::

    python benchmarks/train_throughput.py [--steps 30] [--warmup 10] [--out DIR]

Both sides train the same randomly initialised Llama-shaped model (hidden 2048,
16 layers, vocab 32000; TinyLlama's head layout), sequence 2048, micro-batch 4,
bf16, FSDP2 through Accelerate under ``torchrun --nproc_per_node 1``, on
synthetic packed data (no padding). Each side runs in its own torchrun so they
do not share memory or compile caches. Prints tokens/s, MFU, peak memory and
the ratio; writes ``OUT/results.json``.

* plain: ``Accelerator()`` from the same environment, ``prepare(model, AdamW(fused))``,
  ``model(input_ids, labels=input_ids).loss``, ``accelerator.backward``, no compile.
* trainer: ``python -m fsdp_workflow.train`` with ``train.compile=true``: per-layer
  ``torch.compile``, chunked lm_head + cross-entropy, no autocast on top of FSDP2's
  bf16 parameters, fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden=2048, layers=16, vocab=32000, heads=32, kv_heads=4, intermediate=5632)
SEQ, MICRO_BATCH = 2048, 4


def overrides(steps: int) -> list[str]:
    return [
        "model.init=random", "model.name=bench-llama-0.8b", "model.model_type=llama",
        f"model.hidden_size={SHAPE['hidden']}", f"model.num_hidden_layers={SHAPE['layers']}",
        f"model.vocab_size={SHAPE['vocab']}", f"model.num_attention_heads={SHAPE['heads']}",
        f"model.num_key_value_heads={SHAPE['kv_heads']}", f"model.intermediate_size={SHAPE['intermediate']}",
        f"model.max_position_embeddings={SEQ}", "model.tie_word_embeddings=false",
        "data=synthetic", "strategy=fsdp2", "optimizer=adamw", "optimizer.lr=1e-4", "optimizer.warmup_steps=0",
        "cluster.device=cuda", "cluster.processes_per_node=1",
        f"train.max_steps={steps}", f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}",
        "train.mixed_precision=bf16", "train.log_every_steps=5",
        "checkpoint.every_steps=0", "checkpoint.save_final=false", "consolidate.enabled=false",
    ]


def torchrun(args: list[str], env: dict[str, str], log: Path) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone", *args]
    with open(log, "w") as fh:
        return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode


def summarise(step_times: list[float], warmup: int, tokens_per_step: int, fpt: float, peak: float, mem_gib: float) -> dict:
    steady = step_times[warmup:]
    t = statistics.median(steady)
    tps = tokens_per_step / t
    return {"tokens_per_s": tps, "mfu": tps * fpt / (peak * 1e12), "peak_memory_gib": mem_gib,
            "median_step_s": t, "steps_measured": len(steady)}


# ----------------------------------------------------------------------------- plain loop
def plain_main(out: Path, steps: int, warmup: int) -> None:
    """The anchor: a plain Accelerate + FSDP2 loop (runs under torchrun)."""
    import torch
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_workflow.train.metrics import flops_per_token, guess_peak_tflops

    accelerator = Accelerator()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["intermediate"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"], max_position_embeddings=SEQ, tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert str(accelerator.distributed_type) == "DistributedType.FSDP", accelerator.distributed_type
    g = torch.Generator().manual_seed(0)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        batch = torch.randint(0, SHAPE["vocab"], (MICRO_BATCH, SEQ), generator=g).to(accelerator.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    fpt = flops_per_token(n_params, SHAPE["layers"], SHAPE["hidden"], SEQ, emb)
    res = summarise(times, warmup, MICRO_BATCH * SEQ, fpt, guess_peak_tflops("cuda", None),
                    torch.cuda.max_memory_allocated() / 2**30)
    res.update(params=n_params, final_loss=loss.item())
    out.write_text(json.dumps(res))


# ----------------------------------------------------------------------------- trainer
def trainer_run(work: Path, steps: int, warmup: int, base_env: dict[str, str]) -> dict:
    from fsdp_workflow.config.accelerate_env import accelerate_env
    from fsdp_workflow.config.load import compose, to_yaml

    run_dir = work / "trainer"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose([*overrides(steps), "train.compile=true", f"run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    env = {**base_env, **accelerate_env(cfg)}
    rc = torchrun(["-m", "fsdp_workflow.train", str(run_dir)], env, work / "trainer.log")
    if rc != 0:
        raise SystemExit(f"trainer failed (rc {rc}); see {work / 'trainer.log'}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in recs]
    tokens = MICRO_BATCH * SEQ
    peak, mfu0, tps0 = recs[-1]["peak_tflops"], recs[-1]["mfu"], recs[-1]["tokens_per_s"]
    fpt = mfu0 * peak * 1e12 / tps0
    res = summarise(times, warmup, tokens, fpt, peak, max(r.get("max_memory_gib", 0.0) for r in recs))
    res.update(final_loss=recs[-1]["loss"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compile, allocator)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", choices=["plain", "trainer"], default=None)
    ap.add_argument("--plain-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_worker:
        plain_main(args.plain_worker, args.steps, args.warmup)
        return

    from fsdp_workflow.config.accelerate_env import accelerate_env
    from fsdp_workflow.config.load import compose

    work = args.out or Path(tempfile.mkdtemp(prefix="train_throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}
    results: dict[str, dict] = {}
    if args.only in (None, "plain"):
        env = {**base_env, **accelerate_env(compose([*overrides(args.steps), f"run_dir={work}/plain"]))}
        rc = torchrun([__file__, "--plain-worker", str(work / "plain.json"), "--steps", str(args.steps),
                       "--warmup", str(args.warmup)], env, work / "plain.log")
        if rc != 0:
            raise SystemExit(f"plain loop failed (rc {rc}); see {work / 'plain.log'}")
        results["plain"] = json.loads((work / "plain.json").read_text())
        print("plain:", json.dumps(results["plain"]), flush=True)
    if args.only in (None, "trainer"):
        results["trainer"] = trainer_run(work, args.steps, args.warmup, base_env)
    print(f"{'':10} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'final loss':>10}")
    for name, r in results.items():
        print(f"{name:10} {r['tokens_per_s']:10.0f} {100 * r['mfu']:6.1f}% {r['peak_memory_gib']:9.1f} {r['final_loss']:10.4f}")
    if len(results) == 2:
        ratio = results["trainer"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
        results["ratio"] = {"tokens_per_s": ratio}
        print(f"ratio trainer/plain: {ratio:.2f}x")
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
