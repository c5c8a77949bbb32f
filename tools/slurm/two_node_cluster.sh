#!/usr/bin/env bash
# Two-node virtual Slurm cluster on one machine, for the multi-node tests.
#
#   tools/slurm/two_node_cluster.sh up      start (idempotent); prints `export SLURM_CONF=...` on stdout
#   tools/slurm/two_node_cluster.sh down    stop daemons, delete namespaces, bridge, /etc/hosts lines, state
#   tools/slurm/two_node_cluster.sh status  exit 0 when up and usable, 3 when down, 1 when broken
#   tools/slurm/two_node_cluster.sh env     print the export line only
#
# Nodes n1 (10.77.0.11) and n2 (10.77.0.12) live in network namespaces joined
# by the bridge fsdpbr0 (10.77.0.1/24); slurmctld runs in the root namespace.
# Each slurmd runs in its own network + UTS + mount namespace: `hostname` is nX
# and /etc/slurm is bind-mounted to this cluster's config, so jobs on the nodes
# reach this cluster even with a cleaned environment (no SLURM_CONF);
# /etc/resolv.conf is bind-mounted to a resolver that fails fast.
# Runs alongside local_cluster.sh: other ports (6827/6828), other SLURM_CONF.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

NAME=two_node
D="$FSDP_SLURM_STATE/$NAME"
CONF="$D/etc/slurm.conf"
CLUSTER_NAME=fsdp2node
CTLD_PORT="${FSDP_SLURM_2N_CTLD_PORT:-6827}"
SLURMD_PORT="${FSDP_SLURM_2N_SLURMD_PORT:-6828}"
BRIDGE=fsdpbr0
NET=10.77.0
NODES=(n1 n2)
HOSTS_MARK="# fsdp_workflow two_node_cluster"
# Oversubscribed on purpose, like the single-node cluster: both "nodes" share
# this machine's cores, and small dependent jobs must fit beside training.
NODE_CPUS="${FSDP_SLURM_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}"

node_ip() { case "$1" in n1) echo "$NET.11" ;; n2) echo "$NET.12" ;; esac; }

net_up() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr show dev "$BRIDGE" | grep -q "$NET.1/24" || ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local n ip
    for n in "${NODES[@]}"; do
        ip="$(node_ip "$n")"
        [[ -e "/var/run/netns/$n" ]] || ip netns add "$n"
        if ! ip link show "veth-$n" >/dev/null 2>&1; then
            ip link add "veth-$n" type veth peer name eth0 netns "$n"
        fi
        ip link set "veth-$n" master "$BRIDGE" up
        ip -n "$n" addr show dev eth0 | grep -q "$ip/24" || ip -n "$n" addr add "$ip/24" dev eth0
        ip -n "$n" link set lo up
        ip -n "$n" link set eth0 up
        ip -n "$n" route replace default via "$NET.1"
    done
    # /etc/hosts: n1/n2 must resolve everywhere (MASTER_ADDR=n1 in jobs).
    if ! grep -q "$HOSTS_MARK" /etc/hosts; then
        {
            for n in "${NODES[@]}"; do printf '%s %s %s\n' "$(node_ip "$n")" "$n" "$HOSTS_MARK"; done
        } >>/etc/hosts
    fi
    ip netns exec n1 ping -c1 -W2 "$NET.12" >/dev/null 2>&1 || die "n1 cannot reach n2 over $BRIDGE"
}

net_down() {
    local n p
    for n in "${NODES[@]}"; do
        if [[ -e "/var/run/netns/$n" ]]; then
            # Everything still running in the namespace was started by this cluster.
            for p in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
            ip netns del "$n" 2>/dev/null || true
        fi
        ip link del "veth-$n" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
        # Rewrite in place (cp, not mv: /etc/hosts may be a bind mount).
        grep -v "$HOSTS_MARK" /etc/hosts >"$FSDP_SLURM_STATE/hosts.tmp" || true
        cp "$FSDP_SLURM_STATE/hosts.tmp" /etc/hosts && rm -f "$FSDP_SLURM_STATE/hosts.tmp"
    fi
}

write_conf() {
    local mem first_id n
    mem="$(real_memory_mb)"
    first_id="$(next_first_job_id)"
    mkdir -p "$D/etc" "$D/state" "$D/spool" "$D/log"
    cat >"$CONF" <<EOF
# Written by tools/slurm/two_node_cluster.sh -- two-node test cluster.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST_SHORT($NET.1)
$(shared_conf_lines "$NET.1")
# Both nodes share this machine's memory: RealMemory is overcommitted.
EOF
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeAddr=$(node_ip "$n") NodeHostname=$n CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF"
}

