"""Slurm's pending reasons in words: which mean "wait" and which mean "never".

A job Slurm accepted can sit ``PENDING`` forever: its request is outside what
its partition, QoS or association allows. Slurm shows why in the job's
``Reason`` (squeue ``%r``; the list is Slurm's "Job Reason Codes" page,
https://slurm.schedmd.com/job_reason_codes.html). :func:`explain` turns a code
into a :class:`Reason`: ``never`` means it cannot start under the current
configuration, so the submission cancels the chain
(:mod:`fsdp_workflow.backends.slurm.submit`); the others are a wait, worth showing
(``status`` can use the same table).

Slurm sets a job's reason at its first scheduling pass, and a job waiting on a
dependency shows ``Dependency`` until that is met: the limits of a dependent
job are invisible here, which is why :mod:`fsdp_workflow.backends.slurm.cluster_check`
reads them before submitting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


# After submitting, both routes (launch/pending.py, submit.sh) poll the reasons this long, this often.
WATCH_S = 6.0  # Slurm sets reasons at its first scheduling pass: seconds on a busy controller
POLL_S = 0.5


@dataclass(frozen=True)
class Reason:
    """One pending reason.

    Attributes:
        code: Slurm's code (``PartitionTimeLimit``).
        never: True when the job cannot start without a change to it or to the cluster.
        words: what it means, for a user.
        fix: what to do.
    """

    code: str
    never: bool
    words: str
    fix: str


_ASK_ADMIN = "ask the cluster's admins, or pick another partition/account/QoS"
_TIME = "lower the job's time (cluster.time_min, cluster.consolidate_time_min) or pick a partition/QoS that allows it"

# Codes that mean "never" under the current configuration (Slurm's Job Reason Codes).
_NEVER = {
    "PartitionTimeLimit": ("the job's time limit is above its partition's MaxTime", _TIME),
    "PartitionNodeLimit": ("the job's node count is outside its partition's MinNodes/MaxNodes",
                           "lower cluster.nodes or pick a partition that allows that many nodes"),
    "PartitionConfig": ("no node of the partition can ever satisfy the request (more nodes, CPUs, memory or GPUs "
                        "than the partition has)", "lower the request (cluster.nodes, cluster.cpus_per_task, "
                        "cluster.mem_gb, cluster.gpus_per_node) or pick a larger partition"),
    "BadConstraints": ("no node has the requested features (--constraint)",
                       "fix cluster.constraint to features the nodes have (sinfo -o '%N %f')"),
    "InvalidAccount": ("the job's account is invalid", "set cluster.account to one of yours (sacctmgr show assoc "
                       "user=$USER)"),
    "InvalidQOS": ("the job's QoS is invalid", "set cluster.qos to one you may use (sacctmgr show assoc user=$USER)"),
    "AccountNotAllowed": ("the job's account may not use this partition", _ASK_ADMIN),
    "QOSNotAllowed": ("the job's QoS may not use this partition", _ASK_ADMIN),
    "PartitionInactive": ("the partition takes no jobs (State=INACTIVE)", _ASK_ADMIN),
    "DependencyNeverSatisfied": ("a job this one waits for failed or was cancelled",
                                 "see why the earlier job failed, fix it and resubmit"),
    "QOSMaxWallDurationPerJobLimit": ("the job's time is above its QoS's MaxWall", _TIME),
    "AssocMaxWallDurationPerJobLimit": ("the job's time is above its association's MaxWall", _TIME),
}
# Per-job and per-node maxima of a QoS or an association: the request itself is too large.
_NEVER_PATTERN = re.compile(r"^(QOS|Assoc)(Max\w*Per(Job|Node)\w*|Min\w+)$")
# The same pattern for bash's [[ =~ ]] (POSIX ERE has no \w), rendered into submit.sh.
NEVER_PATTERN_ERE = _NEVER_PATTERN.pattern.replace("\\w", "[[:alnum:]_]")
_LIMIT_WORDS = "the request is above a per-job or per-node limit of its {}"
_LIMIT_FIX = "lower the request, or use another QoS/account (sacctmgr show qos; sacctmgr show assoc user=$USER)"

_WAIT = {
    "Priority": "jobs with a higher priority are ahead of it",
    "Resources": "it waits for nodes to free up",
    "Dependency": "it waits for the job before it in the chain",
    "BeginTime": "its start time has not come yet (a requeued job waits about two minutes)",
    "None": "the scheduler has not looked at it yet",
    "JobHeldUser": "it is held (scontrol release ID lets it start)",
    "JobHeldAdmin": "an admin holds it",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "PartitionDown": "its partition is down",
    "NodeDown": "a node it needs is down",
    "Reservation": "it waits for its reservation",
    "Licenses": "it waits for licenses",
}


def explain(code: str) -> Reason:
    """What a pending reason means, and whether it can ever resolve itself.

    Args:
        code: Slurm's reason (``squeue -o %r``); a reason with detail after it
            (``ReqNodeNotAvail, UnavailableNodes:n1``) is judged by its first word.

    Returns:
        The :class:`Reason`; an unknown code is a wait (never cancel what we cannot read).
    """
    head = code.split(",")[0].split("(")[0].strip()
    if head in _NEVER:
        words, fix = _NEVER[head]
        return Reason(code, True, words, fix)
    if _NEVER_PATTERN.match(head) and not head.endswith(("PerUser", "PerAccount")):
        return Reason(code, True, _LIMIT_WORDS.format("QoS" if head.startswith("QOS") else "association"), _LIMIT_FIX)
    if head.startswith(("QOSGrp", "AssocGrp", "QOSMax", "AssocMax", "MaxJob", "QOSJob", "QOSResource")):
        return Reason(code, False, "a limit shared with your other jobs (or your group's) is reached; "
                      "it starts as they finish", "wait, or cancel some of your other jobs")
    return Reason(code, False, _WAIT.get(head, "Slurm gives this reason"), "wait")


def never_codes() -> dict:
    """``{code: (words, fix)}`` of the codes that always mean "never", for ``submit.sh``'s own watch.

    The per-job limits of a QoS or an association match :data:`NEVER_PATTERN_ERE` instead;
    their words are :func:`limit_words` (their ``...PerUser``/``...PerAccount`` forms are a wait).
    """
    return dict(_NEVER)


def limit_words(owner: str) -> tuple:
    """(words, fix) of a per-job or per-node limit of ``owner`` ("QoS" or "association")."""
    return _LIMIT_WORDS.format(owner), _LIMIT_FIX
