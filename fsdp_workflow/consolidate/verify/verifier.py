"""The verifier: the written model against the checkpoint, through a path that shares nothing with the writer.

:class:`Verifier` is what the consolidation step holds while it writes. Everything it
checks is driven by :mod:`.expected` (names, dtypes, shapes and chunks read from the
checkpoint again) and by the output files themselves, never by the writer's plan:

1. **Values** (:mod:`.values`): every output tensor is read back at the offset its file's
   header gives and compared with every source chunk, each placed by its box in the tensor.
   The writer reports each tensor it finished with the byte ranges it wrote, and any range
   outside the tensor's own region (by the header) is an error. On a machine with CPUs to
   spare a tensor is compared as soon as it is reported (the report is only a schedule, and
   no later write can touch a tensor already compared); on a small one, where comparing
   beside the copy slowed the copy more than it saved, every tensor is compared once the
   copy is done. Tensors the writer never reported are compared at the end either way.
2. **Files** (:mod:`.files`, at the end): the output as the ``safetensors`` library reads
   it, in a child process that runs beside the comparisons (:mod:`.safetensors_probe`: it
   keeps numpy's import off the busy CPUs), against what the checkpoint declares, plus the
   index file.

The result is an :class:`Outcome`: the problems found, and verification.json's
``tensors`` and ``values`` entries (:mod:`.report_schema`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..consolidation_errors import ConsolidationError
from ..source import Source
from .expected import ExpectedModel, expected_model
from .files import Located, check_files, read_header
from .safetensors_probe import SafetensorsProbe
from .report_schema import TensorEntry, ValuesReport
from .values import SLAB_BYTES, SlabBuffers, TensorCheck, compare_tensor

CHECKSUM = "xxh3_128"
FAST_EVERY = 16  # fast mode: one slab in 16 (1/16 of the bytes) plus every chunk boundary (docs/consolidation.md)
_CHECKS = {
    "bytes": "byte equality with every source chunk, placed by its box in the tensor (memcmp per contiguous run)",
    "rounding": "each value is its source value rounded to nearest-even in the output dtype",
    "average": "recomputed as sum(w_i * x_i) in float32 over every checkpoint, then checked for rounding",
}
_READER = ("source chunks located with zipfile and placed by their boxes (numpy slicing where values are decoded), "
           "output read through its own safetensors header; nothing shared with the writer's plan or chunk arithmetic")


@dataclass
class Outcome:
    """What verification found: problems, verification.json's per-tensor entries and its ``values`` summary."""

    errors: list[str]
    tensors: dict[str, TensorEntry]
    values: ValuesReport
    files: list[str] = field(default_factory=list)


