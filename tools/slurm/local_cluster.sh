#!/usr/bin/env bash
# Single-node Slurm on localhost for the test suite.
#
#   tools/slurm/local_cluster.sh up      start (idempotent); prints `export SLURM_CONF=...` on stdout
#   tools/slurm/local_cluster.sh down    stop the daemons and delete the state
#   tools/slurm/local_cluster.sh status  exit 0 when up and usable, 3 when down, 1 when broken
#   tools/slurm/local_cluster.sh env     print the export line only
#
# See tools/slurm/README.md. Can run at the same time as two_node_cluster.sh:
# the two clusters use different ports, state directories and SLURM_CONF files.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

NAME=local
D="$FSDP_SLURM_STATE/$NAME"
CONF="$D/etc/slurm.conf"
CLUSTER_NAME=fsdplocal
CTLD_PORT="${FSDP_SLURM_LOCAL_CTLD_PORT:-6817}"
SLURMD_PORT="${FSDP_SLURM_LOCAL_SLURMD_PORT:-6818}"
# Schedulable CPUs: at least 8 even on a 2-core machine. The node is
# deliberately oversubscribed (SlurmdParameters=config_overrides makes slurmd
# trust this number) so that a 2-task training job, its dependent
# consolidation job and per-checkpoint evaluation jobs can all be allocated at
# once; with the real count (2) the small jobs would wait for training to end.
NODE_CPUS="${FSDP_SLURM_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}"

write_conf() {
    local mem first_id
    mem="$(real_memory_mb)"
    first_id="$(next_first_job_id)"
    mkdir -p "$D/etc" "$D/state" "$D/spool" "$D/log"
    cat >"$CONF" <<EOF
# Written by tools/slurm/local_cluster.sh -- single-node test cluster.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST_SHORT(127.0.0.1)
$(shared_conf_lines 127.0.0.1)
NodeName=$HOST_SHORT NodeAddr=127.0.0.1 CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST_SHORT Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

ctld_ok() { SLURM_CONF="$CONF" scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { SLURM_CONF="$CONF" sinfo -h -N -n "$HOST_SHORT" -o '%t' 2>/dev/null | head -1; }
node_idle() { [[ "$(node_state)" =~ ^(idle|mix|alloc)$ ]]; }
srun_ok() { SLURM_CONF="$CONF" timeout 60 srun -p debug -N1 -n1 -t 1 --mem=100 hostname; }

is_up() {
    pid_alive "$D/slurmctld.pid" && pid_alive "$D/slurmd.$HOST_SHORT.pid" && ctld_ok && node_idle
}

stop_daemons() {
    kill_pidfile "$D/slurmd.$HOST_SHORT.pid"
    kill_pidfile "$D/slurmctld.pid"
}

cmd_up() {
    local t0=$SECONDS
    if [[ -f "$CONF" ]] && is_up; then
        log "already up (SLURM_CONF=$CONF)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    need_root
    ensure_slurm_packages
    stop_daemons
    rm -rf "$D"
    ensure_munge
    ensure_accounting
    write_conf
    log "starting slurmctld (port $CTLD_PORT)"
    SLURM_CONF="$CONF" setsid /usr/sbin/slurmctld -i </dev/null >/dev/null 2>&1 9>&-
    wait_for 60 slurmctld ctld_ok || die "slurmctld did not answer; see $D/log/slurmctld.log"
    log "starting slurmd (port $SLURMD_PORT, CPUs=$NODE_CPUS)"
    SLURM_CONF="$CONF" setsid /usr/sbin/slurmd </dev/null >/dev/null 2>&1 9>&-
    wait_for 60 "node idle" node_idle \
        || die "node $HOST_SHORT is '$(node_state)', not idle; see $D/log/slurmd.$HOST_SHORT.log"
    update_etc_symlink
    srun_ok >/dev/null || die "'srun hostname' failed; see $D/log/"
    log "up in $((SECONDS - t0)) s: cluster $CLUSTER_NAME, partition debug, node $HOST_SHORT"
    echo "export SLURM_CONF=$CONF"
}

cmd_down() {
    if [[ -f "$CONF" ]] && pid_alive "$D/slurmctld.pid"; then
        SLURM_CONF="$CONF" timeout 10 scancel -u root >/dev/null 2>&1 || true
    fi
    stop_daemons
    # Job steps left behind by a killed slurmd (proctrack/linuxproc cannot
    # reap them once slurmd is gone): slurmstepd processes of this cluster.
    pkill_stepd "$D"
    rm -rf "$D"
    stop_accounting_if_unused
    update_etc_symlink
    log "down"
}

# Kill slurmstepd processes whose spool dir lies under $1 (ours only).
pkill_stepd() {
    local dir="$1" p
    for p in $(pgrep -x slurmstepd 2>/dev/null); do
        if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q "^SLURM_CONF=$dir/" \
           || ls -l "/proc/$p/cwd" 2>/dev/null | grep -q "$dir/"; then
            kill -KILL "$p" 2>/dev/null || true
        fi
    done
}

cmd_status() {
    if [[ ! -f "$CONF" ]] && ! pid_alive "$D/slurmctld.pid"; then
        echo "local cluster: down"; return 3
    fi
    echo "local cluster: SLURM_CONF=$CONF"
    echo "slurmctld: $(pid_alive "$D/slurmctld.pid" && echo "pid $(cat "$D/slurmctld.pid")" || echo dead)"
    echo "slurmd:    $(pid_alive "$D/slurmd.$HOST_SHORT.pid" && echo "pid $(cat "$D/slurmd.$HOST_SHORT.pid")" || echo dead)"
    [[ "$FSDP_SLURM_ACCOUNTING" == slurmdbd ]] && echo "slurmdbd:  $(dbd_up && echo up || echo down)"
    SLURM_CONF="$CONF" sinfo -N -l 2>/dev/null || true
    if is_up; then echo "status: up"; return 0; fi
    echo "status: broken (run: $0 down && $0 up)"; return 1
}

case "${1:-}" in
    up) take_lock; cmd_up ;;
    down) take_lock; cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 {up|down|status|env}" >&2; exit 2 ;;
esac
