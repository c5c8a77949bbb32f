#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Submit the chain without Python: bash submit.sh
set -euo pipefail
RUN_DIR=/runs/llama8b_zero3
mkdir -p "$RUN_DIR/logs"
train_id=$(sbatch --parsable --output=/runs/llama8b_zero3/logs/train-%j.out /runs/llama8b_zero3/train.sbatch)
train_id=${train_id%%;*}
echo "train $train_id" >> "$RUN_DIR/jobs.txt"
echo "training job:      $train_id"
cons_id=$(sbatch --parsable "--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes --output=/runs/llama8b_zero3/logs/consolidate-%j.out /runs/llama8b_zero3/consolidate.sbatch)
cons_id=${cons_id%%;*}
echo "consolidate $cons_id" >> "$RUN_DIR/jobs.txt"
echo "consolidation job: $cons_id (afterok:$train_id)"
echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"
