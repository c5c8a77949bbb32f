"""Consolidate a sharded DCP checkpoint into a Hugging Face model directory.

Usage::

    python -m fsdp_workflow.consolidate RUN_DIR RUN_DIR/hf-model
    python -m fsdp_workflow.consolidate ckpt/pytorch_model_fsdp_0 out --dtype bf16 --reference base-model/
    python -m fsdp_workflow.consolidate RUN_DIR/checkpoints out --average-last 3

Exit status (message on stderr, no traceback, nothing left at OUT):

* 0: written and verified;
* 2: a user error: a bad option value, a missing or incomplete checkpoint, an OUT that
  exists (without ``--overwrite``), an OUT inside the checkpoints or holding them, a
  second consolidation into the same OUT (named with its holder), ``--remove-sharded``
  with ``--no-verify``, a mount point OUT this user cannot write;
* 65: the weights hold NaN or inf (each tensor named, with its counts), without
  ``--allow-nonfinite``;
* 2 too: a checkpoint removed while it was being read (training pruned it: the
  message names it and the checkpoints left);
* 130: interrupted (Ctrl-C); 143: terminated (SIGTERM: ``kill``, ``timeout``, a
  scheduler); one line says what was left (the partial output is removed).

A staging directory (``.OUT.tmp-PID``) left by a consolidation into the same OUT that
was killed (SIGKILL, out of memory) is removed, with a note, before writing.

An existing OUT that cannot be renamed (a mount point, such as a container's ``/output``)
has its contents replaced in place with ``--overwrite``, ``verification.json`` last
(:mod:`.in_place`); one this user cannot write is refused (exit 2) before anything is read.

Where a flag would make the command go through, the message ends with the whole command
to paste, shell-quoted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys

from fsdp_workflow.core.logs import setup_logging

from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.interrupts import sigterm_as_ctrl_c, stopped_by

from .consolidation import consolidate, stopped_word
from .consolidation_errors import ConsolidationError, ConsolidationInterrupted, OutputExistsError
from .nonfinite import NonFiniteWeightsError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 10,20, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.5,0.5, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_workflow.consolidate",
        description="Stream sharded torch.distributed.checkpoint (DCP) shards into a verified Hugging Face "
                    "safetensors model, in bounded memory.",
    )
    p.add_argument("src", help="DCP dir, or a run dir / checkpoints dir / checkpoint-N / Accelerate output above one")
    p.add_argument("out", help="output directory (must not exist, unless --overwrite)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors (default: keep stored dtype)")
    p.add_argument("--max-shard-size", default="5GB", help="split output files past this size: 5GB, 500MB, 1TB, 2GiB or a byte count (default 5GB)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="use step N (default: the newest complete one)")
    g.add_argument("--average-last", type=int, metavar="K", help="average the last K complete steps (fp32 accumulation)")
    g.add_argument("--steps", type=_int_list, help="average these steps, e.g. 10,20")
    p.add_argument("--weights", type=_float_list, help="averaging weights, one per step, e.g. 0.25,0.75 (with --steps or --average-last)")
    p.add_argument("--subtree", help="take weights from this key root or subdirectory, e.g. ema")
    p.add_argument("--reference", help="HF model dir with config.json/tokenizer (default: found beside the checkpoint)")
    p.add_argument("--remove-sharded", action="store_true", help="delete the source DCP dir(s) after verification passed (not with --no-verify)")
    p.add_argument("--no-verify", action="store_true", help="skip verification (files, values against the checkpoint, architecture)")
    p.add_argument("--full-verify", action="store_true",
                   help="compare every byte of every tensor with the checkpoint (default: every tensor at its chunk "
                        "boundaries and on 1/16 of its bytes; always full with --remove-sharded)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (an earlier output, or any directory) once the new model is verified")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="write weights holding NaN/inf on purpose (default: refuse, exit 65); verification.json and "
                        "the model card then name the tensors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=int, help="copy/verify threads, at least 1 (default min(8, 2 x CPUs))")
    return p


def paste_command(argv: list[str], flag: str) -> str:
    """This very command with ``flag`` added, shell-quoted for pasting (``shlex.join``: no word of it runs as code)."""
    exe = os.path.basename(sys.executable)
    python = exe if shutil.which(exe) == sys.executable else sys.executable
    return shlex.join([python, "-m", "fsdp_workflow.consolidate", *argv, flag])


def _interrupt(signum: int, frame: object) -> None:
    """The first Ctrl-C stops the consolidation; later ones are ignored while it cleans up (a second traceback never)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_logging("INFO")  # notes and progress lines on stderr; the JSON summary alone on stdout
    # Nothing here uses BLAS; with one BLAS thread numpy's import (the verifier's) costs about
    # 0.05 CPU-seconds less on 2 CPUs. A user's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    restore_sigterm = sigterm_as_ctrl_c()  # kill, timeout, a scheduler: cleaned up as after Ctrl-C, exit 143
    try:
        return _run(args, argv)
    finally:
        restore_sigterm()
        # main() called in-process (tests): leave Ctrl-C as it was. After a Ctrl-C, though, it
        # stays ignored: the process is on its way out, and a second press while the interpreter
        # joins its threads would otherwise print a traceback under the one-line message.
        if previous is signal.default_int_handler and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    """Consolidate as asked; every refusal and Ctrl-C become a message and an exit code (see the module docstring)."""
    try:
        result = consolidate(
            args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, step=args.step,
            average_last=args.average_last, steps=args.steps, weights=args.weights, subtree=args.subtree,
            reference=args.reference, remove_sharded=args.remove_sharded, verify=not args.no_verify,
            full_verify=args.full_verify, progress=not args.no_progress, workers=args.workers,
            overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite,
        )
    except OutputExistsError as exc:
        print(f"error: {exc}\n  to replace it: {paste_command(argv, '--overwrite')}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteWeightsError as exc:
        print(f"error: {exc}\n  to write them anyway: {paste_command(argv, '--allow-nonfinite')}", file=sys.stderr)
        return exc.exit_code
    except ConsolidationError as exc:
        print(f"error: {exc}", file=sys.stderr)  # the command's answer, as plain as its JSON summary
        return EXIT_USAGE
    except ConsolidationInterrupted as exc:
        print(exc, file=sys.stderr)
        return stopped_by()[0]
    except KeyboardInterrupt:  # before anything was opened (checking the options)
        print(f"{stopped_word()}: nothing was written to {args.out}", file=sys.stderr)
        return stopped_by()[0]
    v = result.verification
    arch = v.get("architecture")
    summary = {
        "output": str(result.output), "layout": result.layout, "sources": [str(s) for s in result.sources],
        "tensors": result.num_tensors, "bytes": result.num_bytes, "files": result.files,
        "seconds": round(result.seconds, 2), "verified": v.get("ok") if "tensors" in v else None,
        "dtype": v.get("dtype"), "architecture": arch["name"] if arch else None,
        "from_pretrained": v.get("from_pretrained"), "tied_lm_head": v.get("tied_lm_head"),
        "nonfinite": v.get("nonfinite", {}).get("tensors") or None, "notes": v.get("notes"),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    from fsdp_workflow.core.fastexit import run_main

    run_main(main)  # raise SystemExit(main()), without tearing down torch's modules (fastexit)
