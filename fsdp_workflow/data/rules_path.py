"""Plan-time rules of what a data path holds: the reader it needs, a URL, a test split beside the training one.

Run by :func:`fsdp_workflow.plan.checks.check` for ``data.path``, ``data.eval_path``
and each ``data.sources[i].path``; a violation exits 2 before anything is written.
Each was a confusing failure later, or none (issue 49):

- a ``save_to_disk`` directory read as JSON lines gave "bad records" from its
  ``dataset_info.json``, with the advice ``on_bad_record=skip``; a directory of
  Parquet shards was "no .jsonl file". Both now name the reader: ``data.source=hf_disk``
  or ``data.source=parquet`` (and so does any directory whose files another reader reads);
- ``hf://datasets/...`` or an ``https://`` URL was made into a local path that does not
  exist. URLs and hub ids are not read: the message says how to download it;
- a directory holding ``train.jsonl`` and ``test.jsonl`` trained on both. A directory is
  read whole, so a held-out split beside the training one is refused with the keys that
  split them (``data.path=DIR/train.jsonl data.eval_path=DIR/test.jsonl``).

A directory is listed once, as prepare lists it; nothing is opened. No torch or transformers.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Dict, List, Optional, Sequence

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.path_keys import is_url
from fsdp_workflow.config.schema import DataSource, WorkflowConfig
from fsdp_workflow.data.sources import suffixes

# What datasets' save_to_disk writes: a Dataset (its info and state), or a DatasetDict (its splits' names).
SAVE_TO_DISK_MARKERS = (("dataset_info.json", "state.json"), ("dataset_dict.json",))
# A file or directory whose name starts with one of these words holds that split.
TRAIN_WORDS = frozenset({"train", "training"})
HELD_OUT_WORDS = frozenset({"test", "eval", "evaluation", "validation", "valid", "val", "dev", "heldout"})
_FILE_READERS = (DataSource.jsonl, DataSource.parquet, DataSource.text)
_HUB = re.compile(r"^(?:hf://|https?://huggingface\.co/)(?:(datasets|spaces)/)?([^/@\s]+/[^/@\s]+)")
_MAX_LISTED = 100_000  # a directory with more files is not searched for splits (prepare reads it as given)


def _download_fix(key: str, url: str) -> str:
    hub = _HUB.match(url)
    if hub:
        kind = " --repo-type dataset" if hub.group(1) == "datasets" else ""
        return (f"download it first, e.g. hf download {hub.group(2)}{kind} --local-dir /data/{hub.group(2)}, "
                f"then {key}=/data/{hub.group(2)} (with the data.source its files need: jsonl, parquet...)")
    if url.lower().startswith(("http://", "https://", "ftp://")):
        name = os.path.basename(url.split("?", 1)[0].rstrip("/")) or "data.jsonl"
        return f"download it first, e.g. curl -L -o /data/{name} '{url}', then {key}=/data/{name}"
    return f"copy it onto a filesystem the nodes read (e.g. aws s3 cp, gsutil cp), then {key}=/path/to/the/copy"


def save_to_disk_marker(directory: str) -> Optional[str]:
    """The file(s) that make ``directory`` a ``save_to_disk`` dataset (``dataset_info.json`` ...), or None."""
    for names in SAVE_TO_DISK_MARKERS:
        if all(os.path.isfile(os.path.join(directory, n)) for n in names):
            return " and ".join(names)
    return None


def _listing(directory: str) -> List[str]:
    """Every file below ``directory`` (as prepare lists it), at most :data:`_MAX_LISTED` of them."""
    out: List[str] = []
    for f in glob.iglob(os.path.join(directory, "**", "*"), recursive=True):
        if os.path.isfile(f):
            out.append(f)
            if len(out) > _MAX_LISTED:
                break
    return out


def _readers_of(files: Sequence[str]) -> Dict[DataSource, List[str]]:
    """The files each file reader would read, for readers that read some."""
    found: Dict[DataSource, List[str]] = {}
    for reader in _FILE_READERS:
        sfx = tuple(suffixes(reader))
        matched = [f for f in files if f.endswith(sfx)]
        if matched:
            found[reader] = matched
    return found


def _word(name: str) -> str:
    """The first word of a file or directory name (``train`` of ``train-00000-of-00002.parquet``)."""
    return re.split(r"[-_.\s]", name.lower(), maxsplit=1)[0]


def _split_of(directory: str, f: str) -> Optional[str]:
    """``train``, ``held-out`` or None: the first word of the file's name or of a directory below ``directory``."""
    for part in os.path.relpath(f, directory).split(os.sep):
        word = _word(part)
        if word in TRAIN_WORDS:
            return "train"
        if word in HELD_OUT_WORDS:
            return "held-out"
    return None


def _naming(directory: str, files: Sequence[str]) -> str:
    """A path value that reads exactly ``files``: the file, their split directory, or a glob of their shared prefix."""
    if len(files) == 1:
        return files[0]
    common = os.path.commonpath(list(files))
    if common != directory and _word(os.path.basename(common)) in TRAIN_WORDS | HELD_OUT_WORDS:
        return common  # a split's own directory (DIR/train/)
    folder = os.path.dirname(files[0])
    if all(os.path.dirname(f) == folder for f in files):
        prefix = os.path.commonprefix([os.path.basename(f) for f in files])
        ext = os.path.splitext(files[0])[1]
        if all(f.endswith(ext) for f in files):
            return os.path.join(folder, f"{prefix}*{ext}")
    return common


