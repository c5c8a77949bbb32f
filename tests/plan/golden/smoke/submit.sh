#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain with plain sbatch, without python -m fsdp_workflow: bash submit.sh
set -euo pipefail
RUN_DIR=/runs/smoke
# One live chain per run directory: a job of jobs.txt still queued or running refuses.
if [ -s "$RUN_DIR/jobs.txt" ]; then
  ids=$(awk 'NF >= 2 {print $2}' "$RUN_DIR/jobs.txt" | paste -sd , -)
  if ! out=$(squeue -h -j "$ids" -o "%i %T %r" 2>&1); then
    case "$out" in *"Invalid job id"*) out="";; *) echo "submit.sh: cannot ask Slurm about the jobs of jobs.txt ($out); nothing submitted" >&2; exit 1;; esac
  fi
  live=$(printf '%s\n' "$out" | awk 'NF >= 2 && $2 !~ /^(BOOT_FAIL|CANCELLED|COMPLETED|DEADLINE|FAILED|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|REVOKED|SPECIAL_EXIT|TIMEOUT)$/')
  if [ -n "$live" ]; then
    echo "submit.sh: a chain of this run directory is still in the queue; nothing submitted:" >&2
    printf '%s\n' "$live" | awk '{print "  job " $1 ": " $2 (NF > 2 ? " (" $3 ")" : "")}' >&2
    echo "follow it: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")" >&2
    echo "or cancel it, then submit again: scancel $(printf '%s\n' "$live" | awk '{print $1}' | paste -sd ' ' -)" >&2
    exit 2
  fi
fi
# A run already complete submits nothing; the model of an earlier, shorter run must be moved first.
guard=0
complete=$(env PYTHONPATH=/runs/smoke/code PYTHONSAFEPATH=1 /opt/venv/bin/python -m fsdp_workflow.launch.chain_guard /runs/smoke --max-steps 30 --consolidates) || guard=$?
if [ "$guard" = 2 ]; then exit 2; fi  # the reason is on stderr
if [ "$guard" != 0 ]; then
  echo "submit.sh: could not tell whether this run is already complete (python -m fsdp_workflow.launch.chain_guard, run by /opt/venv/bin/python, exited $guard; see above); nothing submitted" >&2
  exit 1
fi
if [ -n "$complete" ]; then printf '%s\n' "$complete"; exit 0; fi
mkdir -p /runs/smoke/logs
if ! prepare_id=$(sbatch --parsable --output=/runs/smoke/logs/prepare-%j.out /runs/smoke/prepare.sbatch); then
  echo "submit.sh: sbatch of the data preparation job failed (see the message above); nothing submitted" >&2
  exit 1
fi
prepare_id=${prepare_id%%;*}
if ! train_id=$(sbatch --parsable "--dependency=afterok:${prepare_id}" --kill-on-invalid-dep=yes --output=/runs/smoke/logs/train-%j.out /runs/smoke/train.sbatch); then
  echo "submit.sh: sbatch of the training job failed; cancelling data preparation job $prepare_id" >&2
  scancel "$prepare_id" || true
  exit 1
