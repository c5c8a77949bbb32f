"""What the cluster allows, read from Slurm's own commands into typed objects.

:mod:`fsdp_workflow.backends.slurm.cluster_check` judges a chain against these before
anything is submitted. Every command is an argument list with a timeout; the
``parse_*`` functions take the commands' text, so they are tested on recorded
output (``tests/launch/test_cluster_info.py``) as well as on the test cluster.

Sources (all one line per record, ``-o``/``-P``, stable across Slurm releases):

- ``scontrol show partition -o``: MaxTime, MaxNodes, MinNodes, TotalNodes, State, QoS
- ``scontrol show node -o``: CPUTot, RealMemory, Gres, AvailableFeatures, State, Partitions
- ``scontrol show config``: ClusterName, AccountingStorageEnforce
- ``sinfo``: what a user would see for a partition whose nodes are all down
- ``sacctmgr -nP show qos / assoc`` (when accounting answers): QoS names and MaxWall,
  the user's associations (accounts, allowed QoS, default QoS, MaxWall)
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence

from fsdp_workflow.backends.slurm.queue import SlurmUnreachable, parse_record

COMMAND_TIMEOUT_S = 20  # a login node's slurmctld may be slow; never hang a submission on it

_UNLIMITED = {"UNLIMITED", "INFINITE", "NONE", "N/A", ""}


class ClusterUnreachable(SlurmUnreachable):
    """A Slurm command reading the cluster's limits is missing or did not answer; the message says which and why."""


def run_slurm(argv: Sequence[str]) -> str:
    """Run one read-only Slurm command; return its stdout.

    Raises:
        ClusterUnreachable: the command is missing, timed out, or exited non-zero.
    """
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError as err:
        raise ClusterUnreachable(f"{argv[0]} not found on PATH") from err
    except subprocess.TimeoutExpired as err:
        raise ClusterUnreachable(f"`{' '.join(argv)}` did not answer within {COMMAND_TIMEOUT_S} s") from err
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
        raise ClusterUnreachable(f"`{' '.join(argv)}` failed: {msg}")
    return proc.stdout


def slurm_minutes(text: str) -> Optional[float]:
    """A Slurm time (``30``, ``5:00``, ``01:00:00``, ``1-12``, ``2-00:00:00``) in minutes; None: unlimited.

    Follows sbatch's ``--time`` forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``. scontrol and sacctmgr print ``[D-]HH:MM:SS``.

    Raises:
        ValueError: not a Slurm time.
    """
    text = text.strip()
    if text.upper() in _UNLIMITED:
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(p) for p in text.split(":")]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, minutes, seconds = 0, parts[0], parts[1]
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        else:
            raise ValueError(f"not a Slurm time: {text!r}")
    return days * 1440 + hours * 60 + minutes + seconds / 60


def slurm_count(text: str) -> Optional[int]:
    """``UNLIMITED`` -> None, ``4`` -> 4."""
    text = text.strip()
    return None if text.upper() in _UNLIMITED else int(text)


def gres_count(gres: str, name: str = "gpu") -> int:
    """How many ``name`` GRES a node declares: ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:a:2,gpu:b:2`` -> 4, 4, 4."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] == name and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


@dataclass(frozen=True)
class Node:
    """One node as ``scontrol show node -o`` describes it."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int
    features: FrozenSet[str]
    state: str
    partitions: FrozenSet[str]

    @property
    def usable(self) -> bool:
        """False for a node that takes no new job now (down, drained or draining, failing, not responding)."""
        return not any(s in self.state.upper() for s in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "FUTURE",
                                                          "INVAL", "POWERED_DOWN", "MAINT"))


@dataclass(frozen=True)
class Partition:
    """One partition as ``scontrol show partition -o`` describes it."""

    name: str
    max_time_min: Optional[float]
    max_nodes: Optional[int]
    min_nodes: int
    total_nodes: int
    state: str
    default: bool
    qos: Optional[str]
    max_cpus_per_node: Optional[int]
    max_mem_per_node_mb: Optional[int]


