#!/usr/bin/env bash
# Install fsdp_workflow and everything its test suite needs, on a fresh machine.
#
#   bash tools/install.sh
#
# - PyTorch: if torch is not importable yet, install torch==2.13.0. On CPU-only
#   machines (no nvidia-smi) that is the CPU build; on GPU machines pip picks
#   the CUDA build. Set FSDP_WORKFLOW_TORCH_SPEC to choose another, e.g.
#   FSDP_WORKFLOW_TORCH_SPEC='torch==2.13.0' or '' to keep what you have.
# - The project, editable, with its test extras.
# - As root with apt-get (CI, test machines): the Debian packages the tests run
#   for real: slurm-wlm, slurmdbd, munge and mariadb-server (a local Slurm
#   with accounting, so sacct and submitit's polling work), iproute2 and
#   iputils-ping (the two-node cluster), bubblewrap (container isolation),
#   tmux (the status screen test reads an 80-column pane).
#   Skip with FSDP_WORKFLOW_SKIP_APT=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ "${FSDP_WORKFLOW_SKIP_APT:-0}" != 1 ]; then
    pkgs=(slurm-wlm slurmdbd munge mariadb-server iproute2 iputils-ping bubblewrap tmux)
    missing=()
    for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "[install] apt-get install ${missing[*]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

torch_spec="${FSDP_WORKFLOW_TORCH_SPEC-torch==2.13.0}"
if ! "$PY" -c "import torch" 2>/dev/null && [ -n "$torch_spec" ]; then
    echo "[install] pip install $torch_spec" >&2
    "$PY" -m pip install -q "$torch_spec"
fi
echo "[install] pip install -e .[dev]" >&2
"$PY" -m pip install -q -e ".[dev]"
"$PY" -c "import fsdp_workflow, torch, transformers, accelerate, hydra, submitit; print('[install] ok: torch', torch.__version__)"
