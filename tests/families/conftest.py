"""The family replicas and their fine-tuning runs, each made once per test session and shared.

The replicas serve the planning and training tests; a replica's run (the real command,
2 steps on 2 gloo ranks: :mod:`.test_matrix`) serves the matrix and the modules that check
one family further (:mod:`.test_moe_experts`). Each run's tests share one xdist group
(:func:`group`), so each run happens once per suite; the runs are dealt over two groups
so that two workers share them instead of one running all thirteen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

from fsdp_workflow.core.rundir import list_checkpoints

from .replicas import BY_KEY, FAMILIES, Replica, build

# As short as a run that proves the chain can be: 2 steps, a checkpoint only at the end.
RUN = ["train.max_steps=2", "train.seq_len=128", "optimizer.warmup_steps=0", "checkpoint.every_steps=0"]


GROUPS = 2  # the workers of `-n 2`: more groups would only shuffle the same runs


def group(row: Replica) -> str:
    """The xdist group of ``row``'s run and of every test using it: rows dealt in turn over :data:`GROUPS`."""
    return f"families-{FAMILIES.index(row) % GROUPS}"


@dataclass(frozen=True)
class FamilyRun:
    row: Replica
    base: Path  # the replica's directory, as the user downloaded it
    run_dir: Path

    @property
    def out(self) -> Path:
        return self.run_dir / "hf_model"

    def trained_weights(self) -> Dict[str, Any]:
        """The model part of the run's last DCP checkpoint, read by torch's own converter (not the
        consolidator): transformers 5's in-memory names. Converted once per run, beside it."""
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dest = self.run_dir.parent / "trained.pt"
        if not dest.exists():
            _, last = list_checkpoints(self.run_dir / "checkpoints")[-1]
            dcp_to_torch_save(str(last), str(dest))
        return torch.load(str(dest), weights_only=True)["model"]


def family_env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # this torchrun


def _cli(row: Replica, base: Path, run_dir: Path) -> subprocess.CompletedProcess:
    # The directory alone: a family with a stock template trains on it and ships it (smoke_chat's chatml is
    # only data.fallback_chat_template); a base model without one trains on that fallback and ships it.
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke_chat", f"model.name_or_path={base}",
            f"run_dir={run_dir}", *RUN, *row.run]
    return subprocess.run(argv, cwd=run_dir.parent, env=family_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Replica], Path]:
    """``replica(row)``: the directory of ``row``'s replica, written on first use (about 0.6 s each)."""
    root = tmp_path_factory.mktemp("replicas")
    built: Dict[str, Path] = {}

    def get(row: Replica) -> Path:
        assert BY_KEY[row.key] is row, row
        if row.key not in built:
            built[row.key] = build(row, root / row.key)
        return built[row.key]

    return get


@pytest.fixture(scope="session")
def family_runs(replica: Callable[[Replica], Path],
                tmp_path_factory: pytest.TempPathFactory) -> Callable[[Replica], FamilyRun]:
    """``family_runs(row)``: ``python -m fsdp_workflow +experiment=smoke_chat model.name_or_path=DIR``, once per row."""
    done: Dict[str, FamilyRun] = {}

    def get(row: Replica) -> FamilyRun:
        if row.key not in done:
            run_dir = tmp_path_factory.mktemp(f"run-{row.key}") / "run"
            proc = _cli(row, replica(row), run_dir)
            assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            done[row.key] = FamilyRun(row, replica(row), run_dir)
        return done[row.key]

    return get
