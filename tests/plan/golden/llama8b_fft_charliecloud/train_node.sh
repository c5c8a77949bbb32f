#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Runs once per node (srun --ntasks-per-node=1). SLURM_NODEID is read here, in the
# task, so every node gets its own rank; the batch shell would expand it to 0.
set -euo pipefail
RUN_DIR=/runs/llama8b_fft
set -a; . "$RUN_DIR/launch.env"; set +a
: "${MASTER_ADDR:?MASTER_ADDR is set by train.sbatch (first host of the allocation)}"
: "${MASTER_PORT:?MASTER_PORT is set by train.sbatch (derived from the job id)}"
echo "[fsdp_workflow] host $(hostname) node_rank ${SLURM_NODEID:-0} of 2 master $MASTER_ADDR:$MASTER_PORT" >&2
# torchrun starts each rank in a session of its own: a signal sent to torchrun reaches
# the ranks only if torchrun re-sends it. It re-sends these, then waits this long (s)
# for the ranks to checkpoint and exit before SIGKILL. accelerate launch reads the same.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300
# Until torchrun installs its handler, an early SIGUSR2 must not kill the launcher.
trap '' USR2
exec bash -c 'for n in $(compgen -e); do case "$n" in SLURM_*|MASTER_*|PET_*|TORCHELASTIC_*|ACCELERATE_*|FSDP_*|NCCL_*|TORCH_*|CUDA_*|WORLD_SIZE|RANK|LOCAL_RANK|NODE_RANK|LOCAL_WORLD_SIZE|OMP_NUM_THREADS) ;; PATH|USER) ;; *) unset "$n";; esac; done; exec "$@"' fsdp_workflow-container-env ch-run -b /runs/llama8b_fft -b /shared/data/sft.jsonl -b /shared/models/Meta-Llama-3-8B -c /runs/llama8b_fft /images/fsdp_workflow -- env HF_HUB_OFFLINE=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PYTHONNOUSERSITE=1 PYTHONPATH=/runs/llama8b_fft/code PYTHONSAFEPATH=1 TRITON_CACHE_DIR=/runs/llama8b_fft/.cache/triton XDG_CACHE_HOME=/runs/llama8b_fft/.cache torchrun --nnodes=2 "--node_rank=${SLURM_NODEID:-0}" "--master_addr=${MASTER_ADDR}" "--master_port=${MASTER_PORT}" --rdzv_conf=timeout=600 --nproc_per_node=8 --max_restarts=0 -m fsdp_workflow.train /runs/llama8b_fft
