"""The Slurm side of :class:`~fsdp_workflow.backends.base.Backend`: each method asks this package's modules."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from fsdp_workflow.backends.base import JobState, JobStatus
from fsdp_workflow.backends.slurm import submit as slurm_submit
from fsdp_workflow.backends.slurm.live_chain import live_chain_problem
from fsdp_workflow.backends.slurm.cluster_check import check_chain, skipped_line
from fsdp_workflow.backends.slurm.cluster_info import ClusterUnreachable, read_cluster
from fsdp_workflow.backends.slurm.queue import SlurmQueue
from fsdp_workflow.backends.slurm.scripts import render_all
from fsdp_workflow.backends.slurm.status_jobs import job_status
from fsdp_workflow.config.record import RunRecord
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import ClusterKind, WorkflowConfig
from fsdp_workflow.core.lock import Lock
from fsdp_workflow.core.rundir import SUBMIT_SCRIPT, RunDir
from fsdp_workflow.plan.jobs import LaunchPlan
from fsdp_workflow.plan.spec import build_plan


class SlurmBackend:
    """Submits the run directory's own batch scripts with sbatch; reads jobs back with squeue, scontrol, sacct."""

    kind = ClusterKind.slurm.value
    queued = True

    def issues(self, cfg: WorkflowConfig, plan: LaunchPlan) -> ValidationReport:
        """The chain against the cluster's partitions, nodes, QoS and associations, read now.

        Raises:
            ClusterUnreachable: scontrol or sacctmgr is missing or did not answer (a SchedulerUnreachable).
        """
        try:
            limits = read_cluster()
        except ClusterUnreachable as err:
            raise ClusterUnreachable(f"{err}. Run this on a login node of the cluster (scontrol and sacctmgr "
                                     "on PATH).") from None
        report = check_chain(cfg, plan, limits)
        jobs = ", ".join(j.role for j in plan.chain)
        note = f"; {limits.accounting_note}, QoS and associations not checked" if limits.accounting_note else ""
        report.notes.append(f"cluster checks passed on {limits.cluster or 'the cluster'} for every job ({jobs}){note}.")
        return report

    def plan(self, cfg: WorkflowConfig, layout: RunDir) -> LaunchPlan:
        return build_plan(cfg)

    def render(self, plan: LaunchPlan) -> Dict[str, str]:
        return render_all(plan)

    def submit(self, cfg: WorkflowConfig, plan: LaunchPlan, lock: Optional[Lock] = None) -> int:
        """Check, submit and record the chain; never waits for it to run (the lock is the caller's)."""
        return slurm_submit.submit(cfg, plan)

    def states(self, job_ids: Sequence[str]) -> Dict[str, JobState]:
        queue = SlurmQueue()
        return {job_id: queue.state(job_id) for job_id in job_ids}

    def cancel(self, job_ids: Sequence[str]) -> None:
        slurm_submit.cancel(list(job_ids))

    def live(self, layout: RunDir) -> Optional[str]:
        return live_chain_problem(layout.root)

    def dry_run_notes(self, run_dir: str) -> List[str]:
        # the partition/node/QoS limits are read only at submission (or by fsdp_workflow.check)
        return [skipped_line(run_dir)]

    def submit_command(self, layout: RunDir) -> Optional[List[str]]:
        return ["bash", str(layout.script(SUBMIT_SCRIPT))]

    def job_status(self, record: RunRecord, role: str, job_id: str) -> JobStatus:
        return job_status(record, role, job_id)


BACKEND = SlurmBackend()  # found by backends/registry.py
