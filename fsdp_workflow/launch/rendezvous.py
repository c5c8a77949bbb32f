"""Where the ranks of a Slurm training job meet: MASTER_ADDR, MASTER_PORT and NCCL presets.

The batch-shell version of the same computation is
:func:`fsdp_workflow.plan.render.rendezvous_lines` (train.sbatch); the submitit
path runs this one inside each task. ``tests/launch`` checks that both agree.
"""

from __future__ import annotations

import os
import subprocess
from typing import Dict, Mapping, Optional


def master_port(job_id: int, master_port_base: int, port_range: int) -> int:
    """A port derived from the job id, so concurrent jobs on a node rarely collide.

    With the defaults (20000 + id % 10000) it stays below Linux's ephemeral range
    (32768+), where the kernel hands out ports to outgoing connections.
    """
    return master_port_base + job_id % port_range


def first_host(nodelist: str, env: Optional[Mapping[str, str]] = None) -> str:
    """The first host of a Slurm node list (``n[1-2]`` -> ``n1``), via ``scontrol show hostnames``.

    Raises:
        RuntimeError: scontrol is missing or cannot expand the list.
    """
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=60, check=True,
                             env=dict(env) if env is not None else None).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol: {err}") from err
    if not out:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} returned no host")
    return out[0]


def rendezvous_env(job_id: int, master_addr: str, master_port_base: int, port_range: int,
                   nccl_env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables every node's launcher needs, as train.sbatch exports them."""
    env = dict(nccl_env or {})
    env["MASTER_ADDR"] = master_addr
    env["MASTER_PORT"] = str(master_port(job_id, master_port_base, port_range))
    return env


def slurm_rendezvous_env(master_port_base: int, port_range: int,
                         nccl_env: Optional[Mapping[str, str]] = None,
                         environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """:func:`rendezvous_env` for the Slurm job this process runs in.

    Raises:
        RuntimeError: not inside a Slurm job (no ``SLURM_JOB_ID``/``SLURM_JOB_NODELIST``).
    """
    environ = os.environ if environ is None else environ
    try:
        job_id = int(environ["SLURM_JOB_ID"])
        nodelist = environ["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError) as err:
        raise RuntimeError("not inside a Slurm job: SLURM_JOB_ID/SLURM_JOB_NODELIST are not set") from err
    return rendezvous_env(job_id, first_host(nodelist, environ), master_port_base, port_range, nccl_env)
