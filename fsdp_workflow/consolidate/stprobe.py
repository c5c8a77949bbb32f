"""Open the output files with ``safetensors.safe_open`` in a child process, beside the value comparison.

Verification must parse the output the way a consumer does, with the ``safetensors``
library. ``safe_open`` imports numpy on open whatever its ``framework`` (numpy, flax, mlx
and tensorflow all do; ``pt`` imports torch), and numpy's import was the largest fixed cost
left in the default verification: 0.045 CPU-seconds, a tenth of a ``cp -r`` of 1.5 GB,
paid on CPUs the copy keeps busy. A child started without ``site`` (``python -S``, the
parent's ``sys.path`` as ``PYTHONPATH``) when the copy is done does the import and the
parsing on the CPU the comparison leaves free, and reports what safetensors says as JSON:
the ``__metadata__``, and each tensor's dtype and shape. The parent compares that with the
checkpoint (:func:`~.check.check_files`); the child reads nothing else and judges nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys
from safetensors import safe_open
report = {}
for path in sys.argv[1:]:
    try:
        with safe_open(path, framework="numpy") as f:
            report[path] = {"metadata": f.metadata(),
                            "tensors": {k: [f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())] for k in f.keys()}}
    except Exception as exc:
        report[path] = {"error": f"{type(exc).__name__}: {exc}"}
json.dump(report, sys.stdout)
"""

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
            self._proc = subprocess.Popen([sys.executable, "-S", "-c", _CHILD, *self.paths], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            self._error = f"cannot start {sys.executable} to open the files with safetensors: {exc}"

    def result(self) -> tuple[dict[str, dict], str]:
        """What safetensors reported per file path (``metadata`` and ``tensors``, or ``error``), and a problem running it ("" when none)."""
        if self._proc is None:
            return {}, self._error
        try:
            out, err = self._proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return {}, f"safetensors did not answer within {TIMEOUT_S} s while opening {self.paths[:3]}"
        if self._proc.returncode != 0:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            return {}, f"opening the files with safetensors failed (exit {self._proc.returncode}): {tail}"
        try:
            report = json.loads(out)
        except ValueError:
            return {}, f"opening the files with safetensors gave no readable report: {out[:200]!r}"
        return report, ""

    def close(self) -> None:
        """Stop the child if it is still running (verification abandoned); safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
