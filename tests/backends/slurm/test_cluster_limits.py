"""The cluster checks without a cluster: parsing recorded Slurm output, judging chains, reading pending reasons.

The ``debug``/``short`` partition and ``vm`` node lines were recorded from the
project's test Slurm (22.05.8, ``scontrol show partition -o`` / ``show node -o``);
the GPU lines ``g[1-2]``/``g3`` are the same records with a site's GPU fields
(Gres, features, a drained node) filled in. The same parsers run against the
real cluster in tests/slurm/test_cluster_checks.py.
"""

from __future__ import annotations

from pathlib import Path


import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.backends.slurm.cluster_check import check_chain, memory_mb, satisfies, skipped_line
from fsdp_workflow.backends.slurm.cluster_info import (
    Accounting,
    ClusterLimits,
    gres_count,
    parse_assocs,
    parse_config,
    parse_nodes,
    parse_partitions,
    parse_qos,
    parse_sinfo,
    slurm_minutes,
)
from fsdp_workflow.backends.slurm.reasons import explain
from fsdp_workflow.plan.spec import build_plan

PARTITIONS = """\
PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=21694M,node=1,billing=8
PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=00:05:00 MinNodes=1 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=21694M,node=1,billing=8
PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=gpuq DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=2 MaxTime=2-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=g[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=192 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=192,mem=1500G,node=3,billing=192
PartitionName=dead AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=g3 PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=64 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=64,mem=500G,node=1,billing=64
"""
NODES = """\
NodeName=vm Arch=x86_64 CoresPerSocket=8  CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=0.28 AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8 OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=21694 AllocMem=0 FreeMem=23575 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug,short  BootTime=2026-11-25T03:45:35 SlurmdStartTime=2026-11-25T03:49:50 LastBusyTime=2026-11-25T03:49:50 CfgTRES=cpu=8,mem=21694M,billing=8 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
NodeName=g1 Arch=x86_64 CoresPerSocket=32  CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01 AvailableFeatures=a100,ib ActiveFeatures=a100,ib Gres=gpu:a100:4(S:0-1) NodeAddr=g1 NodeHostName=g1 Version=22.05.8 OS=Linux 5.15.0 #1 SMP  RealMemory=512000 AllocMem=0 FreeMem=500000 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  BootTime=2026-11-25T03:45:35 SlurmdStartTime=2026-11-25T03:49:50 CfgTRES=cpu=64,mem=500G,billing=64,gres/gpu=4 AllocTRES= CapWatts=n/a
NodeName=g2 Arch=x86_64 CoresPerSocket=32  CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01 AvailableFeatures=a100 ActiveFeatures=a100 Gres=gpu:a100:4(S:0-1) NodeAddr=g2 NodeHostName=g2 Version=22.05.8 OS=Linux 5.15.0 #1 SMP  RealMemory=512000 AllocMem=0 FreeMem=500000 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  BootTime=2026-11-25T03:45:35 SlurmdStartTime=2026-11-25T03:49:50 CfgTRES=cpu=64,mem=500G,billing=64,gres/gpu=4 AllocTRES= CapWatts=n/a
NodeName=g3 Arch=x86_64 CoresPerSocket=32  CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01 AvailableFeatures=h100 ActiveFeatures=h100 Gres=gpu:h100:8 NodeAddr=g3 NodeHostName=g3 Version=22.05.8 OS=Linux 5.15.0 #1 SMP  RealMemory=1024000 AllocMem=0 FreeMem=500000 Sockets=2 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,dead  BootTime=2026-11-25T03:45:35 SlurmdStartTime=2026-11-25T03:49:50 CfgTRES=cpu=64,mem=1000G,billing=64,gres/gpu=8 AllocTRES= CapWatts=n/a Reason=bad psu [root@2026-11-25T04:00:00]
"""
SINFO = "debug|up|1|idle|vm|none\ndead|up|1|drained|g3|bad psu\n"
CONFIG = "Configuration data as of 2026-11-25T03:53:28\nAccountingStorageEnforce = none\nClusterName             = fsdplocal\n"
QOS = "normal|\nshortq|00:10:00\ngpuq|1-00:00:00\n"
ASSOC = "fsdplocal|root|||normal||\nfsdplocal|root|alice||normal,shortq||\nfsdplocal|proj|alice||normal|normal|\n" \
        "other|x|alice||normal||\n"


