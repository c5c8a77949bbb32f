#!/bin/bash
# Reference copy (see slurm/README.md, docs/slurm.md): a dry run of +experiment=llama8b_fft writes this into RUN_DIR.
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain without Python: bash submit.sh
set -euo pipefail
RUN_DIR=/scratch/me/llama8b
mkdir -p "$RUN_DIR/logs"
if ! train_id=$(sbatch --parsable --output=/scratch/me/llama8b/logs/train-%j.out /scratch/me/llama8b/train.sbatch); then
  echo "submit.sh: sbatch of the training job failed (see the message above); nothing submitted" >&2
  exit 1
fi
train_id=${train_id%%;*}
if ! cons_id=$(sbatch --parsable "--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes --output=/scratch/me/llama8b/logs/consolidate-%j.out /scratch/me/llama8b/consolidate.sbatch); then
  echo "submit.sh: sbatch of the consolidation job failed; cancelling training job $train_id" >&2
  scancel "$train_id" || true
  exit 1
fi
cons_id=${cons_id%%;*}
echo "train $train_id" >> "$RUN_DIR/jobs.txt"
echo "consolidate $cons_id" >> "$RUN_DIR/jobs.txt"
echo "training job:      $train_id"
echo "consolidation job: $cons_id (afterok:$train_id)"
echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"
