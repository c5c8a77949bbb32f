"""Fixtures for tests against the real single-node Slurm (tools/slurm/local_cluster.sh).

``slurm_cluster`` (session): starts the cluster if needed (as root), yields a
``slurm_utils.ClusterInfo`` (``.slurm_conf``, ``.partition`` == "debug",
``.nodes``, ``.env``), and stops it at the end of the session if this session
started it (set ``FSDP_SLURM_KEEP=1`` to keep it). If the cluster cannot be
started the tests FAIL with the reason; they are never skipped.

Every test in this directory gets ``SLURM_CONF`` pointing at this cluster in
``os.environ`` (autouse fixture), so ``sbatch``/``srun``/submitit called from
the test reach it, even when the two-node cluster is up in the same session.
"""

from __future__ import annotations

import pytest

import slurm_utils as _slurm_utils


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        info = _slurm_utils.start_cluster("local")
    except Exception as exc:  # noqa: BLE001 - reported as a failure, not a skip
        pytest.fail(f"could not start the local Slurm test cluster: {exc}", pytrace=False)
    yield info
    _slurm_utils.release_cluster(info)


@pytest.fixture(autouse=True)
def _slurm_conf_for_test(request, monkeypatch):
    # Only tests that need the cluster start it (all of this directory's tests
    # are marked `slurm`); the env var then points at it for this test.
    if request.node.get_closest_marker("slurm") is None:
        return
    info = request.getfixturevalue("slurm_cluster")
    monkeypatch.setenv("SLURM_CONF", info.slurm_conf)


@pytest.fixture
def slurm_utils():
    """The helper module (``wait_for_job``, ``job_state``, ``release_requeued``, ...)."""
    return _slurm_utils