@dataclass(frozen=True)
class Qos:
    """One QoS from ``sacctmgr show qos``."""

    name: str
    max_wall_min: Optional[float]


@dataclass(frozen=True)
class Assoc:
    """One association of the user (or of an account, ``user`` empty) from ``sacctmgr show assoc``."""

    account: str
    user: str
    partition: str
    qos: FrozenSet[str]
    default_qos: str
    max_wall_min: Optional[float]


@dataclass
class Accounting:
    """What slurmdbd says; None on :class:`ClusterLimits` when accounting does not answer."""

    qos: Dict[str, Qos]
    assocs: List[Assoc]  # the user's own rows and their accounts' rows
    accounts: List[str]
    enforce: FrozenSet[str]  # AccountingStorageEnforce: associations, limits, qos, safe, ...

    @property
    def limits_enforced(self) -> bool:
        """QoS and association limits (MaxWall) hold jobs only with ``limits`` or ``safe``."""
        return bool(self.enforce & {"limits", "safe"})

    @property
    def associations_enforced(self) -> bool:
        """An account or QoS outside the user's associations is refused only with enforcement."""
        return bool(self.enforce & {"associations", "limits", "safe", "qos"})


@dataclass
class ClusterLimits:
    """Everything the checks read, in one place."""

    cluster: str
    user: str
    partitions: Dict[str, Partition]
    nodes: List[Node]
    sinfo: Dict[str, List[str]] = field(default_factory=dict)  # partition -> sinfo's lines for it
    accounting: Optional[Accounting] = None
    accounting_note: str = ""  # why accounting is missing, when it is

    @property
    def default_partition(self) -> Optional[Partition]:
        return next((p for p in self.partitions.values() if p.default), None)

    def nodes_of(self, partition: str) -> List[Node]:
        return [n for n in self.nodes if partition in n.partitions]


def _set(text: str) -> FrozenSet[str]:
    return frozenset(x for x in text.split(",") if x and x != "(null)")


def parse_partitions(text: str) -> Dict[str, Partition]:
    """``scontrol show partition -o`` as partitions by name."""
    out: Dict[str, Partition] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        r = parse_record(line)
        mem = r.get("MaxMemPerNode", "UNLIMITED")
        out[r["PartitionName"]] = Partition(
            name=r["PartitionName"],
            max_time_min=slurm_minutes(r.get("MaxTime", "UNLIMITED")),
            max_nodes=slurm_count(r.get("MaxNodes", "UNLIMITED")),
            min_nodes=slurm_count(r.get("MinNodes", "0")) or 0,
            total_nodes=int(r.get("TotalNodes", "0")),
            state=r.get("State", "UP"),
            default=r.get("Default", "NO") == "YES",
            qos=None if r.get("QoS", "N/A") in _UNLIMITED else r["QoS"],
            max_cpus_per_node=slurm_count(r.get("MaxCPUsPerNode", "UNLIMITED")),
            max_mem_per_node_mb=slurm_count(mem) if mem.isdigit() or mem.upper() in _UNLIMITED else None,
        )
    return out


def parse_nodes(text: str) -> List[Node]:
    """``scontrol show node -o`` as nodes."""
    out: List[Node] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        r = parse_record(line)
        out.append(Node(
            name=r["NodeName"],
            cpus=int(r.get("CPUTot", "0")),
            memory_mb=int(r.get("RealMemory", "0")),
            gpus=gres_count(r.get("Gres", "(null)")),
            features=_set(r.get("AvailableFeatures", "(null)")),
            state=r.get("State", "UNKNOWN"),
            partitions=_set(r.get("Partitions", "")),
        ))
    return out


