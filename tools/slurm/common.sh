# shellcheck shell=bash
# Shared pieces of local_cluster.sh and two_node_cluster.sh. Sourced, not run.
#
# Layout (everything under $FSDP_SLURM_STATE, default /tmp/fsdp_workflow_slurm):
#   shared/   munge socket dir is the system one; this holds the accounting
#             database (MariaDB datadir + slurmdbd.conf + logs) shared by both
#             clusters, and a job-id counter.
#   local/    single-node cluster: etc/slurm.conf, state, spool, logs.
#   two_node/ two-node cluster:   etc/slurm.conf, state, spool, logs.

set -euo pipefail

FSDP_SLURM_STATE="${FSDP_SLURM_STATE:-/tmp/fsdp_workflow_slurm}"
SHARED_DIR="$FSDP_SLURM_STATE/shared"
DB_DIR="$SHARED_DIR/db"
# Accounting: "slurmdbd" (MariaDB + slurmdbd, real sacct) or "none"
# (accounting_storage/none + jobcomp/filetxt; sacct then fails with
# "Slurm accounting storage is disabled").
FSDP_SLURM_ACCOUNTING="${FSDP_SLURM_ACCOUNTING:-slurmdbd}"
MARIADB_PORT="${FSDP_SLURM_MARIADB_PORT:-16306}"
SLURMDBD_PORT="${FSDP_SLURM_DBD_PORT:-16819}"
HOST_SHORT="$(hostname -s)"

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }

# Serialise up/down of both clusters (concurrent pytest sessions, CI).
take_lock() {
    if ! { exec 9>>"${FSDP_SLURM_STATE%/}.lock"; } 2>/dev/null; then
        need_root
        die "cannot open ${FSDP_SLURM_STATE%/}.lock"
    fi
    flock -w 600 9 || die "could not lock ${FSDP_SLURM_STATE%/}.lock"
}

pid_alive() { # pidfile
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

kill_pidfile() { # pidfile [name]
    local pf="$1" pid i
    [[ -s "$pf" ]] || { rm -f "$pf"; return 0; }
    pid="$(cat "$pf")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pf"
}

wait_for() { # timeout_s description command...
    local timeout="$1" what="$2"; shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || return 1
        sleep 0.3
    done
}

need_root() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (it starts slurmctld/slurmd as SlurmUser=root, installs packages and, for the two-node cluster, creates network namespaces). Re-run with sudo or as root."
}

ensure_packages() { # binary:package ...
    local missing=() pair bin pkg
    for pair in "$@"; do
        bin="${pair%%:*}"; pkg="${pair#*:}"
        command -v "$bin" >/dev/null 2>&1 || [[ -x "/usr/sbin/$bin" ]] || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    need_root
    command -v apt-get >/dev/null 2>&1 || die "missing packages (${missing[*]}) and no apt-get to install them; install them by hand."
    log "installing ${missing[*]} with apt-get"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >"$FSDP_SLURM_STATE/apt.log" 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update >>"$FSDP_SLURM_STATE/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >>"$FSDP_SLURM_STATE/apt.log" 2>&1 \
            || die "apt-get install ${missing[*]} failed; see $FSDP_SLURM_STATE/apt.log"
    fi
}

ensure_slurm_packages() {
    mkdir -p "$FSDP_SLURM_STATE"
    ensure_packages slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge
    if [[ "$FSDP_SLURM_ACCOUNTING" == slurmdbd ]]; then
        ensure_packages slurmdbd:slurmdbd mariadbd:mariadb-server
    fi
}

# ---------------------------------------------------------------- munge
ensure_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
        chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force 9>&-
    wait_for 10 munge sh -c 'munge -n | unmunge' || die "munged did not come up (see /var/log/munge/munged.log)"
    # Remember that we started it: the last `down` stops it again.
    touch "$FSDP_SLURM_STATE/munged.ours"
}

# ------------------------------------------------- accounting (shared)
db_conf_dir() { echo "$DB_DIR/etc"; }

dbd_up() {
    pid_alive "$DB_DIR/slurmdbd.pid" && pid_alive "$DB_DIR/mariadb.pid"
}

ensure_accounting() {
    [[ "$FSDP_SLURM_ACCOUNTING" == slurmdbd ]] || return 0
    mkdir -p "$DB_DIR/etc" "$DB_DIR/log"
    if ! pid_alive "$DB_DIR/mariadb.pid"; then
        if [[ ! -d "$DB_DIR/data/mysql" ]]; then
            log "initialising MariaDB in $DB_DIR/data"
            rm -rf "$DB_DIR/data"
            mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR/data" \
                --auth-root-authentication-method=socket >"$DB_DIR/log/install-db.log" 2>&1 \
                || die "mariadb-install-db failed; see $DB_DIR/log/install-db.log"
        fi
        log "starting MariaDB on 127.0.0.1:$MARIADB_PORT"
        # setsid: detach from the caller's session so that pytest/CI shells do not
        # wait on it. --skip-grant-tables is not used: slurmdbd logs in as 'slurm'.
        setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" \
            --socket="$DB_DIR/mysqld.sock" --pid-file="$DB_DIR/mariadb.pid" \
            --bind-address=127.0.0.1 --port="$MARIADB_PORT" \
            --log-error="$DB_DIR/log/mariadb.err" \
            --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
            --skip-name-resolve </dev/null >/dev/null 2>&1 9>&- &
        wait_for 60 mariadb mariadb --no-defaults --socket="$DB_DIR/mysqld.sock" -u root -e 'select 1' \
            || die "MariaDB did not start; see $DB_DIR/log/mariadb.err"
        mariadb --no-defaults --socket="$DB_DIR/mysqld.sock" -u root -e "
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
            FLUSH PRIVILEGES;" || die "could not create the MariaDB user for slurmdbd"
    fi
    if ! pid_alive "$DB_DIR/slurmdbd.pid"; then
        cat >"$DB_DIR/etc/slurmdbd.conf" <<EOF
# Written by tools/slurm/common.sh; shared by both test clusters.
AuthType=auth/munge
DbdHost=$HOST_SHORT
DbdPort=$SLURMDBD_PORT
SlurmUser=root
PidFile=$DB_DIR/slurmdbd.pid
LogFile=$DB_DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MARIADB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
        chmod 600 "$DB_DIR/etc/slurmdbd.conf"
        # slurmdbd reads slurmdbd.conf next to $SLURM_CONF.
        : >"$DB_DIR/etc/slurm.conf"
        log "starting slurmdbd on port $SLURMDBD_PORT"
        SLURM_CONF="$DB_DIR/etc/slurm.conf" setsid /usr/sbin/slurmdbd </dev/null >/dev/null 2>&1 9>&-
        wait_for 60 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$SLURMDBD_PORT" \
            || die "slurmdbd did not start; see $DB_DIR/log/slurmdbd.log"
    fi
}

