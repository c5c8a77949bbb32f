"""Prepare against ``datasets.map(batched=True, num_proc=N)`` computing the same tokens and masks, side by side.

    python benchmarks/data_prepare_bench.py [--corpus ascii|mixed] [--conversations 20000] [--workers 2]
        [--repeats 3] [--out /tmp/prep_bench]

Generates ``--conversations`` chat records, seeded. ``--corpus ascii`` (the
default): half with a system turn, 1-3 user/assistant exchanges of words from
the shipped corpus, and an 8000-token byte-level BPE tokenizer (GPT-2's
pre-tokenizer) trained on that corpus. ``--corpus mixed``: a third such English
chat, a third code with unicode and emoji, a third Chinese or Japanese chat
(``mixed_corpus.py``), and an 8000-token tokenizer of Qwen2's shape (NFC, its
Split regex, byte level) trained on the shipped corpus and the first 2,000
conversations. Both use the chatml template, which has ``{% generation %}``
markers. Then the two sides run ``--repeats`` times, interleaved (A B, B A,
A B, ...), each in a fresh process with a fresh cache:

- ``prepare``: :func:`fsdp_workflow.data.prepare.prepare` with ``--workers``
  processes: reading, rendering, assistant masks, tokenising, shuffling,
  packing and writing the verified cache;
- ``peer``: ``datasets.load_dataset("json")`` then ``map(batched=True,
  num_proc=--workers)`` calling transformers'
  ``apply_chat_template(tokenize=True, return_dict=True,
  return_assistant_tokens_mask=True)``: the same rendering, the same token ids
  and the same trained tokens (``assistant_masks``; our labels equal them,
  tests/data/test_masks.py), but no packing or cache of ours.

The two must agree on the token count and the trained-token count (checked).
Reported per side: the median wall time, tokens/s, the peak of the summed
RSS of the process and all its children (sampled every 20 ms by this script),
and the median CPU seconds of the process tree (imports included); plus the
ratio of each round's pair and the machine's load average before and after.
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
from typing import Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def generate(path: Path, conversations: int, seed: int = 0) -> int:
    """Write ``conversations`` English chat records as JSONL; returns the count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mixed_corpus import english

    words = (ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt").read_text().split()
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(conversations):
            fh.write(json.dumps({"messages": english(rng, words)}) + "\n")
    return conversations


# Qwen2's pre-tokenizer regex (its tokenizer.json), for the mixed corpus
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def generate_mixed(path: Path, conversations: int, seed: int = 0) -> int:
    """Write ``conversations`` mixed records (English, code, CJK in turn; ``mixed_corpus.py``); returns the count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mixed_corpus

    words = (ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt").read_text().split()
    return mixed_corpus.write(path, words, conversations, seed)


def build_tokenizer(out: Path, data: Optional[Path] = None) -> Path:
    """The benchmark's tokenizer: GPT-2's shape on the shipped corpus, or (``data``) Qwen2's, trained on it too."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fsdp_workflow.data.templates import SHIPPED_TEMPLATES

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    files = [str(ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt")]
    if data is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        sample = out.parent / "tokenizer_sample.txt"
        with open(data, encoding="utf-8") as fh, open(sample, "w", encoding="utf-8") as dst:
            for _, line in zip(range(2000), fh):
                dst.writelines(m["content"] + "\n" for m in json.loads(line)["messages"])
        files.append(str(sample))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = SHIPPED_TEMPLATES["chatml"]
    fast.save_pretrained(out)
    return out


def run_prepare(data: Path, tok_dir: Path, out: Path, workers: int) -> dict:
    from fsdp_workflow.config.schema import (ClusterConfig, ContainerConfig, DataConfig, DataFormat, DataSource,
                                             ModelConfig, ModelInit, OptimizerConfig, StrategyConfig, StrategyName,
                                             WorkflowConfig)
    from fsdp_workflow.data.prepare import prepare
    from fsdp_workflow.data.tokenizer import load_tokenizer

    cfg = WorkflowConfig(
        model=ModelConfig(name="bench", init=ModelInit.random, tokenizer=str(tok_dir), vocab_size=8000),
        data=DataConfig(source=DataSource.jsonl, path=str(data), format=DataFormat.conversation,
                        chat_template="chatml", eval_fraction=0.0, cache_dir=str(out / "cache")),
        strategy=StrategyConfig(name=StrategyName.ddp), optimizer=OptimizerConfig(), cluster=ClusterConfig(),
        container=ContainerConfig(), run_dir=str(out / "run"))
    cfg.train.seq_len = 4096
    load_tokenizer(cfg.model)  # imports transformers outside the timing, as the peer does
    t0 = time.perf_counter()
    p = prepare(cfg, num_workers=workers, progress=False)
    dt = time.perf_counter() - t0
    tr = p.meta["splits"]["train"]
    # + one per document: the first token's label is -100 by construction (nothing predicts across documents);
    # it is an <|im_start|> header token, never in an assistant mask, so this changes nothing here
    return {"seconds": dt, "tokens": tr["tokens"], "trained": tr["trained_tokens"], "records": p.meta["records"]}


def run_peer(data: Path, tok_dir: Path, out: Path, workers: int) -> dict:
    from datasets import disable_caching, load_dataset
    from transformers import AutoTokenizer

    disable_caching()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))

    def tokenize(batch: dict) -> dict:
        enc = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": enc["input_ids"], "assistant_masks": enc["assistant_masks"]}

    t0 = time.perf_counter()
    ds = load_dataset("json", data_files=str(data), split="train", cache_dir=str(out / "hf_cache"))
    ds = ds.map(tokenize, batched=True, num_proc=workers, remove_columns=ds.column_names)
    dt = time.perf_counter() - t0
    cols = ds.with_format("numpy")
    tokens = sum(len(x) for x in cols["input_ids"])
    trained = sum(int(x.sum()) for x in cols["assistant_masks"])
    return {"seconds": dt, "tokens": int(tokens), "trained": trained, "records": len(ds)}


def one(args: argparse.Namespace) -> None:
    fn = run_prepare if args.one == "prepare" else run_peer
    res = fn(Path(args.data), Path(args.tok), Path(args.out), args.workers)
    print("RESULT " + json.dumps(res), flush=True)


def _tree_rss(proc: "psutil.Process") -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(cmd: list, env: dict) -> tuple:
    """Run ``cmd``; return (its RESULT dict, the peak of the summed RSS of it and its children in MB, their CPU s).

    The CPU seconds (user + system of the whole process tree, imports included)
    move far less with the machine's load than wall time does.
    """
    cpu0 = _children_cpu_s()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, _tree_rss(ps))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.exit(f"{cmd[-1]} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):]), peak / 2**20, _children_cpu_s() - cpu0


def main() -> None:
    import shutil
    import statistics

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", choices=["ascii", "mixed"], default="ascii")
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/prep_bench")
    ap.add_argument("--one", choices=["prepare", "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args)
        return
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = out / "chat.jsonl"
    if args.corpus == "mixed":
        n = generate_mixed(data, args.conversations)
        tok_dir = build_tokenizer(out / "tokenizer", data)
    else:
        n = generate(data, args.conversations)
        tok_dir = build_tokenizer(out / "tokenizer")
    print(f"{data}: {n:,} {args.corpus} conversations, {os.path.getsize(data) / 1e6:.1f} MB", flush=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()
    runs: dict = {"prepare": [], "peer": []}
    for r in range(args.repeats):
        order = ("prepare", "peer") if r % 2 == 0 else ("peer", "prepare")
        for which in order:
            run_out = out / f"{which}{r}"
            cmd = [sys.executable, __file__, "--data", str(data), "--tok", str(tok_dir), "--out", str(run_out),
                   "--workers", str(args.workers), "--one", which]
            res, peak, cpu = measure(cmd, env)
            res["peak_rss_mb"], res["cpu_s"] = peak, cpu
            runs[which].append(res)
            print(f"round {r} {which:8} {res['seconds']:7.2f} s  {res['tokens']:,} tokens  "
                  f"{res['trained']:,} trained  peak {peak:,.0f} MB  cpu {cpu:.1f} s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            shutil.rmtree(run_out, ignore_errors=True)
    a, b = runs["prepare"][0], runs["peer"][0]
    if (a["tokens"], a["trained"]) != (b["tokens"], b["trained"]):
        sys.exit(f"the two sides disagree: prepare {a['tokens']:,} tokens / {a['trained']:,} trained, "
                 f"peer {b['tokens']:,} / {b['trained']:,}")
    med = {w: statistics.median(x["seconds"] for x in rs) for w, rs in runs.items()}
    peak = {w: max(x["peak_rss_mb"] for x in rs) for w, rs in runs.items()}
    cpu = {w: statistics.median(x["cpu_s"] for x in rs) for w, rs in runs.items()}
    print(f"\n{'':9} {'median s':>9} {'tokens/s':>11} {'peak RSS, all processes (MB)':>30} "
          f"{'median CPU s':>13}")
    for w in runs:
        print(f"{w:9} {med[w]:9.2f} {a['tokens'] / med[w]:11,.0f} {peak[w]:30,.0f} {cpu[w]:13.1f}")
    pairs = " ".join(f"{p['seconds'] / q['seconds']:.2f}x" for p, q in zip(runs["peer"], runs["prepare"]))
    print(f"speed-up {med['peer'] / med['prepare']:.2f}x (per round: {pairs}); "
          f"CPU {cpu['peer'] / cpu['prepare']:.2f}x; "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(json.dumps({"corpus": args.corpus, "conversations": n, "workers": args.workers, "median_s": med,
                      "peak_rss_mb": peak, "cpu_s": cpu,
                      "load_before": load_before, "load_after": os.getloadavg(), "runs": runs}))


if __name__ == "__main__":
    main()
