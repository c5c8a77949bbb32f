"""``train.profile_steps``: one real 2-rank gloo run profiles steps 2-3 of 4 and writes each rank's files.

The run (tiny Llama, FSDP2 on CPU, no checkpoint) is shared by every test here. What
is checked: each rank's Chrome trace parses as JSON and holds the ``step 2`` and
``step 3`` ranges with the step's own ops inside (the decoder's matmuls, attention,
FSDP's all-gather), and no ``step 1`` or ``step 4``; the key_averages table says it
is sorted by CPU time and names the steps; no temporary file is left beside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_workflow.core.rundir import TMP_SUFFIX, RunDir
from tests.train.runner import launched, make_run_dir

pytestmark = pytest.mark.slow

OVERRIDES = ["train.max_steps=4", "train.profile_steps=[2,3]", "checkpoint.every_steps=0",
             "checkpoint.save_final=false", "consolidate.enabled=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return RunDir.of(launched(make_run_dir(tmp_path_factory.mktemp("profile") / "run", OVERRIDES)))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_writes_a_trace_of_the_window_only(run: RunDir, rank: int) -> None:
    events = json.loads(run.profile_trace(rank).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3"} <= names
    assert not {"step 1", "step 4"} & names
    spans = [e for e in events if e.get("name") in ("step 2", "step 3") and e.get("ph") == "X"]
    start, end = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    inside = {e["name"] for e in events if e.get("ph") == "X" and start <= e["ts"] <= end}
    assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= inside
    assert any("all_gather" in n for n in inside), sorted(inside)[:50]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_writes_a_table_sorted_by_cpu_time(run: RunDir, rank: int) -> None:
    header, _, table = run.profile_table(rank).read_text().partition("\n")
    assert header == (f"# rank {rank}, optimizer steps 2-3 (train.profile_steps=[2,3]): torch.profiler "
                      "key_averages, sorted by self CPU time")
    assert "aten::mm" in table and "Self CPU" in table


def test_only_the_final_files_are_left(run: RunDir) -> None:
    assert sorted(p.name for p in run.profile.iterdir()) == [
        "rank0.key_averages.txt", "rank0.trace.json", "rank1.key_averages.txt", "rank1.trace.json"]
    assert not [p for p in run.profile.iterdir() if p.name.endswith(TMP_SUFFIX)]
