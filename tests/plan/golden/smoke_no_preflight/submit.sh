#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain without Python: bash submit.sh
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
last=$(ls "$RUN_DIR/checkpoints" 2>/dev/null | sed -n "s/^step-\([0-9][0-9]*\)$/\1/p" | sort -n | tail -n 1) || last=""
if [ -d /runs/smoke/hf_model ]; then
  if [ -z "$last" ] || [ "$last" -ge 30 ]; then
    echo "submit.sh: this run is complete (trained to step ${last:-?} of train.max_steps=30); the model is in /runs/smoke/hf_model. Nothing submitted. To train further, plan it again with a larger train.max_steps (checkpoint.resume=auto continues from the newest checkpoint)."
    exit 0
  fi
  echo "submit.sh: /runs/smoke/hf_model holds the model of an earlier, shorter run (step $last of train.max_steps=30); the consolidation never overwrites it. Move it aside first: mv /runs/smoke/hf_model /runs/smoke/hf_model.step-$last; nothing submitted" >&2
  exit 2
fi
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
echo "prepare $prepare_id" >> "$RUN_DIR/jobs.txt"
echo "train $train_id" >> "$RUN_DIR/jobs.txt"
echo "consolidate $consolidate_id" >> "$RUN_DIR/jobs.txt"
echo "data preparation job: $prepare_id"
echo "training job:      $train_id (afterok:$prepare_id)"
echo "consolidation job: $consolidate_id (afterok:$train_id)"
echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"
