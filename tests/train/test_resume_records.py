"""No step is recorded twice after a resume (issue 24, item 3): how metrics.jsonl is cut back.

The whole proof on a real run (2 gloo ranks killed with SIGKILL after logging steps
past their last checkpoint, then resumed: metrics.jsonl, ``status``'s curves and
TensorBoard hold each redone step once, with the redone values) rides on the
kill -9 run of ``tests/train/test_preemption.py::test_kill_9_during_save_keeps_previous_checkpoint``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_workflow.train.metrics import keep_steps_up_to


def test_keep_steps_up_to_drops_later_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 4, 5)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a kill in the middle of a write
    assert keep_steps_up_to(path, 3) == 3
    assert path.read_text() == "".join(f"{line}\n" for line in lines[:3])
    assert keep_steps_up_to(path, 3) == 0  # nothing to drop: left alone
    assert keep_steps_up_to(tmp_path / "missing.jsonl", 3) == 0
    assert keep_steps_up_to(path, 0) == 3 and path.read_text() == ""  # a fresh start forgets them all