def _quoted(path: str) -> str:
    """A path as typed on the command line: single-quoted where the shell would expand or split it."""
    return f"'{path}'" if re.search(r"[*?\[\s$'\"]", path) else path


def _splits(key: str, directory: str, files: Sequence[str], r: ValidationReport, eval_set: bool) -> None:
    """Refuse a directory whose files hold a training split and a held-out one (both would train)."""
    groups: Dict[str, List[str]] = {}
    for f in files:
        split = _split_of(directory, f)
        if split:
            groups.setdefault(split, []).append(f)
    if "train" not in groups or "held-out" not in groups:
        return
    train, held = sorted(groups["train"]), sorted(groups["held-out"])
    shown = ", ".join(os.path.relpath(f, directory) for f in (train[:2] + held[:2]))
    fix = f"{key}={_quoted(_naming(directory, train))}"
    if not eval_set:
        fix += f" data.eval_path={_quoted(_naming(directory, held))}"
    r.error(key, directory,
            f"the directory holds a training split and a held-out one ({shown}), and a directory is read whole: "
            f"the model would train on the {len(held)} held-out file(s) too, and a loss measured on them would say "
            "nothing of text it has not seen",
            fix + " (name the training files alone; a held-out file is never trained on)")


def _check_one(key: str, source_key: str, source: DataSource, path: Optional[str], r: ValidationReport,
               training: bool, eval_set: bool) -> None:
    """The rules for one path key read by ``source`` (``source_key`` is the key that sets the reader).

    ``training``: the key names training data (a held-out split beside it is refused); ``eval_set``:
    ``data.eval_path`` is set (the fix then leaves it as it is).
    """
    if not path:
        return
    if is_url(path):
        r.error(key, path, "URLs and hub ids are not read: data is read from files on this machine (or the "
                "cluster's shared filesystem), as model.name_or_path is (hub ids are not downloaded)",
                _download_fix(key, path))
        return
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        if source in (DataSource.jsonl, DataSource.text) and path.endswith(tuple(suffixes(DataSource.parquet))):
            r.error(source_key, source.value, f"{key}={path!r} is a Parquet file, which the {source.value} reader "
                    "cannot read", f"{source_key}=parquet")
        return
    if not os.path.isdir(path):
        return  # a glob, or missing: the path rules (rules_run, rules_mixture) and prepare say so
    marker = save_to_disk_marker(path)
    if marker and source != DataSource.hf_disk:
        r.error(source_key, source.value,
                f"{key}={path!r} is a dataset written by datasets' save_to_disk (it holds {marker}); the "
                f"{source.value} reader would read its metadata files as records, not its rows",
                f"{source_key}=hf_disk")
        return
    files = _listing(path)
    readers = _readers_of(files)
    if source == DataSource.hf_disk:
        if not marker:
            others = ", ".join(f"{len(v)} {'/'.join(suffixes(k)[:2])} file(s)" for k, v in readers.items())
            fix = (f"{source_key}={next(iter(readers)).value}" if len(readers) == 1 else
                   f"{source_key}=jsonl, parquet or text (the reader of its files)" if readers else
                   f"{key}=DIR written by Dataset.save_to_disk")
            r.error(source_key, source.value, f"{key}={path!r} is not a directory written by datasets' save_to_disk "
                    f"(no dataset_info.json and state.json, nor dataset_dict.json)"
                    + (f"; it holds {others}" if others else ""), fix)
        return
    if source not in readers and readers:
        found = "; ".join(f"{len(v)} file(s) the {k.value} reader reads ({os.path.relpath(v[0], path)}...)"
                          for k, v in readers.items())
        fix = " or ".join(f"{source_key}={k.value}" for k in readers)
        r.error(source_key, source.value, f"{key}={path!r} holds no {'/'.join(suffixes(source))} file but {found}",
                fix)
        return
    if training and len(files) <= _MAX_LISTED:
        _splits(key, path, readers.get(source, []), r, eval_set)


def check_data_paths(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """What ``data.path``, ``data.eval_path`` and each ``data.sources[i].path`` hold, for the reader that reads it."""
    d = cfg.data
    if d.sources:
        for i, s in enumerate(d.sources):
            reader = s.source or d.source
            source_key = f"data.sources[{i}].source" if s.source else "data.source"
            _check_one(f"data.sources[{i}].path", source_key, reader, s.path, r, True, bool(d.eval_path))
    elif d.source != DataSource.synthetic:
        _check_one("data.path", "data.source", d.source, d.path, r, True, bool(d.eval_path))
    if d.eval_path and d.source != DataSource.synthetic:
        _check_one("data.eval_path", "data.source", d.source, d.eval_path, r, False, True)


__all__ = ["check_data_paths", "save_to_disk_marker"]
