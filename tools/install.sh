#!/usr/bin/env bash
# Install fsdp_workflow and everything its test suite needs, on a fresh machine: the tested set.
#
#   bash tools/install.sh
#
# - The lock: every package is installed at the version the suite passed with
#   (requirements/cpu.txt, or requirements/cuda.txt where nvidia-smi answers: the
#   CUDA torch the GPU checks ran). FSDP_WORKFLOW_LOCK=cpu|cuda chooses; =none installs
#   the newest versions pyproject.toml's ranges allow (what tools/check_newest.sh tries).
#   docs/contributing.md, "Dependencies", says how the lock moves.
# - PyTorch first, from the lock: on CPU-only machines torch==2.13.0 is the CPU build
#   (a local file on the CI machines; an unpinned torch would pull a multi-GB CUDA build).
#   FSDP_WORKFLOW_TORCH_SPEC chooses another spec, or '' to keep the torch you have
#   (then the lock applies to the rest only).
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

lock="${FSDP_WORKFLOW_LOCK:-}"
if [ -z "$lock" ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then lock=cuda; else lock=cpu; fi
fi
constraints=()
case "$lock" in
    cpu|cuda) constraints=(-c "requirements/$lock.txt") ;;
    none) ;;
    *) echo "[install] FSDP_WORKFLOW_LOCK=$lock: expected cpu, cuda or none" >&2; exit 2 ;;
esac
default_torch="torch==$(sed -n 's/^torch==//p' "requirements/${lock/none/cpu}.txt")"
torch_spec="${FSDP_WORKFLOW_TORCH_SPEC-$default_torch}"
if [ -n "$torch_spec" ]; then
    echo "[install] pip install $torch_spec (lock: $lock)" >&2
    "$PY" -m pip install -q "${constraints[@]}" "$torch_spec"
elif [ "$lock" != none ]; then
    # keep the torch that is installed: the lock's other pins still apply
    sed '/^torch==/d' "requirements/$lock.txt" > "${TMPDIR:-/tmp}/fsdp_workflow-lock-$$.txt"
    sed -i "s#^-c common.txt#-c $PWD/requirements/common.txt#" "${TMPDIR:-/tmp}/fsdp_workflow-lock-$$.txt"
    constraints=(-c "${TMPDIR:-/tmp}/fsdp_workflow-lock-$$.txt")
fi
echo "[install] pip install -e .[dev] (lock: $lock)" >&2
"$PY" -m pip install -q "${constraints[@]}" -e ".[dev]"
"$PY" -m fsdp_workflow --version >&2