# Called by a cluster's `down`: stop the database only when no cluster uses it.
stop_accounting_if_unused() {
    local other
    for other in "$FSDP_SLURM_STATE/local" "$FSDP_SLURM_STATE/two_node"; do
        if pid_alive "$other/slurmctld.pid"; then return 0; fi
    done
    kill_pidfile "$DB_DIR/slurmdbd.pid"
    kill_pidfile "$DB_DIR/mariadb.pid"
    rm -rf "$SHARED_DIR"
    if [[ -e "$FSDP_SLURM_STATE/munged.ours" ]]; then
        kill_pidfile /run/munge/munged.pid
        rm -f "$FSDP_SLURM_STATE/munged.ours"
    fi
}

# Job ids must not repeat while the accounting database lives, or sacct would
# return two records for one id (submitit reads sacct). Each fresh cluster
# start takes a new block of ids.
next_first_job_id() {
    mkdir -p "$SHARED_DIR"
    local f="$SHARED_DIR/next_job_id" n
    n="$(cat "$f" 2>/dev/null || echo 1)"
    echo $((n + 100000)) >"$f"
    echo "$n"
}

accounting_conf_lines() { # storage_host cluster_name
    if [[ "$FSDP_SLURM_ACCOUNTING" == slurmdbd ]]; then
        cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$1
AccountingStoragePort=$SLURMDBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
EOF
    else
        cat <<EOF
# No database: sacct answers "Slurm accounting storage is disabled" (exit 1);
# submitit logs a warning and relies on its result pickles. Finished jobs are
# logged one line each to JobCompLoc.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$FSDP_SLURM_STATE/$2/jobcomp.log
EOF
    fi
}

# /etc/slurm/slurm.conf is read by Slurm commands run without SLURM_CONF, for
# example from inside a job after submitit.helpers.clean_env() (which removes
# every SLURM_* variable, SLURM_CONF included). We keep it as a symlink to the
# conf of the single-node cluster when it is up, else the two-node one; a real
# file that we did not create is never touched.
ETC_CONF=/etc/slurm/slurm.conf
update_etc_symlink() {
    local target=""
    if pid_alive "$FSDP_SLURM_STATE/local/slurmctld.pid"; then
        target="$FSDP_SLURM_STATE/local/etc/slurm.conf"
    elif pid_alive "$FSDP_SLURM_STATE/two_node/slurmctld.pid"; then
        target="$FSDP_SLURM_STATE/two_node/etc/slurm.conf"
    fi
    if [[ -e "$ETC_CONF" || -L "$ETC_CONF" ]]; then
        if [[ ! -L "$ETC_CONF" || "$(readlink "$ETC_CONF")" != "$FSDP_SLURM_STATE"/* ]]; then
            log "note: $ETC_CONF exists and is not ours; leaving it alone (set SLURM_CONF)"
            return 0
        fi
    fi
    if [[ -n "$target" ]]; then
        mkdir -p /etc/slurm
        ln -sfn "$target" "$ETC_CONF"
    else
        rm -f "$ETC_CONF"
    fi
}

mem_total_mb() { awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo; }

# "A bit under" the real memory: leave 10% (at least 1 GiB) for the OS.
real_memory_mb() {
    local t; t="$(mem_total_mb)"
    local r=$((t * 9 / 10)); (( t - r >= 1024 )) || r=$((t - 1024))
    echo "$r"
}

# The slurm.conf settings both test clusters share. Uses the caller's D, NAME,
# CTLD_PORT, SLURMD_PORT and first_id; $1 is the address slurmdbd is reached on.
shared_conf_lines() { # storage_host
    cat <<EOF
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job that asks for no memory gets the whole node and
# blocks every other job.
DefMemPerCPU=1024
SlurmdParameters=config_overrides
ReturnToService=2
# Keep finished jobs in slurmctld memory for an hour: tests read final states
# from 'scontrol show job'.
MinJobAge=3600
JobRequeue=1
FirstJobId=$first_id
KillWait=5
InactiveLimit=0
Waittime=0
SlurmdTimeout=60
# Schedule often, so dependent and released jobs start within seconds.
SchedulerParameters=sched_interval=2,bf_interval=2,sched_min_interval=100000
$(accounting_conf_lines "$1" "$NAME")
EOF
}
