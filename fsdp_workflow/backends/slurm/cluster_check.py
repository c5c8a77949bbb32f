"""Judge every job of a chain against what the cluster allows, before anything is queued.

Slurm accepts a job whose time is above its partition's MaxTime, whose node
count is above the partition's, or whose CPUs no node has, and then keeps it
``PENDING`` forever (PartitionTimeLimit, PartitionNodeLimit, PartitionConfig).
A user finds out the next morning. :func:`check_chain` finds it now: each job of
the chain (data preparation, training, consolidation, evaluation) with its own
resources, against :class:`~fsdp_workflow.backends.slurm.cluster_info.ClusterLimits`.
Each problem is a config :class:`~fsdp_workflow.config.errors.Issue`: the key,
its value, the cluster's limit with where it comes from, and the fix.

Not judged (left to sbatch and the pending-reason watch): QoS/association
TRES limits (MaxTRESPerJob, Grp*), reservations, and constraints with counts or
brackets (``[a*2&b]``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.backends.slurm.cluster_info import ClusterLimits, Node, Partition, slurm_minutes
from fsdp_workflow.core.roles import Role
from fsdp_workflow.plan.jobs import NOUN, LaunchPlan, SbatchJob

CHECK_COMMAND = "python -m fsdp_workflow.check"

# sbatch option -> the cluster.* field that sets it, for the training job and the one-task CPU jobs.
_TRAIN_KEYS = {"partition": "partition", "account": "account", "qos": "qos", "time": "time_min",
               "nodes": "nodes", "cpus-per-task": "cpus_per_task", "mem": "mem_gb",
               "gpus-per-node": "gpus_per_node", "constraint": "constraint"}
_CPU_KEYS = {"partition": "consolidate_partition", "account": "account", "qos": "qos",
             "time": "consolidate_time_min", "nodes": "nodes", "cpus-per-task": "consolidate_cpus",
             "mem": "consolidate_mem_gb"}


def option_key(cfg: WorkflowConfig, job: SbatchJob, option: str) -> Tuple[str, Any]:
    """The config key (and its value) that set ``option`` of ``job``: what a user types to change it.

    Args:
        cfg: the config the plan was built from.
        job: one job of the chain.
        option: an sbatch long option name (``time``).

    Returns:
        ``("cluster.time_min", 30)``; ``cluster.additional_parameters.X`` for options given there.
    """
    c = cfg.cluster
    if option in c.additional_parameters:
        return f"cluster.additional_parameters.{option}", c.additional_parameters[option]
    keys = _TRAIN_KEYS if job.role == Role.train else _CPU_KEYS
    field = keys.get(option)
    if field == "consolidate_partition" and not c.consolidate_partition:
        field = "partition"  # the CPU jobs fall back to cluster.partition
    if field == "gpus_per_node" and c.gpus_per_node is None:
        field = "processes_per_node"  # one GPU per rank unless set
    if field == "nodes" and job.role != Role.train:
        return "(fixed: one node)", 1
    if field is None:
        return f"--{option}", dict(job.options).get(option)
    return f"cluster.{field}", getattr(c, field)


def _options(job: SbatchJob) -> Dict[str, Optional[str]]:
    return dict(job.options)  # the last of a repeated option wins, as for sbatch


def memory_mb(text: str) -> int:
    """sbatch's ``--mem`` (``8G``, ``512M``, ``1T``, ``4096``: MB) in MB."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not m:
        raise ValueError(f"not a memory size: {text!r}")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return int(int(m.group(1)) * scale)


def satisfies(node: Node, constraint: str) -> Optional[bool]:
    """Whether ``node``'s features satisfy ``constraint``; None for forms not judged here (counts, brackets)."""
    if re.search(r"[\[\]()*]", constraint):
        return None
    # & and , both mean AND; | binds weaker (Slurm evaluates left to right, which this matches for flat forms)
    return any(all(f in node.features for f in re.split(r"[&,]", alt) if f)
               for alt in constraint.split("|"))


def _fmt_min(minutes: Optional[float]) -> str:
    if minutes is None:
        return "UNLIMITED"
    return f"{minutes:g} min"


