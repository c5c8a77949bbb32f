"""The file check of verification: the output as the ``safetensors`` library reads it.

Run once the values are compared (:mod:`.verifier`): every ``*.safetensors`` is opened with
``safe_open(framework="numpy")`` in a child process (:mod:`.safetensors_probe`: headers,
keys, dtypes and shapes, no data loaded, no torch import); keys, dtypes, shapes and
``__metadata__`` must be what the checkpoint declares (:mod:`.expected`), each file's own
JSON header must agree with what safetensors read (the values were read through that
header), and ``model.safetensors.index.json``'s weight map and total size must match the
files. Nothing here uses the writer's plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fsdp_workflow.core.modeldir import SINGLE_FILE

from ..metadata import dtype_info
from .expected import ExpectedModel
from .safetensors_probe import SafetensorsProbe



@dataclass
class Located:
    """Where a tensor is in the output, as the file's own header says."""

    file: str
    offset: int  # absolute offset of the data
    dtype: str  # safetensors code, e.g. BF16
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: Path) -> dict[str, Located]:
    """Tensor locations from a safetensors file's JSON header, read directly (no safetensors import).

    Args:
        path: A ``*.safetensors`` file.

    Returns:
        Tensor name -> where its bytes are, with the dtype and shape the header declares.
    """
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return {k: Located(path.name, 8 + n + int(v["data_offsets"][0]), v["dtype"], tuple(v["shape"]),
                       int(v["data_offsets"][1]) - int(v["data_offsets"][0]))
            for k, v in header.items() if k != "__metadata__"}


def check_files(staging: Path, model: ExpectedModel, index_name: str,
                probe: SafetensorsProbe | None = None) -> tuple[list[str], dict[str, Located]]:
    """Parse every output file with safetensors and compare it with what the checkpoint declares.

    Args:
        staging: The written model.
        model: What the checkpoint says the output holds.
        index_name: The index file's name.
        probe: ``safe_open`` already running on the files in a child process
            (:class:`~.safetensors_probe.SafetensorsProbe`); started here when not given.

    Returns:
        The problems found (empty when none), and where each tensor is.
    """
    errors: list[str] = []
    files = sorted(p.name for p in staging.glob("*.safetensors"))
    probe = probe or SafetensorsProbe([staging / n for n in files])
    opened = probe.result()
    located: dict[str, Located] = {}
    sizes: dict[str, int] = {}
    for name in files:
        path = staging / name
        seen = opened.get(str(path), {"error": "the safetensors child did not report this file"})
        if "error" in seen:  # whatever safetensors refuses is the finding
            errors.append(f"{name}: safetensors cannot open it: {seen['error']}")
            continue
        meta = seen["metadata"]
        lib = {k: (dt, tuple(shape)) for k, (dt, shape) in seen["tensors"].items()}
        if meta != {"format": "pt"}:
            errors.append(f"{name}: __metadata__ is {meta}, expected {{'format': 'pt'}}")
        header = read_header(path)
        for key, (dt, shape) in lib.items():
            entry = header[key]
            if (entry.dtype, entry.shape) != (dt, shape):
                errors.append(f"{name}: '{key}' is {entry.dtype}{list(entry.shape)} in the header, {dt}{list(shape)} in safetensors")
            if key in located:
                errors.append(f"'{key}' is in both {located[key].file} and {name}")
            located[key] = entry
            sizes[key] = entry.nbytes
    want, got = set(model.tensors), set(located)
    if want != got:
        errors.append(f"output tensors differ from the checkpoint's: missing {sorted(want - got)[:5]}, "
                      f"unexpected {sorted(got - want)[:5]}")
    for key in sorted(want & got):
        e, loc = model.tensors[key], located[key]
        if (dtype_info(e.dtype)[0], tuple(e.shape)) != (loc.dtype, loc.shape):
            errors.append(f"'{key}' is {loc.dtype}{list(loc.shape)} in {loc.file}, the checkpoint says "
                          f"{dtype_info(e.dtype)[0]}{list(e.shape)}")
    errors += _check_index(staging, files, located, sizes, index_name)
    return errors, located


def _check_index(staging: Path, files: list[str], located: dict[str, Located], sizes: dict[str, int],
                 index_name: str) -> list[str]:
    index = staging / index_name
    if not index.is_file():
        return [] if files == [SINGLE_FILE] else [f"{len(files)} safetensors files {files[:3]} but no {index_name}"]
    data = json.loads(index.read_text())
    weight_map = data.get("weight_map", {})
    errors = []
    if weight_map != {k: v.file for k, v in located.items()}:
        wrong = sorted(k for k in set(weight_map) | set(located)
                       if k not in located or weight_map.get(k) != located[k].file)
        errors.append(f"{index_name}: weight_map disagrees with the files for {wrong[:5]}")
    total = data.get("metadata", {}).get("total_size")
    if total != sum(sizes.values()):
        errors.append(f"{index_name}: metadata.total_size is {total}, the files hold {sum(sizes.values())} tensor bytes")
    return errors


