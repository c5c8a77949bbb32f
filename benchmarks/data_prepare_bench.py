"""Prepare throughput against a plain ``datasets.map`` baseline, on generated chat JSONL.

    python benchmarks/data_prepare_bench.py [--mb 200] [--workers 2] [--out /tmp/prep_bench]

Generates ``--mb`` MB of conversations (seeded; system/user/assistant turns of
words from the shipped corpus), trains a small byte-level BPE tokenizer on the
shipped corpus (vocabulary 8000, chatml template), then runs, one after the
other, each in a fresh process:

- ``prepare``: :func:`fsdp_workflow.data.prepare.prepare` with ``--workers``
  processes: reading, chatml rendering, assistant masks (prefix rendering and
  offsets), tokenising, packing and writing the cache;
- ``baseline``: ``datasets.load_dataset("json")`` then
  ``map(tokenize, batched=True, num_proc=2)`` where ``tokenize`` renders the
  same template with ``apply_chat_template(tokenize=False)`` and tokenises: no
  masks, no packing, no cache of ours.

It prints tokens/s (tokens of the rendered conversations, the same count for
both) and the peak RSS of the largest process of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def generate(path: Path, mb: float, seed: int = 0) -> int:
    """Write about ``mb`` MB of chat JSONL; returns the record count."""
    words = (ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt").read_text().split()
    rng = random.Random(seed)
    target = int(mb * 1e6)
    n = 0
    size = 0
    with open(path, "w") as fh:
        while size < target:
            msgs = []
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": " ".join(rng.choices(words, k=rng.randint(5, 20)))})
            for _ in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(10, 60)))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(20, 150)))})
            line = json.dumps({"messages": msgs}) + "\n"
            fh.write(line)
            size += len(line)
            n += 1
    return n


def build_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fsdp_workflow.data.templates import SHIPPED_TEMPLATES

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = SHIPPED_TEMPLATES["chatml"]
    fast.save_pretrained(out)
    return out


def run_prepare(data: Path, tok_dir: Path, out: Path, workers: int) -> dict:
    from fsdp_workflow.config.schema import (ClusterConfig, ContainerConfig, DataConfig, DataFormat, DataSource,
                                             ModelConfig, ModelInit, OptimizerConfig, StrategyConfig, StrategyName,
                                             WorkflowConfig)
    from fsdp_workflow.data.prepare import prepare

    cfg = WorkflowConfig(
        model=ModelConfig(name="bench", init=ModelInit.random, tokenizer=str(tok_dir), vocab_size=8000),
        data=DataConfig(source=DataSource.jsonl, path=str(data), format=DataFormat.conversation,
                        chat_template="chatml", eval_fraction=0.01, cache_dir=str(out / "cache")),
        strategy=StrategyConfig(name=StrategyName.ddp), optimizer=OptimizerConfig(), cluster=ClusterConfig(),
        container=ContainerConfig(), run_dir=str(out / "run"))
    cfg.train.seq_len = 4096
    from fsdp_workflow.data.tokenizer import load_tokenizer

    load_tokenizer(cfg.model)  # imports transformers outside the timing, as the baseline does
    t0 = time.perf_counter()
    p = prepare(cfg, num_workers=workers, progress=True)
    dt = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in p.meta["splits"].values())
    return {"seconds": dt, "tokens": tokens, "records": p.meta["records"], "reused": p.reused}


def run_baseline(data: Path, tok_dir: Path, out: Path, workers: int) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))

    def tokenize(batch: dict) -> dict:
        texts = tok.apply_chat_template(batch["messages"], tokenize=False)
        return tok(texts, add_special_tokens=False)

    t0 = time.perf_counter()
    ds = load_dataset("json", data_files=str(data), split="train", cache_dir=str(out / "hf_cache"))
    ds = ds.map(tokenize, batched=True, num_proc=workers, remove_columns=ds.column_names)
    dt = time.perf_counter() - t0
    tokens = sum(len(x) for x in ds.with_format("numpy")["input_ids"])
    return {"seconds": dt, "tokens": int(tokens), "records": len(ds)}


def one(args: argparse.Namespace) -> None:
    fn = run_prepare if args.one == "prepare" else run_baseline
    res = fn(Path(args.data), Path(args.tok), Path(args.out), args.workers)
    res["peak_rss_mb_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["peak_rss_mb_children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("RESULT " + json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="/tmp/prep_bench")
    ap.add_argument("--one", choices=["prepare", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args)
        return
    out = Path(args.out)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = out / "chat.jsonl"
    t0 = time.perf_counter()
    n = generate(data, args.mb)
    print(f"generated {data} ({os.path.getsize(data) / 1e6:.0f} MB, {n:,} conversations) in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    tok_dir = build_tokenizer(out / "tokenizer")
    results = {}
    for which in ("prepare", "baseline"):
        cmd = [sys.executable, __file__, "--one", which, "--data", str(data), "--tok", str(tok_dir),
               "--out", str(out), "--workers", str(args.workers)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{which} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[which] = json.loads(line[0][len("RESULT "):])
    print(f"\n{'':10} {'seconds':>9} {'tokens':>13} {'tokens/s':>11} {'peak RSS MB (main / largest worker)':>38}")
    for which, r in results.items():
        print(f"{which:10} {r['seconds']:9.1f} {r['tokens']:13,} {r['tokens'] / r['seconds']:11,.0f} "
              f"{r['peak_rss_mb_self']:18,.0f} / {r['peak_rss_mb_children']:,.0f}")
    print(json.dumps({"mb": args.mb, "workers": args.workers, **results}))


if __name__ == "__main__":
    main()