fi
train_id=${train_id%%;*}
if ! consolidate_id=$(sbatch --parsable "--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes --output=/runs/smoke/logs/consolidate-%j.out /runs/smoke/consolidate.sbatch); then
  echo "submit.sh: sbatch of the consolidation job failed; cancelling data preparation job $prepare_id and training job $train_id" >&2
  scancel "$prepare_id" "$train_id" || true
  exit 1
fi
consolidate_id=${consolidate_id%%;*}
# A chain Slurm will never start (its pending reason says so) is cancelled, not reported submitted.
never_reason() {  # Slurm's reason -> what it means and the fix; status 1 when it is a wait
  local head=${1%%[,(]*}
  head=${head//[[:space:]]/}
  case "$head" in
    PartitionTimeLimit) printf '%s\n' 'the job'"'"'s time limit is above its partition'"'"'s MaxTime; fix: lower the job'"'"'s time (cluster.time_min, cluster.consolidate_time_min) or pick a partition/QoS that allows it'; return 0;;
    PartitionNodeLimit) printf '%s\n' 'the job'"'"'s node count is outside its partition'"'"'s MinNodes/MaxNodes; fix: lower cluster.nodes or pick a partition that allows that many nodes'; return 0;;
    PartitionConfig) printf '%s\n' 'no node of the partition can ever satisfy the request (more nodes, CPUs, memory or GPUs than the partition has); fix: lower the request (cluster.nodes, cluster.cpus_per_task, cluster.mem_gb, cluster.gpus_per_node) or pick a larger partition'; return 0;;
    BadConstraints) printf '%s\n' 'no node has the requested features (--constraint); fix: fix cluster.constraint to features the nodes have (sinfo -o '"'"'%N %f'"'"')'; return 0;;
    InvalidAccount) printf '%s\n' 'the job'"'"'s account is invalid; fix: set cluster.account to one of yours (sacctmgr show assoc user=$USER)'; return 0;;
    InvalidQOS) printf '%s\n' 'the job'"'"'s QoS is invalid; fix: set cluster.qos to one you may use (sacctmgr show assoc user=$USER)'; return 0;;
    AccountNotAllowed) printf '%s\n' 'the job'"'"'s account may not use this partition; fix: ask the cluster'"'"'s admins, or pick another partition/account/QoS'; return 0;;
    QOSNotAllowed) printf '%s\n' 'the job'"'"'s QoS may not use this partition; fix: ask the cluster'"'"'s admins, or pick another partition/account/QoS'; return 0;;
    PartitionInactive) printf '%s\n' 'the partition takes no jobs (State=INACTIVE); fix: ask the cluster'"'"'s admins, or pick another partition/account/QoS'; return 0;;
    DependencyNeverSatisfied) printf '%s\n' 'a job this one waits for failed or was cancelled; fix: see why the earlier job failed, fix it and resubmit'; return 0;;
    QOSMaxWallDurationPerJobLimit) printf '%s\n' 'the job'"'"'s time is above its QoS'"'"'s MaxWall; fix: lower the job'"'"'s time (cluster.time_min, cluster.consolidate_time_min) or pick a partition/QoS that allows it'; return 0;;
    AssocMaxWallDurationPerJobLimit) printf '%s\n' 'the job'"'"'s time is above its association'"'"'s MaxWall; fix: lower the job'"'"'s time (cluster.time_min, cluster.consolidate_time_min) or pick a partition/QoS that allows it'; return 0;;
    *PerUser|*PerAccount) return 1;;
  esac
  local limit='^(QOS|Assoc)(Max[[:alnum:]_]*Per(Job|Node)[[:alnum:]_]*|Min[[:alnum:]_]+)$'
  [[ $head =~ $limit ]] || return 1
  case "$head" in QOS*) printf '%s\n' 'the request is above a per-job or per-node limit of its QoS; fix: lower the request, or use another QoS/account (sacctmgr show qos; sacctmgr show assoc user=$USER)';; *) printf '%s\n' 'the request is above a per-job or per-node limit of its association; fix: lower the request, or use another QoS/account (sacctmgr show qos; sacctmgr show assoc user=$USER)';; esac
}
job_noun() {
  case "$1" in
    "$prepare_id") echo "data preparation job";;
    "$train_id") echo "training job";;
    "$consolidate_id") echo "consolidation job";;
  esac
}
stuck=""
for _ in $(seq 12); do
  out=$(squeue -h -j "$prepare_id,$train_id,$consolidate_id" -o "%i|%T|%r" 2>/dev/null) || break
  stuck=""; settled=1
  while IFS='|' read -r id state reason; do
    [ "$state" = PENDING ] || continue
    case "$reason" in None|"") settled=0;; esac
    if why=$(never_reason "$reason"); then stuck+="  $(job_noun "$id") $id: PENDING ($reason): $why"$'\n'; fi
  done <<< "$out"
  if [ -z "$stuck" ] && [ "$settled" = 1 ]; then break; fi
  sleep 0.5
done
if [ -n "$stuck" ]; then
  scancel "$prepare_id" "$train_id" "$consolidate_id" || true
  echo "submit.sh: Slurm would never start this chain:" >&2
  printf '%s' "$stuck" >&2
  echo "submit.sh: cancelled the whole chain ($prepare_id, $train_id, $consolidate_id): none of it stays in the queue; change the config, plan the run again and resubmit" >&2
  exit 2
fi
echo "prepare $prepare_id" >> "$RUN_DIR/jobs.txt"
echo "train $train_id" >> "$RUN_DIR/jobs.txt"
echo "consolidate $consolidate_id" >> "$RUN_DIR/jobs.txt"
echo "data preparation job: $prepare_id"
echo "training job:      $train_id (afterok:$prepare_id)"
echo "consolidation job: $consolidate_id (afterok:$train_id)"
echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"