def _limits(enforce: str = "none") -> ClusterLimits:
    acct = Accounting(qos=parse_qos(QOS), assocs=parse_assocs(ASSOC, "fsdplocal", "alice"), accounts=["root", "proj"],
                      enforce=frozenset(enforce.split(",")))
    return ClusterLimits(cluster="fsdplocal", user="alice", partitions=parse_partitions(PARTITIONS),
                         nodes=parse_nodes(NODES), sinfo=parse_sinfo(SINFO), accounting=acct)


def _check(tmp_path: Path, *overrides: str, limits: ClusterLimits = None):
    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={tmp_path / 'r'}",
                   *overrides])
    return check_chain(cfg, build_plan(cfg), limits or _limits())


def _text(issues) -> str:
    return "\n".join(i.format() for i in issues)


def test_parsing_recorded_scontrol_output() -> None:
    parts = parse_partitions(PARTITIONS)
    assert parts["short"].max_time_min == 5 and parts["debug"].max_time_min is None and parts["debug"].default
    assert parts["gpu"].max_nodes == 2 and parts["gpu"].max_time_min == 2 * 1440 and parts["gpu"].qos == "gpuq"
    nodes = {n.name: n for n in parse_nodes(NODES)}
    assert (nodes["vm"].cpus, nodes["vm"].memory_mb, nodes["vm"].gpus) == (8, 21694, 0)
    assert nodes["vm"].partitions == {"debug", "short"} and nodes["vm"].usable
    assert nodes["g1"].gpus == 4 and nodes["g1"].features == {"a100", "ib"} and nodes["g3"].gpus == 8
    assert not nodes["g3"].usable and nodes["g2"].usable
    assert parse_config(CONFIG)["ClusterName"] == "fsdplocal"
    assert parse_qos(QOS)["shortq"].max_wall_min == 10 and parse_qos(QOS)["normal"].max_wall_min is None
    assocs = parse_assocs(ASSOC, "fsdplocal", "alice")
    assert {(a.account, a.user) for a in assocs} == {("root", ""), ("root", "alice"), ("proj", "alice")}


@pytest.mark.parametrize("text,minutes", [("30", 30), ("5:30", 5.5), ("01:00:00", 60), ("1-12", 2160),
                                          ("2-00:00:00", 2880), ("UNLIMITED", None), ("INFINITE", None)])
def test_slurm_times(text: str, minutes) -> None:
    assert slurm_minutes(text) == minutes


def test_gres_memory_and_constraints() -> None:
    assert gres_count("gpu:a100:2(S:0),gpu:v100:2") == 4 and gres_count("(null)") == 0
    assert memory_mb("8G") == 8192 and memory_mb("512M") == 512 and memory_mb("1T") == 1024 * 1024
    g1 = next(n for n in parse_nodes(NODES) if n.name == "g1")
    assert satisfies(g1, "a100&ib") and satisfies(g1, "h100|ib") and not satisfies(g1, "h100")
    assert satisfies(g1, "[a100*2&ib]") is None  # counts and brackets are left to Slurm


def test_a_chain_that_fits_has_no_issue(tmp_path: Path) -> None:
    report = _check(tmp_path)
    assert report.errors == [] and report.warnings == []


def test_time_over_maxtime_names_key_limit_source_and_fix(tmp_path: Path) -> None:
    report = _check(tmp_path, "cluster.partition=short", "cluster.time_min=30")
    text = _text(report.errors)
    assert report.keys() == ["cluster.consolidate_time_min", "cluster.time_min"]
    assert "cluster.time_min = 30" in text and "partition 'short': MaxTime=5 min" in text
    assert "fix: cluster.time_min=5 or less, or a partition that allows it: debug" in text
    # prepare and consolidation share one fix: one issue naming both jobs
    assert "the data preparation and consolidation jobs ask for 10 min" in text


def test_every_resource_against_the_largest_fitting_node(tmp_path: Path) -> None:
    report = _check(tmp_path, "cluster.nodes=3", "cluster.cpus_per_task=16", "cluster.mem_gb=900",
                    "cluster.constraint=nosuch", "cluster.consolidate_cpus=9")
    assert set(report.keys()) == {"cluster.nodes", "cluster.constraint", "cluster.consolidate_cpus"}
    report = _check(tmp_path, "cluster.nodes=1", "cluster.cpus_per_task=16", "cluster.mem_gb=900")
    text = _text(report.errors)
    assert "vm: CPUTot=8" in text and "cluster.cpus_per_task=8 or less" in text
    assert "900 GB of memory" in text and "RealMemory=21694 MB" in text and "cluster.mem_gb=21 or less" in text


