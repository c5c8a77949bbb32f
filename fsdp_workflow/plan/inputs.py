"""Fingerprints of a run's inputs, recorded at planning, so a finished run is complete only on the same inputs.

Appending conversations to the data file and giving the same command again used
to say "this run is complete ... Nothing run" and keep the old model. The planner
records in ``provenance.json`` (``inputs``) a fingerprint of each input file:

- the data files (``data.path``, each of ``data.sources``, ``data.eval_path``,
  expanded as prepare expands them): size, modification time and a sha256 over
  their first and last :data:`_EDGE_BYTES` (cheap on a 100 GB corpus, and catches
  an append or an edit at either end even when a copy kept the mtime);
- the model directory (``model.name_or_path`` when it is a local directory):
  ``config.json``'s sha256, and the size and modification time of each weight file.
- the tokenizer (``model.tokenizer``, else the model directory it is loaded from):
  the sha256 of each of its files but the weights, as the prepare step keys its cache
  (a changed tokenizer changes every token id). A record written before this key was
  recorded is not compared on it.

:func:`changed_inputs` compares two records, naming what changed. Planning reads
no more than this: a few stat calls and 2 MiB per file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import DataSource, WorkflowConfig
from fsdp_workflow.data.tokenizer import tokenizer_source  # imports transformers only to load one

_EDGE_BYTES = 1 << 20  # hashed at each end of a data file
_MAX_FILES = 10_000  # a glob over more files is recorded by its count and total size alone
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
# The tokenizer's files (model.tokenizer, else the model directory's): recorded since issue 36,
# so a record without the key predates it and is not compared on it.
TOKENIZER_KEY = "model.tokenizer"
_MAX_HASHED = 64 << 20  # a tokenizer file larger than this is fingerprinted by size and mtime
_MAX_COMPARED = 100  # eval files whose content is compared with the training files' (by size, then edges)
_SHOWN = 3


def _edges_sha256(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(_EDGE_BYTES))
        if size > 2 * _EDGE_BYTES:
            fh.seek(size - _EDGE_BYTES)
        h.update(fh.read(_EDGE_BYTES))
    return h.hexdigest()


def _file_prints(files: List[str], hashed: bool) -> Dict[str, Any]:
    """``{path: {size, mtime_ns[, edges_sha256]}}`` of regular files; unreadable ones are left out."""
    out: Dict[str, Any] = {}
    for f in files[:_MAX_FILES]:
        try:
            st = os.stat(f)
            entry: Dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            if hashed:
                entry["edges_sha256"] = _edges_sha256(f, st.st_size)
        except OSError:
            continue
        out[os.path.abspath(f)] = entry
    return out


def _data_files(source: DataSource, path: Optional[str]) -> List[str]:
    """The files prepare will read for ``path`` ([] when they cannot be listed: prepare names that)."""
    from fsdp_workflow.data.sources import DataError, expand

    if source == DataSource.synthetic or not path:
        return []
    path = os.path.expanduser(path)
    try:
        files = expand(source, path, "data.path")
    except (DataError, OSError):
        return []
    if source == DataSource.hf_disk:  # a save_to_disk directory: every file in it
        files = sorted(str(p) for p in Path(files[0]).rglob("*") if p.is_file())
    return files


def _model_prints(path: Optional[str]) -> Dict[str, Any]:
    """``config.json``'s sha256 and each weight file's size and mtime, for a local model directory."""
    if not path or not os.path.isdir(os.path.expanduser(path)):
        return {}
    root = Path(os.path.expanduser(path)).resolve()
    out: Dict[str, Any] = {}
    try:
        out[str(root / "config.json")] = {"sha256": hashlib.sha256((root / "config.json").read_bytes()).hexdigest()}
    except OSError:
        pass
    weights = sorted(str(p) for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    out.update(_file_prints(weights, hashed=False))
    return out


def _tokenizer_prints(path: Optional[str], skip: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Each tokenizer file's sha256 (every file of the directory but weights, hidden ones and ``skip``)."""
    if not path or not os.path.isdir(os.path.expanduser(path)):
        return {}
    root = Path(os.path.expanduser(path)).resolve()
    out: Dict[str, Any] = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith(".") \
                and p.name not in skip:
            try:
                st = p.stat()
                if st.st_size > _MAX_HASHED:  # not a tokenizer file (an .onnx, a .gguf): its size and mtime
                    out[str(p)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                else:
                    out[str(p)] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            except OSError:
                continue
    return out


def fingerprint_inputs(cfg: WorkflowConfig) -> Dict[str, Dict[str, Any]]:
    """The inputs' fingerprints, by config key: ``{"data.path": {FILE: {...}}, "model.name_or_path": {...}}``.

    Args:
        cfg: the validated config.

    Returns:
        One mapping per key that names inputs (keys naming none are left out).
    """
    d = cfg.data
    prints: Dict[str, Dict[str, Any]] = {}
    if d.sources:
        for i, s in enumerate(d.sources):
            prints[f"data.sources[{i}].path"] = _file_prints(_data_files(s.source or d.source, s.path), True)
    else:
        prints["data.path"] = _file_prints(_data_files(d.source, d.path), True)
    if d.eval_path:
        prints["data.eval_path"] = _file_prints(_data_files(d.source, d.eval_path), True)
    prints["model.name_or_path"] = _model_prints(cfg.model.name_or_path)
    tokenizer = tokenizer_source(cfg.model)
    # the model directory's own config.json is recorded under model.name_or_path already
    skip = ("config.json",) if tokenizer == cfg.model.name_or_path else ()
    prints[TOKENIZER_KEY] = _tokenizer_prints(tokenizer, skip)
    return {k: v for k, v in prints.items() if v}


def _training_files(cfg: WorkflowConfig) -> Dict[str, str]:
    """Each training file prepare reads, resolved (symlinks followed), -> the key naming it."""
    d = cfg.data
    keyed = ([(f"data.sources[{i}].path", s.source or d.source, s.path) for i, s in enumerate(d.sources)]
             if d.sources else [("data.path", d.source, d.path)])
    return {os.path.realpath(f): key for key, source, path in keyed for f in _data_files(source, path)}


def _copies(eval_files: List[str], train: Dict[str, str]) -> List[str]:
    """``EVAL_FILE (a copy of TRAIN_FILE, KEY)`` for eval files with a training file's size and edge hash."""
    sizes: Dict[int, List[str]] = {}
    for f in train:
        try:
            sizes.setdefault(os.stat(f).st_size, []).append(f)
        except OSError:
            continue
    out: List[str] = []
    for f in eval_files[:_MAX_COMPARED]:
        try:
            size = os.stat(f).st_size
            twins = sizes.get(size, [])
            digest = _edges_sha256(f, size) if twins else None
            match = next((t for t in twins if _edges_sha256(t, size) == digest), None)
        except OSError:
            continue
        if match is not None:
            whole = "the same bytes" if size <= 2 * _EDGE_BYTES else "the same size, first and last MiB"
            out.append(f"{f} (a copy of {match}, {train[match]}: {whole})")
    return out


def check_eval_data(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Warn when ``data.eval_path`` names training data: the same files, or copies of them.

    The held-out loss then measures documents the model trains on: it falls as the model
    memorises them and says nothing of how it does on text it has not seen. The files are
    compared by resolved path, then, for eval files of a training file's size, by the sha256
    over their first and last MiB that the run record keeps (:func:`fingerprint_inputs`).
    """
    d = cfg.data
    if not d.eval_path or (d.source == DataSource.synthetic and not d.sources):
        return
    eval_files = _data_files(d.source, d.eval_path)
    train = _training_files(cfg)
    if not eval_files or not train:
        return  # nothing to read here: the path rules and prepare say why
    same = [f"{f} (read by {train[os.path.realpath(f)]} too)" for f in eval_files if os.path.realpath(f) in train]
    copies = _copies([f for f in eval_files if os.path.realpath(f) not in train], train)
    found = same + copies
    if not found:
        return
    share = "every one of its files is" if len(found) == len(eval_files) else \
        f"{len(found)} of its {len(eval_files)} files are"
    shown = "; ".join(found[:_SHOWN]) + (f" (and {len(found) - _SHOWN} more)" if len(found) > _SHOWN else "")
    r.warn("data.eval_path", d.eval_path,
           f"{share} training data: {shown}. The eval loss would measure documents the model trains on: it "
           "falls as the model memorises them and says nothing about text it has not seen",
           "data.eval_path=FILE holding no training document, or data.eval_path=null data.eval_fraction=0.05 "
           "(prepare holds out 5% of the training documents, never trained on)")


def _what(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    if "sha256" in old or "sha256" in new:
        return "its content changed"
    if old.get("size") != new.get("size"):
        return f"{old.get('size')} -> {new.get('size')} bytes"
    if old.get("edges_sha256") != new.get("edges_sha256"):
        return "its content changed (same size)"
    return "modified since (same size)"


def changed_inputs(old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> List[str]:
    """What differs between two :func:`fingerprint_inputs` records, one line per file.

    Args:
        old: the record of the run in the directory (None or {} for a run planned before
            inputs were recorded: nothing can be compared, so nothing is called changed).
        new: the record of the inputs now.

    Returns:
        ``"KEY: FILE: what changed"`` lines, empty when the inputs are the same.
    """
    if not isinstance(old, dict) or not old:
        return []
    out: List[str] = []
    for key in sorted({*old, *new} - ({TOKENIZER_KEY} - set(old))):
        was, now = old.get(key) or {}, new.get(key) or {}
        for f in sorted({*was, *now}):
            if f not in now:
                out.append(f"{key}: {f}: gone")
            elif f not in was:
                out.append(f"{key}: {f}: new")
            elif was[f] != now[f]:
                out.append(f"{key}: {f}: {_what(was[f], now[f])}")
    return out


__all__ = ["changed_inputs", "check_eval_data", "fingerprint_inputs"]