start_slurmd() { # node
    local n="$1"
    # No DNS server is reachable from the namespaces: without this, lookups
    # that /etc/hosts cannot answer (c10d resolves IPv4-mapped IPv6 peer
    # addresses) wait for the resolver timeout, ~10 s per rendezvous. A
    # resolver on the namespace's own loopback fails at once instead.
    printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$D/resolv.conf"
    # Not `ip netns exec`: it remounts /sys and slurmd then fails on cgroups.
    SLURM_CONF="$CONF" nsenter --net="/var/run/netns/$n" \
        unshare --uts --mount --propagation private \
        sh -c 'hostname "$1" && mount --bind "$2" /etc/slurm && mount --bind "$3" /etc/resolv.conf && exec setsid /usr/sbin/slurmd -N "$1" </dev/null >/dev/null 2>&1' \
        sh "$n" "$D/etc" "$D/resolv.conf" 9>&-
}

ctld_ok() { SLURM_CONF="$CONF" scontrol ping 2>/dev/null | grep -q 'is UP'; }
nodes_idle() {
    local states
    states="$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)"
    [[ "$(grep -cE '^n[12] (idle|mix|alloc)$' <<<"$states")" == 2 ]]
}
srun_ok() {
    local out
    out="$(SLURM_CONF="$CONF" timeout 60 srun -p debug -N2 --ntasks-per-node=1 -t 1 --mem=100 hostname)" || return 1
    [[ "$(sort <<<"$out" | tr '\n' ' ')" == "n1 n2 " ]]
}

is_up() {
    pid_alive "$D/slurmctld.pid" && pid_alive "$D/slurmd.n1.pid" && pid_alive "$D/slurmd.n2.pid" \
        && [[ -e /var/run/netns/n1 && -e /var/run/netns/n2 ]] && ctld_ok && nodes_idle
}

stop_daemons() {
    local n
    for n in "${NODES[@]}"; do kill_pidfile "$D/slurmd.$n.pid"; done
    kill_pidfile "$D/slurmctld.pid"
}

cmd_up() {
    local t0=$SECONDS n
    if [[ -f "$CONF" ]] && is_up; then
        log "already up (SLURM_CONF=$CONF)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    need_root
    ensure_slurm_packages
    ensure_packages ip:iproute2 nsenter:util-linux ping:iputils-ping
    stop_daemons
    net_down
    rm -rf "$D"
    ensure_munge
    ensure_accounting
    net_up
    write_conf
    log "starting slurmctld (port $CTLD_PORT, address $NET.1)"
    SLURM_CONF="$CONF" setsid /usr/sbin/slurmctld -i </dev/null >/dev/null 2>&1 9>&-
    wait_for 60 slurmctld ctld_ok || die "slurmctld did not answer; see $D/log/slurmctld.log"
    for n in "${NODES[@]}"; do
        log "starting slurmd $n ($(node_ip "$n"):$SLURMD_PORT, CPUs=$NODE_CPUS)"
        start_slurmd "$n"
    done
    wait_for 60 "nodes idle" nodes_idle \
        || die "nodes not idle: $(SLURM_CONF="$CONF" sinfo -h -N -o '%N=%t' | tr '\n' ' '); see $D/log/"
    update_etc_symlink
    srun_ok || die "'srun -N2 hostname' did not print n1 and n2; see $D/log/"
    log "up in $((SECONDS - t0)) s: cluster $CLUSTER_NAME, partition debug, nodes n1 n2"
    echo "export SLURM_CONF=$CONF"
}

cmd_down() {
    if [[ -f "$CONF" ]] && pid_alive "$D/slurmctld.pid"; then
        SLURM_CONF="$CONF" timeout 10 scancel -u root >/dev/null 2>&1 || true
    fi
    stop_daemons
    net_down
    rm -rf "$D"
    stop_accounting_if_unused
    update_etc_symlink
    log "down"
}

cmd_status() {
    if [[ ! -f "$CONF" ]] && ! pid_alive "$D/slurmctld.pid" && [[ ! -e /var/run/netns/n1 ]]; then
        echo "two-node cluster: down"; return 3
    fi
    echo "two-node cluster: SLURM_CONF=$CONF"
    echo "slurmctld: $(pid_alive "$D/slurmctld.pid" && echo "pid $(cat "$D/slurmctld.pid")" || echo dead)"
    local n
    for n in "${NODES[@]}"; do
        echo "slurmd $n: $(pid_alive "$D/slurmd.$n.pid" && echo "pid $(cat "$D/slurmd.$n.pid")" || echo dead)"
    done
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
