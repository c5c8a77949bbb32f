#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain without Python: bash submit.sh
set -euo pipefail
RUN_DIR=/runs/llama70b_tp
mkdir -p /runs/llama70b_tp/logs
if ! prepare_id=$(sbatch --parsable --output=/runs/llama70b_tp/logs/prepare-%j.out /runs/llama70b_tp/prepare.sbatch); then
  echo "submit.sh: sbatch of the data preparation job failed (see the message above); nothing submitted" >&2
  exit 1
fi
prepare_id=${prepare_id%%;*}
if ! train_id=$(sbatch --parsable "--dependency=afterok:${prepare_id}" --kill-on-invalid-dep=yes --output=/runs/llama70b_tp/logs/train-%j.out /runs/llama70b_tp/train.sbatch); then
  echo "submit.sh: sbatch of the training job failed; cancelling data preparation job $prepare_id" >&2
  scancel "$prepare_id" || true
  exit 1
fi
train_id=${train_id%%;*}
if ! consolidate_id=$(sbatch --parsable "--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes --output=/runs/llama70b_tp/logs/consolidate-%j.out /runs/llama70b_tp/consolidate.sbatch); then
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
