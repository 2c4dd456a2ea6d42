#!/usr/bin/env bash
# A private single-node Slurm cluster for the gpudist tests (see ../../../shared/SLURM.md).
#
#   bash tests/slurm/cluster.sh up       # install (apt, root) if missing, start, wait for idle
#   bash tests/slurm/cluster.sh status   # "up" (exit 0) or "down" (exit 1), plus sinfo
#   bash tests/slurm/cluster.sh env      # prints: export SLURM_CONF=<dir>/slurm.conf
#   bash tests/slurm/cluster.sh down     # kill slurmd, slurmctld (and munged if we started it)
#
# Everything lives in one state directory, ${GPUDIST_SLURM_DIR:-/tmp/gpudist-slurm}:
# slurm.conf, spool, pid and log files. Nothing is written under /etc/slurm; clients find the
# cluster through SLURM_CONF (`eval "$(bash tests/slurm/cluster.sh env)"`).
# Idempotent ("up" on a running cluster, "down" on a stopped one: no-ops), non-interactive,
# serialised by a lock file so concurrent callers do not race. Needs root (Slurm runs as root
# here: SlurmUser=root; no systemd, no cgroups).
#
# Tunables (environment): GPUDIST_SLURM_DIR, GPUDIST_SLURM_CPUS (CPUs advertised, default
# max(4, nproc): 4-task jobs on a 2-core VM would otherwise pend forever),
# GPUDIST_SLURM_MEM (RealMemory MB, default 2000), GPUDIST_SLURM_NO_INSTALL=1 (never apt-get).
set -euo pipefail

DIR=${GPUDIST_SLURM_DIR:-/tmp/gpudist-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
export SLURM_CONF=$CONF

log() { echo "cluster.sh: $*" >&2; }
die() { log "$*"; exit 2; }

running() {  # pid -> 0 if that process exists and is not a zombie
    kill -0 "$1" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null
}

pid_alive() {  # pid file -> 0 if that process runs
    [[ -s $1 ]] && running "$(cat "$1")"
}

node_state() {  # idle / mix / alloc / down / unk ... or empty when slurmctld does not answer
    timeout 10 sinfo -h -o %t 2>/dev/null | head -n1 | tr -d '*~#!%$@^-' || true
}

is_up() {
    [[ -f $CONF ]] && pid_alive "$DIR/run/slurmctld.pid" && pid_alive "$DIR/run/slurmd.pid" &&
        [[ $(node_state) =~ ^(idle|mix|alloc|comp)$ ]]
}

install_packages() {
    local missing=()
    for b in slurmctld slurmd sinfo srun sbatch munged munge; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ ${GPUDIST_SLURM_NO_INSTALL:-0} == 1 ]] && die "missing ${missing[*]} (GPUDIST_SLURM_NO_INSTALL=1)"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    log "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    local pkgs=(slurmctld slurmd slurm-client munge)
    if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$DIR/log/apt.log" 2>&1; then
        apt-get update -q >>"$DIR/log/apt.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$DIR/log/apt.log" 2>&1 ||
            die "apt-get install failed, see $DIR/log/apt.log"
    fi
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0  # a munged is already serving (ours from an earlier "up", or the system's)
    fi
    mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- /usr/sbin/munged 9>&-  # daemons must not inherit the lock
    cp /run/munge/munged.pid "$DIR/run/munged.started-by-us.pid"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged does not answer (munge -n | unmunge)"
}

write_conf() {
    local cpus=${GPUDIST_SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}
    local mem=${GPUDIST_SLURM_MEM:-2000}
    cat >"$CONF" <<EOF
# written by gpudist tests/slurm/cluster.sh; see ../shared/SLURM.md
ClusterName=gpudistci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=60
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

kill_pidfile() {  # pid file, name
    local f=$1 pid
    [[ -s $f ]] || return 0
    pid=$(cat "$f")
    if running "$pid"; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do running "$pid" || break; sleep 0.1; done
        if running "$pid"; then kill -9 "$pid" 2>/dev/null || true; fi
        log "stopped $2 (pid $pid)"
    fi
    rm -f "$f"
}

cmd_up() {
    [[ $(id -u) == 0 ]] || die "must run as root (SlurmUser=root, packages via apt-get)"
    mkdir -p "$DIR/log" "$DIR/run"
    if is_up; then
        log "already up ($CONF, node $HOST $(node_state))"
        return 0
    fi
    local t0=$SECONDS
    install_packages
    start_munge
    # a half-started cluster (one daemon died): restart both daemons with a clean state
    kill_pidfile "$DIR/run/slurmd.pid" slurmd
    kill_pidfile "$DIR/run/slurmctld.pid" slurmctld
    rm -rf "$DIR/spool"
    mkdir -p "$DIR/spool/ctld" "$DIR/spool/d"
    write_conf
    slurmctld -c 9>&-
    slurmd 9>&-
    local st=""
    for _ in $(seq 300); do
        st=$(node_state)
        [[ $st =~ ^(idle|mix|alloc)$ ]] && break
        if [[ $st =~ ^(down|drain|drng|fail)$ ]]; then
            scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.1
    done
    [[ $st =~ ^(idle|mix|alloc)$ ]] ||
        die "node $HOST not idle after 30 s (state '$st'); logs in $DIR/log"
    log "up in $((SECONDS - t0)) s: node $HOST idle; export SLURM_CONF=$CONF"
}

cmd_down() {
    kill_pidfile "$DIR/run/slurmd.pid" slurmd
    kill_pidfile "$DIR/run/slurmctld.pid" slurmctld
    kill_pidfile "$DIR/run/munged.started-by-us.pid" munged
    if [[ -d $DIR ]]; then
        rm -rf "$DIR/spool" "$DIR/run" "$CONF"
        log "down (logs kept in $DIR/log)"
    fi
}

cmd_status() {
    if is_up; then
        echo "up: SLURM_CONF=$CONF"
        timeout 10 sinfo || true
        return 0
    fi
    echo "down"
    return 1
}

cmd=${1:-}
case $cmd in
    up|down)
        mkdir -p "$DIR"
        exec 9>"$DIR/.lock"
        flock -w 120 9 || die "could not lock $DIR/.lock"
        "cmd_$cmd"
        ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
