#!/bin/bash
# Written by fsdp_workflow; the run directory's config.yaml says what it runs.
# Runs once per node (srun --ntasks-per-node=1). SLURM_NODEID is read here, in the
# task, so every node gets its own rank; the batch shell would expand it to 0.
set -euo pipefail
RUN_DIR=/runs/smoke
set -a; . "$RUN_DIR/launch.env"; set +a
: "${MASTER_ADDR:?MASTER_ADDR is set by train.sbatch (first host of the allocation)}"
: "${MASTER_PORT:?MASTER_PORT is set by train.sbatch (derived from the job id)}"
echo "[fsdp_workflow] host $(hostname) node_rank ${SLURM_NODEID:-0} of 1 master $MASTER_ADDR:$MASTER_PORT" >&2
# torchrun starts each rank in a session of its own: a signal sent to torchrun reaches
# the ranks only if torchrun re-sends it. It re-sends these, then waits this long (s)
# for the ranks to checkpoint and exit before SIGKILL. accelerate launch reads the same.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
# Until torchrun installs its handler, an early SIGUSR2 must not kill the launcher.
trap '' USR2
exec /opt/venv/bin/python -m fsdp_workflow.train.node --nnodes=1 "--node_rank=${SLURM_NODEID:-0}" "--master_addr=${MASTER_ADDR}" "--master_port=${MASTER_PORT}" --rdzv_conf=timeout=600 --nproc_per_node=2 --max_restarts=0 -m fsdp_workflow.train /runs/smoke
