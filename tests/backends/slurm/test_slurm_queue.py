"""The one reader of Slurm's queue (backends/slurm/queue.py), on lines copied from the real test cluster.

Every line below was printed by Slurm 22.05 of tests/slurm's single-node cluster
(tools/slurm/local_cluster.sh): a held job named with a space and logging into a
directory with a space, a job pending on its dependency, a running one, a finished
one, and the same held job once cancelled. Pure parsing: no Slurm is started.
"""

from __future__ import annotations

import subprocess

import pytest

from fsdp_workflow.backends.slurm import queue as slurm_queue
from fsdp_workflow.backends.slurm.queue import (
    TERMINAL_STATES,
    JobState,
    SlurmQueue,
    SlurmUnreachable,
    parse_record,
    parse_sacct,
    parse_squeue,
)

# squeue -h -j 2,3,4,5 -o '%i|%T|%r' (job 5 had finished and left the queue)
SQUEUE = "3|PENDING|Dependency\n2|PENDING|JobHeldUser\n4|RUNNING|None\n"
# scontrol -o show job 2, held, then cancelled
HELD = ("JobId=2 JobName=w40 held UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=0 Nice=0 Account=root "
        "QOS=normal JobState=PENDING Reason=JobHeldUser Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
        "Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-27T21:55:59 "
        "EligibleTime=Unknown AccrueTime=Unknown StartTime=Unknown EndTime=Unknown Deadline=N/A SuspendTime=None "
        "SecsPreSuspend=0 LastSchedEval=2026-11-27T21:55:59 Scheduler=Main Partition=debug "
        "AllocNode:Sid=localhost:25838 ReqNodeList=(null) ExcNodeList=(null) NodeList= NumNodes=1 NumCPUs=1 "
        "NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=1G,node=1,billing=1 Socks/Node=* "
        "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryCPU=1G MinTmpDiskNode=0 Features=(null) "
        "DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
        "WorkDir=/work/main StdErr=/tmp/w40/out dir/h-2.log StdIn=/dev/null StdOut=/tmp/w40/out dir/h-2.log "
        "Power= \n")
CANCELLED = HELD.replace("JobState=PENDING", "JobState=CANCELLED")
# scontrol show partition -o
PARTITION = ("PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
             "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
             "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm PriorityJobFactor=1 "
             "PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP "
             "TotalCPUs=8 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED "
             "MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=21694M,node=1,billing=8\n")
# sacct -n -P -X -j 5 -o JobID,State,ExitCode,Reason
SACCT = "5|COMPLETED|0:0|None\n"
# squeue and scontrol on an id slurmctld has forgotten: exit 1, this on stderr
FORGOTTEN = "slurm_load_jobs error: Invalid job id specified\n"


def test_squeue_lines_give_each_job_its_state_and_reason() -> None:
    queue = parse_squeue(SQUEUE)
    assert list(queue) == ["3", "2", "4"]
    assert (queue["3"].state, queue["3"].reason) == (JobState.PENDING, "Dependency")
    assert (queue["2"].state, queue["2"].reason) == (JobState.PENDING, "JobHeldUser")
    assert queue["4"].state is JobState.RUNNING and not queue["4"].state.ended


def test_scontrol_records_keep_values_with_spaces_and_odd_keys() -> None:
    rec = parse_record(HELD)
    assert rec["JobName"] == "w40 held" and rec["StdOut"] == "/tmp/w40/out dir/h-2.log"
    assert rec["JobState"] == "PENDING" and rec["Reason"] == "JobHeldUser" and rec["Restarts"] == "0"
    assert rec["AllocNode:Sid"] == "localhost:25838" and rec["CPUs/Task"] == "1"
    assert rec["TRES"] == "cpu=1,mem=1G,node=1,billing=1" and rec["Power"] == "" and rec["NodeList"] == ""
    part = parse_record(PARTITION)
    assert (part["PartitionName"], part["MaxTime"], part["State"], part["TotalNodes"]) == ("debug", "UNLIMITED",
                                                                                         "UP", "1")


def test_sacct_line_reads_as_scontrol_keys_it() -> None:
    assert parse_sacct(SACCT, "5") == {"JobState": "COMPLETED", "ExitCode": "0:0", "Reason": "None"}
    assert parse_sacct(SACCT, "6") is None


@pytest.mark.parametrize("text, state, word, ended", [
    ("PENDING", JobState.PENDING, "queued", False),
    ("REQUEUE_HOLD", JobState.REQUEUE_HOLD, "requeued", False),
    ("RUNNING", JobState.RUNNING, "running", False),
    ("COMPLETED", JobState.COMPLETED, "done", True),
    ("CANCELLED by 0", JobState.CANCELLED, "cancelled", True),  # sacct's form
    ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY, "failed", True),
    ("COMPLETED+", JobState.COMPLETED, "done", True),
    ("", JobState.UNKNOWN, "unknown", False),
    ("SOMETHING_NEW", JobState.UNKNOWN, "unknown", False),
])
def test_one_state_vocabulary(text: str, state: JobState, word: str, ended: bool) -> None:
    assert JobState.parse(text) is state and state.word == word and state.ended is ended


def test_terminal_states_are_the_ended_ones_as_submit_sh_renders_them() -> None:
    assert TERMINAL_STATES == ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                               "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT")


def test_the_queue_reads_slurms_answers_and_says_when_it_cannot(monkeypatch) -> None:
    """The commands' answers as Slurm gave them (stubbed: no cluster), through SlurmQueue."""
    answers = {}

    def run(argv, timeout_s):
        rc, out, err = answers[argv[0]]
        return subprocess.CompletedProcess(argv, rc, out, err)

    monkeypatch.setattr(slurm_queue, "_run", run)
    answers.update(squeue=(0, SQUEUE, ""), scontrol=(0, CANCELLED, ""), sacct=(0, SACCT, ""))
    q = SlurmQueue()
    assert [j.state for j in q.squeue(["2", "3", "4"]).values()] == [JobState.PENDING] * 2 + [JobState.RUNNING]
    assert q.state("2") is JobState.CANCELLED and q.sacct("5") == (parse_sacct(SACCT, "5"), "")
    answers.update(squeue=(1, "", FORGOTTEN), scontrol=(1, "", FORGOTTEN))
    assert q.squeue(["9"]) == {} and q.show_job("9") is None and q.state("9") is JobState.UNKNOWN
    answers.update(squeue=(1, "", "slurm_load_jobs error: Unable to contact slurm controller\n"),
                   sacct=(1, "", "sacct: error: Slurm accounting storage is disabled\n"))
    with pytest.raises(SlurmUnreachable, match="Unable to contact"):
        q.squeue(["2"])
    assert q.sacct("5") == (None, "sacct: job accounting is disabled on this cluster")
