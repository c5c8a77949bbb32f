"""Fixtures for tests against the two-node Slurm (tools/slurm/two_node_cluster.sh).

``two_node_cluster`` (session): starts the cluster if needed (as root), yields
a ``slurm_utils.ClusterInfo`` (``.slurm_conf``, ``.partition`` == "debug",
``.nodes`` == ["n1", "n2"], ``.env``) and stops it at the end of the session if
this session started it (``FSDP_SLURM_KEEP=1`` keeps it). Failure to start is a
test failure, never a skip.

Tests marked ``multinode`` get ``SLURM_CONF`` for this cluster in ``os.environ``.
``import slurm_utils`` works here too: this conftest puts tests/slurm on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SLURM_TESTS = str(Path(__file__).resolve().parent.parent / "slurm")
if _SLURM_TESTS not in sys.path:
    sys.path.insert(0, _SLURM_TESTS)

import slurm_utils as _slurm_utils  # noqa: E402


@pytest.fixture(scope="session")
def two_node_cluster():
    try:
        info = _slurm_utils.start_cluster("two_node")
    except Exception as exc:  # noqa: BLE001 - reported as a failure, not a skip
        pytest.fail(f"could not start the two-node Slurm test cluster: {exc}", pytrace=False)
    yield info
    _slurm_utils.release_cluster(info)


@pytest.fixture(autouse=True)
def _two_node_slurm_conf_for_test(request, monkeypatch):
    if request.node.get_closest_marker("multinode") is None:
        return
    info = request.getfixturevalue("two_node_cluster")
    monkeypatch.setenv("SLURM_CONF", info.slurm_conf)


@pytest.fixture
def slurm_utils():
    """The helper module (``wait_for_job``, ``job_state``, ``release_requeued``, ...)."""
    return _slurm_utils
