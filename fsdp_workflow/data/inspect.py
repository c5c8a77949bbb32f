"""Print the first packed samples of a run's cache token by token, marking what is trained.

    python -m fsdp_workflow.data.inspect RUN_DIR [-n 3] [--split train|eval] [--json]

Like Axolotl's preprocess debug output: each token is printed as
``piece(label, id)``; trained tokens are bracketed ``[piece](label, id)`` (and
green on a terminal), the rest carry label -100. A line ``|| document d``
marks each document boundary (positions restart at 0 there) with the
``file:line`` the document came from, and the padding
is summarised at the end. ``--json`` prints one object per sample with the
token ids, decoded pieces, labels, position ids and trained flags.

Exit codes: 0; 2 when the run has no usable cache (the message says what to run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from fsdp_workflow.config.schema import run_layout
from fsdp_workflow.core.exit_codes import EXIT_OK, EXIT_USAGE
from fsdp_workflow.core.logs import recorded_log_level, report_user_error, setup_logging
from fsdp_workflow.data.cache import IGNORE_INDEX, SPLITS, CacheError, PackedSplit, TokenCache
from fsdp_workflow.data.open import open_cache

log = logging.getLogger(__name__)

GREEN, RESET = "\033[32m", "\033[0m"


def sample_record(split: PackedSplit, index: int, tokenizer: Any, cache: Optional[TokenCache] = None,
                  split_name: str = SPLITS[0]) -> Dict[str, Any]:
    """One packed sample as plain data: ids, pieces, labels, positions, trained flags, document spans and sources."""
    s = split.sample(index)
    first, last = int(split.sample_docs[index]), int(split.sample_docs[index + 1])
    bounds = np.asarray(split.doc_offsets[first:last + 1], dtype=np.int64)
    start = int(bounds[0])
    n = int(bounds[-1]) - start
    ids = s.input_ids.tolist()
    return {
        "sample": index,
        "documents": [[int(a - start), int(b - start)] for a, b in zip(bounds[:-1], bounds[1:])],
        "sources": [cache.source_of(split_name, d) if cache is not None else None for d in range(first, last)],
        "num_tokens": n,
        "num_padding": len(ids) - n,
        "input_ids": ids,
        "pieces": [tokenizer.decode([i]) for i in ids[:n]] + [""] * (len(ids) - n),
        "labels": s.labels.tolist(),
        "position_ids": s.position_ids.tolist(),
        "trained": (s.labels != IGNORE_INDEX).tolist(),
    }


def render_text(rec: Dict[str, Any], split_name: str, color: bool) -> str:
    """A person's view of :func:`sample_record`."""
    trained = sum(rec["trained"])
    out = [f"=== sample {rec['sample']} ({split_name}): {len(rec['documents'])} documents, {rec['num_tokens']} "
           f"tokens + {rec['num_padding']} padding, {trained} trained ==="]
    for d, (a, b) in enumerate(rec["documents"]):
        src = rec.get("sources", [None] * len(rec["documents"]))[d]
        where = f"{src}, " if src else ""
        out.append(f"|| document {d} ({where}tokens {a}-{b - 1}, positions 0-{rec['position_ids'][b - 1]})")
        parts: List[str] = []
        for i in range(a, b):
            piece = json.dumps(rec["pieces"][i], ensure_ascii=False)[1:-1]  # newlines and tabs visible
            cell = f"{piece}({rec['labels'][i]}, {rec['input_ids'][i]})"
            if rec["trained"][i]:
                cell = f"[{cell}]"
                if color:
                    cell = GREEN + cell + RESET
            parts.append(cell)
        out.append(" ".join(parts))
    if rec["num_padding"]:
        out.append(f"|| padding: {rec['num_padding']} x id {rec['input_ids'][-1]} (label -100, never trained)")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_workflow.data.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run directory (prepared)")
    parser.add_argument("-n", type=int, default=3, help="samples to print (default 3)")
    parser.add_argument("--split", choices=SPLITS, default=SPLITS[0])
    parser.add_argument("--json", action="store_true", help="one JSON list of samples, for tools")
    args = parser.parse_args(argv)
    setup_logging(recorded_log_level(args.run_dir))
    from fsdp_workflow.config.load import load_run_config
    from fsdp_workflow.data.tokenizer import load_tokenizer

    try:
        cfg = load_run_config(args.run_dir)
        tok = load_tokenizer(cfg.model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        cache = open_cache(run_layout(cfg), pad)
        if cache is None:
            raise CacheError("data.source=synthetic: random token ids, nothing prepared to inspect")
        split = cache.split(args.split)
        if split is None:
            raise CacheError(f"{cache.path}: no {args.split} split (no held-out documents)")
    except (CacheError, FileNotFoundError, ValueError) as err:
        report_user_error(log, f"inspect: {err}", err)
        return EXIT_USAGE
    records = [sample_record(split, i, tok, cache, args.split) for i in range(min(args.n, split.num_samples))]
    try:
        _print(records, args, cache, split)
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet too
    return EXIT_OK


def _print(records: list, args: argparse.Namespace, cache: Any, split: Any) -> None:
    """The samples as JSON (``--json``) or as marked-up text."""
    if args.json:
        json.dump(records, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        color = sys.stdout.isatty()
        print(f"{cache.path} [{args.split}]: {split.num_samples} samples of {cache.seq_len} tokens; "
              "[piece](label, id) is trained, piece(-100, id) is not")
        for r in records:
            print(render_text(r, args.split, color))


if __name__ == "__main__":
    sys.exit(main())
