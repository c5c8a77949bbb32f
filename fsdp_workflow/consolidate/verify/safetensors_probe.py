"""Open the output files with ``safetensors.safe_open`` in a child process, beside the value comparison.

Verification must parse the output the way a consumer does, with the ``safetensors``
library. ``safe_open`` imports numpy on open whatever its ``framework`` (numpy, flax, mlx
and tensorflow all do; ``pt`` imports torch), and numpy's import was the largest fixed cost
left in the default verification: 0.045 CPU-seconds, a tenth of a ``cp -r`` of 1.5 GB,
paid on CPUs the copy keeps busy. A child that runs this file without ``site``
(``python -S``, the parent's ``sys.path`` as ``PYTHONPATH``), started when the copy is done,
does the import and the parsing on the CPU the comparison leaves free, and reports what
safetensors says as JSON: the ``__metadata__``, and each tensor's dtype and shape. The parent
compares that with the checkpoint (:func:`~.files.check_files`); the child reads nothing
else and judges nothing.

The child is only a way to run the same code elsewhere: if it cannot start, exits with an
error or answers something unreadable (an embedded interpreter, a broken environment), the
files are opened in this process instead, with a warning, so an environment quirk costs
speed, never the check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path


log = logging.getLogger(__name__)

# The child runs this file as __main__ (open_files below, nothing of the package), with neither
# the working directory nor this file's directory (keys.py, errors.py, ...) on sys.path, so no
# module there can shadow a library's (python -P would do it, but only from Python 3.11).
CHILD_SCRIPT = __file__
_RUN_CHILD = ("import sys; sys.path.pop(0); import runpy; sys.argv = sys.argv[1:]; "  # sys is built in: pop first
              "runpy.run_path(sys.argv[0], run_name='__main__')")
TIMEOUT_S = 300  # parsing headers takes milliseconds; this only bounds a child that never answers


class SafetensorsProbe:
    """``safe_open`` on each file in a child process, started at once; :meth:`result` waits for it.

    Args:
        paths: The ``*.safetensors`` files to open.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [str(p) for p in paths]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        self._proc: subprocess.Popen[str] | None = None
        self._error = ""
        try:
            self._proc = subprocess.Popen([sys.executable, "-S", "-c", _RUN_CHILD, CHILD_SCRIPT, *self.paths],
                                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            self._error = f"cannot start {sys.executable!r} to open the files with safetensors: {exc}"

    def result(self) -> dict[str, dict]:
        """What safetensors reported per file path: ``metadata`` and ``tensors`` (dtype, shape), or ``error``."""
        report, problem = self._from_child()
        if problem:
            log.warning("note: %s; opening them in this process instead", problem)
            report = open_files(self.paths)
        return report

    def _from_child(self) -> tuple[dict[str, dict], str]:
        if self._proc is None:
            return {}, self._error
        try:
            out, err = self._proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return {}, f"safetensors did not answer within {TIMEOUT_S} s in a child process"
        if self._proc.returncode != 0:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            return {}, f"opening the files with safetensors in a child process failed (exit {self._proc.returncode}): {tail}"
        try:
            return json.loads(out), ""
        except ValueError:
            return {}, f"the safetensors child process gave no readable report: {out[:200]!r}"

    def close(self) -> None:
        """Stop the child if it is still running (verification abandoned); safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()


def open_files(paths: list[str]) -> dict[str, dict]:
    """``safe_open`` each file and say what it reads (imports numpy): the child's work, or the fallback's."""
    from safetensors import safe_open

    report: dict[str, dict] = {}
    for path in paths:
        try:
            with safe_open(path, framework="numpy") as f:
                report[path] = {"metadata": f.metadata(),
                                "tensors": {k: [f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())]
                                            for k in f.keys()}}
        except Exception as exc:  # noqa: BLE001 - whatever safetensors refuses is the finding
            report[path] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


if __name__ == "__main__":  # the child (see _RUN_CHILD): argv is this file, then the files to open
    json.dump(open_files(sys.argv[1:]), sys.stdout)