def parse_config(text: str) -> Dict[str, str]:
    """``scontrol show config`` (``Key = Value`` lines) as a dict."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


QOS_FORMAT = "Name,MaxWall"
ASSOC_FORMAT = "Cluster,Account,User,Partition,QOS,DefaultQOS,MaxWall"


def parse_qos(text: str) -> Dict[str, Qos]:
    """``sacctmgr -nP show qos format=Name,MaxWall``."""
    out: Dict[str, Qos] = {}
    for line in text.splitlines():
        if line.strip():
            name, wall = (line.split("|") + [""])[:2]
            out[name] = Qos(name, slurm_minutes(wall))
    return out


def parse_assocs(text: str, cluster: str, user: str) -> List[Assoc]:
    """``sacctmgr -nP show assoc format=Cluster,Account,User,Partition,QOS,DefaultQOS,MaxWall``: the user's rows.

    Account rows (``User`` empty) of the user's accounts are kept too: a user row
    without its own MaxWall inherits the account's.
    """
    rows = [(line.split("|") + [""] * 7)[:7] for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if not cluster or r[0] == cluster]
    mine = {r[1] for r in rows if r[2] == user}
    return [Assoc(account=r[1], user=r[2], partition=r[3], qos=_set(r[4]), default_qos=r[5],
                  max_wall_min=slurm_minutes(r[6]))
            for r in rows if r[2] == user or (not r[2] and r[1] in mine)]


def parse_sinfo(text: str) -> Dict[str, List[str]]:
    """``sinfo -h -o %R|%a|%D|%T|%N|%E`` as readable lines per partition."""
    out: Dict[str, List[str]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 6:
            name, avail, count, state, nodes, reason = parts[:6]
            reason = "" if reason in ("none", "") else f", reason: {reason}"
            out.setdefault(name, []).append(f"{count} node(s) {state} ({nodes}), partition {avail}{reason}")
    return out


def current_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def read_accounting(cluster: str, user: str, enforce: str) -> Accounting:
    """QoS, the user's associations and the accounts, from slurmdbd.

    Raises:
        ClusterUnreachable: sacctmgr is missing or slurmdbd does not answer.
    """
    qos = parse_qos(run_slurm(["sacctmgr", "-nP", "show", "qos", f"format={QOS_FORMAT}"]))
    assocs = parse_assocs(run_slurm(["sacctmgr", "-nP", "show", "assoc", f"format={ASSOC_FORMAT}"]),
                          cluster, user)
    accounts = [line.strip() for line in run_slurm(["sacctmgr", "-nP", "show", "account", "format=Account"]
                                                   ).splitlines() if line.strip()]
    return Accounting(qos=qos, assocs=assocs, accounts=accounts,
                      enforce=frozenset(e.strip() for e in enforce.lower().split(",") if e.strip()))


def read_cluster() -> ClusterLimits:
    """Read the partitions, nodes and (where accounting answers) the QoS and associations.

    Raises:
        ClusterUnreachable: ``scontrol`` is missing or slurmctld does not answer.
    """
    config = parse_config(run_slurm(["scontrol", "show", "config"]))
    partitions = parse_partitions(run_slurm(["scontrol", "show", "partition", "-o"]))
    nodes = parse_nodes(run_slurm(["scontrol", "show", "node", "-o"]))
    try:
        sinfo = parse_sinfo(run_slurm(["sinfo", "-h", "-o", "%R|%a|%D|%T|%N|%E"]))
    except ClusterUnreachable:
        sinfo = {}
    limits = ClusterLimits(cluster=config.get("ClusterName", ""), user=current_user(), partitions=partitions,
                           nodes=nodes, sinfo=sinfo)
    if "none" in config.get("AccountingStorageType", "none"):
        limits.accounting_note = "accounting is off (AccountingStorageType=accounting_storage/none)"
        return limits
    try:
        limits.accounting = read_accounting(limits.cluster, limits.user,
                                            config.get("AccountingStorageEnforce", "none"))
    except ClusterUnreachable as err:
        limits.accounting_note = f"accounting did not answer ({err})"
    return limits
