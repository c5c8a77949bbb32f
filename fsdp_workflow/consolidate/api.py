"""The :func:`consolidate` entry point: sharded DCP checkpoint(s) -> verified HF model dir."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .average import normalise_weights
from .casting import CLI_DTYPES, FLOAT_NAMES
from .errors import ConsolidationError
from .hf_assets import copy_assets, dominant_float_dtype, fixed_architectures, read_config, write_config
from .layout import resolve
from .options import check_options
from .reader import DcpCheckpoint
from .verify import ArchitectureCheck, compare_keys, from_pretrained_check
from .writer import OutTensor, StreamingWriter, plan_files, source_digest

TIED_OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight")
TIED_INPUT_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


@dataclass
class ConsolidationResult:
    """What :func:`consolidate` produced."""

    output: Path
    num_tensors: int
    num_bytes: int
    files: list[str]
    layout: str
    sources: list[Path]
    verification: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _tied_pair(names: list[str], config: dict[str, Any] | None, shapes: dict[str, tuple]) -> tuple[str, str] | None:
    if not config or config.get("tie_word_embeddings") is not True:
        return None
    out = next((n for n in TIED_OUTPUT_NAMES if n in shapes), None)
    inp = next((n for n in names if n.endswith(TIED_INPUT_SUFFIXES) and n != out), None)
    if out and inp and shapes[out] == shapes[inp]:
        return out, inp
    return None


def consolidate(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    step: int | None = None,
    average_last: int | None = None,
    steps: list[int] | None = None,
    weights: list[float] | None = None,
    subtree: str | None = None,
    reference: str | os.PathLike | None = None,
    remove_sharded: bool = False,
    verify: bool = True,
    progress: bool = True,
    workers: int | None = None,
    from_pretrained_max_bytes: int = 256 << 20,
) -> ConsolidationResult:
    """Consolidate a sharded DCP checkpoint into a Hugging Face model directory.

    Args:
        src: A DCP directory, or any directory above one (run dir, ``checkpoints/``,
            ``checkpoint-N/``, an Accelerate output dir); see :mod:`.layout`.
        out: Output directory; must not exist. Written as a temporary sibling and renamed.
        dtype: ``None`` keeps stored dtypes; ``"bf16"``, ``"fp16"`` or ``"fp32"`` casts
            floating tensors only.
        max_shard_size: Split output files past this size (``"5GB"``, ``"1TB"``, ``"2GiB"``,
            bytes as int), parsed by :func:`fsdp_workflow.core.sizes.parse_size`.
        step: Pick step N from a directory of ``step-N`` checkpoints (default: the newest
            one with ``.metadata``; newer incomplete ones are skipped with a note).
        average_last: Average the last K complete steps.
        steps: Average these steps.
        weights: Weights for averaging (normalised to sum to 1; default equal).
        subtree: A key root (``"ema"``) or a subdirectory name to take weights from.
        reference: HF model dir for config/tokenizer; found automatically when the
            checkpoint sits in a run dir with ``hf_assets/`` or beside ``config.json``.
        remove_sharded: Delete the source DCP directories after verification passed
            (refused with ``verify=False``).
        verify: Run verification (checksums, equality, architecture, loading).
        progress: Show a tqdm progress bar on stderr.
        workers: Copy/verify threads (default ``min(8, 2 * cpu_count)``).
        from_pretrained_max_bytes: Load the result with ``from_pretrained`` when smaller.

    Returns:
        A :class:`ConsolidationResult`; ``verification`` is also written to
        ``OUT/verification.json``.

    Raises:
        ConsolidationError: For anything the user can fix (bad options are all reported
            at once, see :mod:`.options`); nothing is left at ``out``.
    """
    t0 = time.time()
    out = Path(out)
    max_bytes = check_options(out, dtype=dtype, max_shard_size=max_shard_size, step=step, average_last=average_last,
                              steps=steps, weights=weights, remove_sharded=remove_sharded, verify=verify, workers=workers)
    out_dtype = CLI_DTYPES[dtype] if dtype is not None else None
    res = resolve(Path(src), step=step, average_last=average_last, steps=steps, subtree=subtree,
                  reference=Path(reference) if reference else None)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    if res.reference is not None and not (res.reference / "config.json").is_file():
        raise ConsolidationError(f"--reference {res.reference}: no config.json there; point at a Hugging Face model directory")
    ckpts = _open_checkpoints(res, out)
    config = read_config(res.reference) if res.reference else None
    archs, arch_notes = fixed_architectures(config) if config else ([], [])
    causal = (not archs) or any(a.endswith("ForCausalLM") for a in archs)
    from .keys import map_keys

    mappings = [map_keys(list(c.tensors), res.subtree_key, causal) for c in ckpts]
    names = list(mappings[-1])
    for c, m in zip(ckpts, mappings):
        if set(m) != set(names):
            diff = sorted(set(m) ^ set(names))[:5]
            raise ConsolidationError(f"{c.path}: its model keys differ from {ckpts[-1].path} (e.g. {diff}); cannot average different models")
    for c, m in zip(ckpts, mappings):
        c.check_files(list(m.values()))
    last = ckpts[-1]
    shapes = {n: last.tensors[mappings[-1][n]].shape for n in names}
    tied = _tied_pair(names, config, shapes)
    w = normalise_weights(weights, len(ckpts)) if len(ckpts) > 1 or weights else None
    tensors = []
    for n in names:
        srcs = [c.tensors[m[n]] for c, m in zip(ckpts, mappings)]
        keep = srcs[-1].dtype
        dt = out_dtype if (out_dtype and keep in FLOAT_NAMES) else keep
        if tied and n == tied[0]:
            continue
        tensors.append(OutTensor(n, srcs, dt, w if len(srcs) > 1 else None))
    files = plan_files(tensors, max_bytes)
    total = sum(t.nbytes for t in tensors)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    arch_check = ArchitectureCheck(res.reference, archs) if (verify and config) else None
    try:
        if arch_check:
            arch_check.start()
        side = ThreadPoolExecutor(max_workers=2)
        tie_futs = [side.submit(source_digest, last.tensors[mappings[-1][k]]) for k in tied] if tied else []
        bar = _progress(total, progress)
        try:
            writer = StreamingWriter(tmp, files, workers or min(8, 2 * (os.cpu_count() or 1)), bar.update if bar else None, verify=verify)
            reports = writer.run()
        finally:
            if bar:
                bar.close()
        side.shutdown()
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {t.name: files[t.file_index].name for t in tensors}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        verification: dict[str, Any] = {"ok": True, "errors": [], "notes": [*res.notes, *arch_notes], "layout": res.layout}
        if res.layout == "deepspeed":
            verification["deepspeed"] = [c.describe() for c in ckpts]  # type: ignore[attr-defined]
        _read_meta_pt(res.dcp_dirs[-1] / "meta.pt", verification)
        sizes: dict[str, int] = {}
        for t in tensors:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
        verification["dtype"] = dominant_float_dtype(sizes)
        if tied:
            same = tie_futs[0].result() == tie_futs[1].result()
            verification["tied_lm_head"] = {"dropped": tied[0], "kept": tied[1], "identical": same}
            if not same:
                verification["notes"].append(f"'{tied[0]}' differed from '{tied[1]}' in the checkpoint; dropped it because config.json ties them")
        if config is not None:
            copied = copy_assets(res.reference, tmp, config)
            verification["assets_copied"] = copied
        if verify:
            _fill_verification(verification, reports, tensors, arch_check, tmp, total, from_pretrained_max_bytes, config)
        final_archs = archs
        if arch_check and arch_check.result().architecture:
            final_archs = [arch_check.result().architecture]
        if config is not None:
            write_config(config, tmp, final_archs, verification["dtype"])
            if verify and verification.get("from_pretrained_pending"):
                verification.pop("from_pretrained_pending")
                fp = from_pretrained_check(tmp, final_archs[0])
                verification["from_pretrained"] = fp
                if not fp["ok"]:
                    verification["errors"].append(f"from_pretrained reported problems: {fp}")
        else:
            verification["notes"].append("no reference config.json found: wrote weights only, architecture checks skipped (pass --reference HF_DIR)")
        verification["ok"] = not verification["errors"]
        (tmp / "verification.json").write_text(json.dumps(verification, indent=2, sort_keys=True) + "\n")
        if not verification["ok"]:
            raise ConsolidationError(f"verification failed for {res.dcp_dirs[-1]}: " + "; ".join(verification["errors"])
                                     + f". Nothing was written to {out}.")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for c in ckpts:
            getattr(c, "close", lambda: None)()  # DeepSpeed staging files
    if remove_sharded:
        for d in res.dcp_dirs:
            shutil.rmtree(d)
    return ConsolidationResult(out, len(tensors), total, [f.name for f in files], res.layout, res.dcp_dirs,
                               verification, time.time() - t0)


def _read_meta_pt(path: Path, verification: dict[str, Any]) -> None:
    """Report Lightning/NeMo ``meta.pt`` values; it is optional, so one that cannot be read becomes a note."""
    if not path.is_file():
        return
    from .metadata import load_meta_pt

    try:
        info = load_meta_pt(path)
    except (ConsolidationError, OSError) as exc:  # refused or unreadable: the weights do not depend on it
        verification["notes"].append(
            f"{path}: could not be read, so it was skipped ({exc}). It is optional trainer metadata (step, "
            "hyper-parameters); the weights come from '.metadata' and the .distcp shards. Nothing in it was executed."
        )
        return
    verification["meta_pt"] = {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))}


def _open_checkpoints(res: Any, out: Path) -> list[Any]:
    """One reader per source: DCP directories, or DeepSpeed tag directories (rebuilt from ZeRO partitions)."""
    if res.layout == "mixed":
        raise ConsolidationError(f"{res.dcp_dirs}: the chosen steps mix checkpoint formats (DCP and DeepSpeed); pick steps of one format")
    if res.layout != "deepspeed":
        return [DcpCheckpoint(d) for d in res.dcp_dirs]
    from .deepspeed import DeepSpeedCheckpoint

    out.parent.mkdir(parents=True, exist_ok=True)
    return [DeepSpeedCheckpoint(d, out.parent) for d in res.dcp_dirs]


def _fill_verification(v: dict[str, Any], reports: dict, tensors: list[OutTensor], arch_check: ArchitectureCheck | None,
                       tmp: Path, total: int, fp_max: int, config: dict | None) -> None:
    v["tensors"] = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "sha256": reports[t.name].sha256,
                             "equal_to_source": reports[t.name].equal_to_source} for t in tensors}
    bad = [t.name for t in tensors if reports[t.name].equal_to_source is False]
    if bad:
        v["errors"].append(f"output differs from the source chunks for {bad[:5]}")
    if arch_check is None:
        return
    arch = arch_check.result()
    v["architecture"] = {"name": arch.architecture, "resolves": arch.error is None, "notes": arch.notes}
    if arch.error:
        v["errors"].append(arch.error)
        return
    keys = compare_keys(arch, {t.name: t.shape for t in tensors})
    v["keys"] = keys
    if keys["missing"] or keys["unexpected"] or keys["shape_mismatch"]:
        v["errors"].append(
            "the checkpoint does not match the architecture in config.json: "
            f"missing {keys['missing'][:5]}, unexpected {keys['unexpected'][:5]}, shape mismatch {keys['shape_mismatch'][:5]}"
            " (is --reference the config this model was trained with?)"
        )
        return
    if total <= fp_max:
        v["from_pretrained_pending"] = True
    else:
        v["from_pretrained"] = {"skipped": f"model is {total} bytes, above the {fp_max}-byte limit for a load test"}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="consolidate", file=sys.stderr,
                dynamic_ncols=True, mininterval=0.5)