class Verifier:
    """Compare the output with the checkpoint while it is written, then check the files.

    Args:
        source: The opened checkpoints (their paths, layout and reference are used, not the writer's index).
        staging: The directory the writer fills.
        out_dtype: The dtype floating tensors were asked to be cast to (None: kept).
        weights: Averaging weights as the user gave them (None: equal).
        workers: Comparison threads.
        index_name: The index file's name.
        full: Compare every byte (else fast mode: a fixed fraction plus every chunk boundary).
        during_copy: Compare each tensor as soon as the writer reports it (else all of them in
            :meth:`finish`; the reports are still checked for writes outside the tensor).
    """

    def __init__(self, source: Source, staging: Path, *, out_dtype: str | None, weights: list[float] | None,
                 workers: int, index_name: str, full: bool = True, during_copy: bool = True) -> None:
        self.staging = staging
        self.during_copy = during_copy
        self.every = 1 if full else FAST_EVERY
        self.index_name = index_name
        self.layout = source.layout
        self.errors: list[str] = []
        try:
            self.model: ExpectedModel | None = expected_model(source, out_dtype, weights)
        except ConsolidationError as exc:
            self.model = None
            self.errors.append(f"cannot derive the expected output from the checkpoint: {exc}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
        self._lock = threading.Lock()
        self._located: dict[str, Located] | None = None
        self._fds: dict[str, int] = {}
        self._futures: dict[str, Future[TensorCheck]] = {}
        self._local = threading.local()

    def written(self, name: str, file: str, ranges: list[tuple[int, int]]) -> None:
        """The writer finished tensor ``name`` in ``file`` with these (offset, length) writes: check them, compare it (``during_copy``).

        Called from the writer's threads.
        """
        if self.model is None:
            return
        with self._lock:
            located = self._locate()
            loc = located.get(name)
            if loc is None or loc.file != file:
                self.errors.append(f"the writer wrote '{name}' into {file}, whose header does not list it")
                return
            stray = [(o, n) for o, n in ranges if o < loc.offset or o + n > loc.offset + loc.nbytes]
            if stray:
                self.errors.append(f"the writer wrote bytes {stray[:3]} of {file} for '{name}', outside its region "
                                   f"[{loc.offset}, {loc.offset + loc.nbytes}) in the header")
            if self.during_copy and name in self.model.tensors and name not in self._futures:
                self._futures[name] = self._pool.submit(self._compare, name, loc)

    def _locate(self) -> dict[str, Located]:
        """Parse the output headers once (the writer writes them before any tensor data)."""
        if self._located is None:
            self._located = {}
            for path in sorted(self.staging.glob("*.safetensors")):
                self._located.update(read_header(path))
                self._fds[path.name] = os.open(path, os.O_RDONLY)
        return self._located

    def _compare(self, name: str, loc: Located) -> TensorCheck:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = SlabBuffers()
        assert self.model is not None
        return compare_tensor(self.model.tensors[name], loc.offset, self._fds[loc.file], loc.file, bufs, self.every)

    def finish(self) -> Outcome:
        """Compare what the writer did not announce, wait for every comparison, check the files."""
        try:
            if self.model is None:
                return Outcome(self.errors, {}, _summary({}, [], self.every))
            with self._lock:
                located = self._locate()
                for name in sorted(self.model.tensors, key=lambda n: -self.model.tensors[n].nbytes):  # type: ignore[union-attr]
                    if name in located and name not in self._futures:
                        self._futures[name] = self._pool.submit(self._compare, name, located[name])
            probe = SafetensorsProbe(sorted(self.staging.glob("*.safetensors")))  # parses beside the comparisons
            try:
                results = {name: f.result() for name, f in self._futures.items()}
                file_errors, final = check_files(self.staging, self.model, self.index_name, probe)
            finally:
                probe.close()
            if {k: (v.file, v.offset) for k, v in final.items()} != {k: (v.file, v.offset) for k, v in located.items()}:
                file_errors.append("the safetensors headers changed after the values were compared")
            return self._outcome(results, file_errors)
        finally:
            self.close()

    def close(self) -> None:
        """Stop comparing (pending comparisons are cancelled) and close the output files; safe to call twice."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def _outcome(self, results: dict[str, TensorCheck], file_errors: list[str]) -> Outcome:
        assert self.model is not None
        entries: dict[str, TensorEntry] = {}
        for name, e in self.model.tensors.items():
            r = results.get(name)
            # equal_to_source: true only when every byte was compared; a difference found is false either way
            equal = None if r is None else (False if not r.equal else (True if r.fraction == 1.0 else None))
            entries[name] = {"dtype": e.dtype, "shape": list(e.shape), "xxh3_128": r.checksum if r else "",
                             "equal_to_source": equal, "check": r.check if r else "not compared",
                             "chunks": r.chunks if r else 0, "compared_fraction": round(r.fraction, 4) if r else 0.0}
        errors = self.errors + file_errors
        bad = sorted(n for n, r in results.items() if not r.equal)
        if bad:
            where = ", ".join(f"'{n}' (first difference at element {results[n].first_bad}, {results[n].check})" for n in bad[:5])
            errors.append(f"output differs from the source for {len(bad)} tensor(s): {where}")
        notes = []
        if self.layout == "deepspeed":
            notes.append("DeepSpeed: compared with the fp32 masters rebuilt from the ZeRO partitions; the rebuild itself "
                         "is not derived a second time (tests compare it with DeepSpeed's zero_to_fp32)")
        decoded = sorted(n for n, r in results.items() if r.decoded_by_torch)
        if decoded:
            notes.append(f"{len(decoded)} tensor(s) have chunks stored with stream transforms or strides, decoded by "
                         f"DCP's own reader (as the writer does) and then placed and compared independently: {decoded[:5]}")
        files = sorted(p.name for p in self.staging.glob("*.safetensors"))
        sizes = {n: e.nbytes for n, e in self.model.tensors.items()}
        return Outcome(errors, entries, _summary(results, notes, self.every, sizes), files)


def _summary(results: dict[str, TensorCheck], notes: list[str], every: int = 1,
             sizes: dict[str, int] | None = None) -> ValuesReport:
    kinds = sorted({r.check for r in results.values()})
    total = sum((sizes or {}).get(n, 0) for n in results)
    share = sum(r.fraction * (sizes or {}).get(n, 0) for n, r in results.items()) / total if total else 1.0
    mode = "full: every byte of every tensor" if every == 1 else (
        f"fast: every tensor, at its chunk boundaries (the first and last row of each chunk) and on one slab of "
        f"{SLAB_BYTES >> 20} MiB in {every} (tensors of one slab whole); equal_to_source is null where not every "
        "byte was compared, and the checksum is left empty there (pass --full-verify for every byte)")
    return {"compared": len(results), "mode": mode, "bytes_compared_fraction": round(share, 4),
            "checks": {k: _CHECKS[k] for k in kinds}, "checksum": CHECKSUM,
            "chunks": sum(r.chunks for r in results.values()), "chunks_listed": sum(r.listed for r in results.values()),
            "reader": _READER, "notes": notes}
