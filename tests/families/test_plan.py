"""Each family planned from its directory alone (a dry run): the summary shows the real model.

What the summary must say comes from the replica itself, not from the planner:
the parameters counted in its ``model.safetensors`` (a tied head once; for a MoE
family the active ones too, each expert's share counted at ``k`` of ``E``), the tie
from its weights, and the class to wrap from transformers' own ``_no_split_modules``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from tests.forked_cli import run

from .replicas import FAMILIES, Replica, active_parameter_count, parameter_count

_COUNT = re.compile(r"([\d.]+) ([KMB]) parameters(?: \(([\d.]+) ([KMB]) active)?")
_UNIT = {"K": 1e3, "M": 1e6, "B": 1e9}


def rounds_to(shown: str, unit: str, real: int) -> bool:
    """``shown`` (in ``unit``) is ``real`` rounded to the digits shown."""
    decimals = len(shown.partition(".")[2])
    return abs(float(shown) * _UNIT[unit] - real) <= 0.5 * _UNIT[unit] * 10 ** -decimals


def wrapped_class(row: Replica) -> str:
    """The decoder layer transformers itself keeps whole for this architecture."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    (name,) = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[row.model_type])._no_split_modules
    return name


@pytest.mark.parametrize("row", FAMILIES, ids=lambda r: r.key)
def test_the_plan_shows_the_real_model(row: Replica, replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory = replica(row)
    res = run(["+experiment=smoke_chat", f"model.name_or_path={directory}", f"run_dir={tmp_path / 'run'}",
               "dry_run=true"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip().startswith("model ")]  # the summary: stderr
    assert f"{row.model_type} ({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[row.model_type]})" in line, line
    assert ("tied embeddings" if row.tied else "untied embeddings") in line, line
    assert f"wraps {wrapped_class(row)}" in line, line
    count = _COUNT.search(line)
    assert count is not None, line
    assert rounds_to(count[1], count[2], parameter_count(directory)), (line, parameter_count(directory))
    active = active_parameter_count(directory, row)
    if active == parameter_count(directory):
        assert count[3] is None, line  # a dense model has no separate active count
    else:
        assert count[3] is not None and rounds_to(count[3], count[4], active), (line, active)
