#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain without Python: bash submit.sh
set -euo pipefail
RUN_DIR=/runs/llama8b_zero3
mkdir -p /runs/llama8b_zero3/logs
if ! train_id=$(sbatch --parsable --output=/runs/llama8b_zero3/logs/train-%j.out /runs/llama8b_zero3/train.sbatch); then
  echo "submit.sh: sbatch of the training job failed (see the message above); nothing submitted" >&2
  exit 1
fi
train_id=${train_id%%;*}
if ! consolidate_id=$(sbatch --parsable "--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes --output=/runs/llama8b_zero3/logs/consolidate-%j.out /runs/llama8b_zero3/consolidate.sbatch); then
  echo "submit.sh: sbatch of the consolidation job failed; cancelling training job $train_id" >&2
  scancel "$train_id" || true
  exit 1
fi
consolidate_id=${consolidate_id%%;*}
echo "train $train_id" >> "$RUN_DIR/jobs.txt"
echo "consolidate $consolidate_id" >> "$RUN_DIR/jobs.txt"
echo "training job:      $train_id"
echo "consolidation job: $consolidate_id (afterok:$train_id)"
echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"
