#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Run by rank 0 after each committed checkpoint: bash post_checkpoint.sh STEP
set -euo pipefail
RUN_DIR=/runs/smoke
STEP=${1:?usage: bash post_checkpoint.sh STEP}
case "$STEP" in ""|*[!0-9]*) echo "post_checkpoint.sh: STEP must be a number, got $STEP" >&2; exit 2;; esac
# The training job's variables would describe it to the new job; which cluster (SLURM_CONF) stays.
for n in $(compgen -e); do case "$n" in SLURM_CONF) ;; SLURM_*|SBATCH_*|SALLOC_*|SRUN_*|TORCHELASTIC_*) unset "$n";; esac; done
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT TORCH_NCCL_ASYNC_ERROR_HANDLING
src=/runs/smoke/checkpoints/step-$STEP
snap=/runs/smoke/evals/pending/step-$STEP
rm -rf "$snap"; mkdir -p "${snap%/*}"
cp -al "$src" "$snap"
eval_id=$(sbatch --parsable --dependency=singleton --output=/runs/smoke/logs/eval-%j.out /runs/smoke/eval.sbatch "${STEP}")
eval_id=${eval_id%%;*}
echo "eval-step-$STEP $eval_id" >> "$RUN_DIR/jobs.txt"
echo "$eval_id"