def _jobs_text(jobs: List[SbatchJob]) -> str:
    names = [NOUN[j.role] for j in jobs]
    return (" and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]) + \
        (" job" if len(names) == 1 else " jobs")


class _Collector:
    """Issues grouped by (key, why): the prepare and consolidation jobs share resources and one fix."""

    def __init__(self) -> None:
        self.errors: Dict[Tuple[str, str], Tuple[Any, str, List[SbatchJob]]] = {}
        self.warnings: Dict[Tuple[str, str], Tuple[Any, str, List[SbatchJob]]] = {}

    def add(self, table: Dict, job: SbatchJob, key: str, value: Any, why: str, fix: str) -> None:
        entry = table.setdefault((key, why), (value, fix, []))
        if job not in entry[2]:
            entry[2].append(job)

    def report(self) -> ValidationReport:
        report = ValidationReport()
        for (key, why), (value, fix, jobs) in self.errors.items():
            report.error(key, value, _subject(jobs, why), fix)
        for (key, why), (value, fix, jobs) in self.warnings.items():
            report.warn(key, value, _subject(jobs, why), fix)
        return report


def _subject(jobs: List[SbatchJob], why: str) -> str:
    """``the training job asks ...`` / ``the data preparation and consolidation jobs ask ...``."""
    verb, _, rest = why.partition(" ")
    if len(jobs) > 1 and verb.endswith("s"):
        verb = verb[:-1]
    return f"the {_jobs_text(jobs)} {verb} {rest}"


def _partition_list(limits: ClusterLimits) -> str:
    return ", ".join(f"{p.name} (MaxTime={_fmt_min(p.max_time_min)}, {p.total_nodes} node(s))"
                     for p in limits.partitions.values()) or "none"


def _check_job(cfg: WorkflowConfig, job: SbatchJob, limits: ClusterLimits, out: _Collector) -> None:
    opts = _options(job)
    key = lambda option: option_key(cfg, job, option)  # noqa: E731
    name = opts.get("partition")
    part: Optional[Partition] = limits.partitions.get(name) if name else limits.default_partition
    if part is None:
        k, v = key("partition")
        if name:
            why = f"asks for partition {name!r}, which does not exist (scontrol show partition)"
        else:
            why = "names no partition and the cluster has no default one (scontrol show partition: no Default=YES)"
        out.add(out.errors, job, k, v, why, f"set {k} to one of: {_partition_list(limits)}")
        return
    src = f"partition {part.name!r}"
    others = lambda ok: [p.name for p in limits.partitions.values() if p.name != part.name and ok(p)]  # noqa: E731

    time_min = slurm_minutes(opts["time"]) if opts.get("time") else None
    if time_min is not None and part.max_time_min is not None and time_min > part.max_time_min:
        k, v = key("time")
        longer = others(lambda p: p.max_time_min is None or p.max_time_min >= time_min)
        out.add(out.errors, job, k, v,
                f"asks for {_fmt_min(time_min)}; {src}: MaxTime={_fmt_min(part.max_time_min)} "
                "(Slurm would keep it PENDING with PartitionTimeLimit, forever)",
                f"{k}={int(part.max_time_min)} or less" + (f", or a partition that allows it: {', '.join(longer)}"
                                                           if longer else ""))

    nodes = int(opts.get("nodes") or 1)
    k_nodes, v_nodes = key("nodes")
    if part.max_nodes is not None and nodes > part.max_nodes:
        out.add(out.errors, job, k_nodes, v_nodes, f"asks for {nodes} nodes; {src}: MaxNodes={part.max_nodes} "
                "(PENDING with PartitionNodeLimit, forever)", f"{k_nodes}={part.max_nodes} or fewer")
    elif nodes > part.total_nodes:
        out.add(out.errors, job, k_nodes, v_nodes, f"asks for {nodes} nodes; {src} has {part.total_nodes} "
                "(TotalNodes; PENDING with PartitionConfig, forever)",
                f"{k_nodes}={part.total_nodes} or fewer, or a partition with more nodes")
    if nodes < part.min_nodes:
        out.add(out.errors, job, k_nodes, v_nodes, f"asks for {nodes} node(s); {src}: MinNodes={part.min_nodes}",
                f"a partition without that minimum, or {k_nodes}={part.min_nodes}")

    members = limits.nodes_of(part.name)
    constraint = opts.get("constraint")
    if constraint:
        judged = [satisfies(n, constraint) for n in members]
        if None not in judged and not any(judged):
            k, v = key("constraint")
            feats = sorted({f for n in members for f in n.features})
            out.add(out.errors, job, k, v, f"asks for nodes with {constraint!r}; no node of {src} has it "
                    f"(scontrol show node: features {', '.join(feats) or 'none'})",
                    f"one of those features, or {k}=null" if feats else f"{k}=null, or a partition whose "
                    "nodes have the feature")
        members = [n for n, ok in zip(members, judged) if ok is not False]
    if members:
        _check_nodes(cfg, job, opts, part, members, limits, out)
    _check_accounting(cfg, job, opts, part, time_min, limits, out)


def _check_nodes(cfg: WorkflowConfig, job: SbatchJob, opts: Dict[str, Optional[str]], part: Partition,
                 members: List[Node], limits: ClusterLimits, out: _Collector) -> None:
    """CPUs, memory and GPUs per node against the largest node that satisfies the constraint; node states."""
    key = lambda option: option_key(cfg, job, option)  # noqa: E731
    src = f"partition {part.name!r}"
    constraint = opts.get("constraint")
    nodes = int(opts.get("nodes") or 1)
    k_nodes, v_nodes = key("nodes")

    cpus = int(opts.get("cpus-per-task") or 1)
    mem = memory_mb(opts["mem"]) if opts.get("mem") else None
    gpus = int(opts.get("gpus-per-node") or 0)
    def mem_text(mb: int) -> str:
        return f"{mb // 1024} GB" if mb % 1024 == 0 else f"{mb} MB"

    # (option, amount asked, what a node has, the ask in words, the node's field in words)
    wanted = [("cpus-per-task", cpus, lambda n: n.cpus if part.max_cpus_per_node is None
               else min(n.cpus, part.max_cpus_per_node), lambda x: f"{x} CPUs", lambda x: f"CPUTot={x}"),
              ("mem", mem, lambda n: n.memory_mb if part.max_mem_per_node_mb is None
               else min(n.memory_mb, part.max_mem_per_node_mb), lambda x: f"{mem_text(x)} of memory",
               lambda x: f"RealMemory={x} MB"),
              ("gpus-per-node", gpus, lambda n: n.gpus, lambda x: f"{x} GPUs", lambda x: f"Gres=gpu:{x}")]
    fits = list(members)
    for option, want, has, asked, field in wanted:
        if not want:
            continue
        best = max(members, key=has)
        if want > has(best):
            k, v = key(option)
            fix_value = has(best) // 1024 if option == "mem" else has(best)
            out.add(out.errors, job, k, v,
                    f"asks for {asked(want)} per node; the largest node of {src}"
                    f"{' with ' + repr(constraint) if constraint else ''} is {best.name}: {field(has(best))} "
                    "(scontrol show node)",
                    f"{k}={fix_value} or less" if fix_value else f"{k}=0, or a partition whose nodes have them")
        fits = [n for n in fits if has(n) >= want]
    if fits and len(fits) < nodes <= len(members):
        out.add(out.errors, job, k_nodes, v_nodes, f"asks for {nodes} nodes with these resources; only "
                f"{len(fits)} node(s) of {src} have them ({', '.join(n.name for n in fits)})",
                f"{k_nodes}={len(fits)}, or fewer resources per node")
    if not any(n.usable for n in members):
        said = "; ".join(limits.sinfo.get(part.name, [])) or ", ".join(f"{n.name} {n.state}" for n in members)
        out.add(out.warnings, job, *key("partition"), f"would wait: every node of {src} is down or drained "
                f"(sinfo: {said})", "wait for the admins, or pick another partition")
    elif part.state.upper() != "UP":
        out.add(out.warnings, job, *key("partition"), f"would wait: {src} is {part.state} (scontrol show "
                "partition)", "wait for the admins, or pick another partition")


def _check_accounting(cfg: WorkflowConfig, job: SbatchJob, opts: Dict[str, Optional[str]], part: Partition,
                      time_min: Optional[float], limits: ClusterLimits, out: _Collector) -> None:
    acct = limits.accounting
    if acct is None:
        return
    key = lambda option: option_key(cfg, job, option)  # noqa: E731
    account = opts.get("account")
    mine = sorted({a.account for a in acct.assocs if a.user == limits.user})
    if account and account not in acct.accounts:
        k, v = key("account")
        out.add(out.errors, job, k, v, f"charges account {account!r}, which does not exist (sacctmgr show account)",
                f"{k} one of your accounts: {', '.join(mine) or 'none'}, or null for your default")
        return
    if account and acct.associations_enforced and account not in mine:
        k, v = key("account")
        out.add(out.errors, job, k, v, f"charges account {account!r}; user {limits.user} has no association with "
                "it (sacctmgr show assoc)", f"{k} one of: {', '.join(mine) or 'none'}")
        return
    rows = [a for a in acct.assocs if a.user == limits.user and (not account or a.account == account)
            and a.partition in ("", part.name)]
    qos = opts.get("qos")
    if qos and qos not in acct.qos:
        k, v = key("qos")
        out.add(out.errors, job, k, v, f"asks for QoS {qos!r}, which does not exist (sacctmgr show qos)",
                f"{k} one of: {', '.join(sorted(acct.qos)) or 'none'}, or null for the default")
        return
    allowed = set().union(*(a.qos for a in rows)) if rows else set()
    if qos and acct.associations_enforced and rows and qos not in allowed:
        k, v = key("qos")
        out.add(out.errors, job, k, v, f"asks for QoS {qos!r}; the association of user {limits.user} allows "
                f"{', '.join(sorted(allowed))} (sacctmgr show assoc)", f"{k} one of: {', '.join(sorted(allowed))}")
    if time_min is None:
        return
    effective = qos or next((a.default_qos for a in rows if a.default_qos), "") or ("normal" if "normal" in acct.qos
                                                                                    else "")
    walls = [(f"QoS {q!r}", acct.qos[q].max_wall_min, "sacctmgr show qos") for q in (part.qos, effective)
             if q and q in acct.qos]
    walls += [(f"association {a.account}/{a.user or '-'}", a.max_wall_min, "sacctmgr show assoc") for a in rows[:1]]
    for what, wall, cmd in walls:
        if wall is None or time_min <= wall:
            continue
        k, v = key("time")
        why = f"asks for {_fmt_min(time_min)}; {what}: MaxWall={_fmt_min(wall)} ({cmd})"
        if acct.limits_enforced:
            out.add(out.errors, job, k, v, why + " (PENDING with a MaxWallDurationPerJobLimit reason, forever)",
                    f"{k}={int(wall)} or less, or another QoS (cluster.qos)")
        else:
            out.add(out.warnings, job, k, v, why + "; not enforced here (AccountingStorageEnforce="
                    f"{','.join(sorted(acct.enforce))}), so the job may still run",
                    f"{k}={int(wall)} or less, to be safe if the admins enforce it")


def check_chain(cfg: WorkflowConfig, plan: LaunchPlan, limits: ClusterLimits) -> ValidationReport:
    """Every job of the chain (and the per-checkpoint evaluation job) against the cluster's limits.

    Args:
        cfg: the config the plan was built from (to name keys and values).
        plan: the launch plan.
        limits: what :func:`~fsdp_workflow.backends.slurm.cluster_info.read_cluster` read.

    Returns:
        Errors (the chain could never start) and warnings (it would wait, or a limit is not enforced).
    """
    out = _Collector()
    for job in [*plan.chain, *([plan.eval_job] if plan.eval_job else [])]:
        _check_job(cfg, job, limits, out)
    return out.report()


def skipped_line(run_dir: str, why: str = "dry_run=true") -> str:
    """The line saying the cluster checks did not run, and how to run them (dry runs, no reachable Slurm).

    Args:
        run_dir: the run directory.
        why: why they were skipped.
    """
    import shlex

    return (f"cluster checks skipped ({why}): partition, node and QoS limits were not read. Run them on the login "
            f"node with: {shlex.join([*CHECK_COMMAND.split(), str(run_dir)])} (the submission runs them too)")