def test_gpus_maxnodes_and_constraints_on_a_gpu_partition(tmp_path: Path) -> None:
    gpu = ["cluster.partition=gpu", "cluster.device=cuda", "cluster.processes_per_node=4", "cluster.time_min=600",
           "cluster.consolidate_partition=debug"]
    assert _check(tmp_path, *gpu, "cluster.nodes=2").errors == []
    report = _check(tmp_path, *gpu, "cluster.nodes=3")
    assert report.keys() == ["cluster.nodes"] and "MaxNodes=2" in _text(report.errors)
    # 8 GPUs only on g3: a constraint that excludes it makes 8 impossible; processes_per_node is the key
    report = _check(tmp_path, *gpu, "cluster.processes_per_node=8", "cluster.constraint=a100")
    assert report.keys() == ["cluster.processes_per_node"] and "Gres=gpu:4" in _text(report.errors)
    report = _check(tmp_path, *gpu, "cluster.gpus_per_node=8", "cluster.nodes=2")
    assert report.keys() == ["cluster.nodes"] and "only 1 node(s)" in _text(report.errors)
    report = _check(tmp_path, *gpu, "cluster.constraint=v100")
    assert report.keys() == ["cluster.constraint"] and "features a100, h100, ib" in _text(report.errors)


def test_unknown_names_list_what_exists(tmp_path: Path) -> None:
    report = _check(tmp_path, "cluster.partition=nope")
    assert report.keys() == ["cluster.partition"]
    assert "debug (MaxTime=UNLIMITED, 1 node(s)), short (MaxTime=5 min" in _text(report.errors)
    report = _check(tmp_path, "cluster.account=nope", "cluster.qos=nope")
    assert report.keys() == ["cluster.account"] and "root, proj" not in _text(report.errors)
    assert "one of your accounts: proj, root" in _text(report.errors)
    assert _check(tmp_path, "cluster.qos=nope").keys() == ["cluster.qos"]


def test_qos_maxwall_refused_when_enforced_and_a_warning_when_not(tmp_path: Path) -> None:
    over = ["cluster.qos=shortq", "cluster.time_min=20", "cluster.consolidate_time_min=5"]
    report = _check(tmp_path, *over)
    assert report.errors == [] and "QoS 'shortq': MaxWall=10 min" in _text(report.warnings)
    assert "not enforced here" in _text(report.warnings)
    report = _check(tmp_path, *over, limits=_limits("associations,limits,qos"))
    assert report.keys() == ["cluster.time_min"] and "MaxWall=10 min (sacctmgr show qos)" in _text(report.errors)
    # with associations enforced, a QoS outside the user's association is refused too
    assert _check(tmp_path, "cluster.qos=gpuq", limits=_limits("associations")).keys() == ["cluster.qos"]


def test_a_partition_with_every_node_drained_is_a_warning_with_sinfo(tmp_path: Path) -> None:
    report = _check(tmp_path, "cluster.partition=dead")
    assert report.errors == []
    assert "down or drained (sinfo: 1 node(s) drained (g3), partition up, reason: bad psu)" in _text(report.warnings)


@pytest.mark.parametrize("code,never", [
    ("PartitionTimeLimit", True), ("PartitionNodeLimit", True), ("PartitionConfig", True), ("BadConstraints", True),
    ("InvalidAccount", True), ("InvalidQOS", True), ("QOSMaxWallDurationPerJobLimit", True),
    ("AssocMaxWallDurationPerJobLimit", True), ("QOSMaxCpuPerJobLimit", True), ("QOSMaxGRESPerNode", True),
    ("QOSMinCpuNotSatisfied", True),
    ("Priority", False), ("Resources", False), ("Dependency", False), ("BeginTime", False), ("None", False),
    ("QOSMaxJobsPerUserLimit", False), ("QOSMaxCpuPerUserLimit", False), ("AssocGrpCpuLimit", False),
    ("ReqNodeNotAvail, UnavailableNodes:n1", False), ("JobHeldUser", False), ("SomethingNew", False)])
def test_pending_reasons(code: str, never: bool) -> None:
    reason = explain(code)
    assert reason.never is never and reason.words and reason.fix


def test_skipped_line_says_how_to_run_the_checks() -> None:
    line = skipped_line("/runs/my run")
    assert "cluster checks skipped (dry_run=true)" in line
    assert "python -m fsdp_workflow.check '/runs/my run'" in line


