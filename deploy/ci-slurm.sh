#!/usr/bin/env bash
# Start a single-node Slurm (munged + slurmctld + slurmd) on this machine for the tests.
#
# Idempotent: installs Debian's slurm-wlm and munge if missing (needs root and apt),
# writes /etc/slurm/slurm.conf if it differs, starts whichever daemon is not running, and
# waits until the node `localhost` is idle. Jobs run as root here; this is a CI harness,
# not a production Slurm. State lives in $AGORA_SLURM_DIR (default /tmp/agora-slurm).
#
# Usage: deploy/ci-slurm.sh            # set up and start
#        deploy/ci-slurm.sh --stop     # stop the daemons this script started
set -euo pipefail

DIR="${AGORA_SLURM_DIR:-/tmp/agora-slurm}"
CONF=/etc/slurm/slurm.conf
CPUS="${AGORA_SLURM_CPUS:-2}"
MEM_MB="${AGORA_SLURM_MEM_MB:-4096}"
WAIT_S="${AGORA_SLURM_WAIT_S:-60}"

log() { echo "ci-slurm: $*" >&2; }

stop() {
    for name in slurmd slurmctld; do
        if [ -f "$DIR/$name.pid" ] && kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null; then
            kill "$(cat "$DIR/$name.pid")" && log "stopped $name"
        fi
    done
}

if [ "${1:-}" = "--stop" ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" != 0 ]; then log "slurm-wlm/munge missing and not root: cannot install"; exit 3; fi
    log "installing slurm-wlm and munge"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" /etc/slurm /run/munge /var/log/munge /var/lib/munge

# -- munge --------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
chmod 0755 /run/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged --force
    else
        /usr/sbin/munged --force
    fi
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null | unmunge >/dev/null || { log "munged does not answer"; exit 4; }
fi

# -- slurm.conf ---------------------------------------------------------------------------
want=$(cat <<CONFEOF
# written by agora deploy/ci-slurm.sh: single-node test cluster
ClusterName=agora-ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=20
MinJobAge=300
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONFEOF
)
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$want" ]; then
    log "writing $CONF"
    printf '%s\n' "$want" >"$CONF"
    stop
    sleep 1
fi
# no cgroup.conf: slurmd autodetects; proctrack/linuxproc and task/none use no cgroups

running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

if ! running slurmctld; then
    log "starting slurmctld"
    /usr/sbin/slurmctld || { log "slurmctld failed; see $DIR/log/slurmctld.log"; tail -n 20 "$DIR/log/slurmctld.log" >&2; exit 5; }
fi
if ! running slurmd; then
    log "starting slurmd"
    /usr/sbin/slurmd -N localhost || { log "slurmd failed; see $DIR/log/slurmd.log"; tail -n 20 "$DIR/log/slurmd.log" >&2; exit 5; }
fi

deadline=$((SECONDS + WAIT_S))
while :; do
    state=$(sinfo -h -n localhost -o '%T' 2>/dev/null || true)
    case "$state" in
        idle*|mixed*|allocated*|completing*) break ;;
        down*|drain*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
    esac
    if [ $SECONDS -ge $deadline ]; then
        log "node localhost not up within ${WAIT_S}s (state: ${state:-none}); see $DIR/log"
        tail -n 20 "$DIR/log/slurmctld.log" >&2 || true; tail -n 20 "$DIR/log/slurmd.log" >&2 || true
        exit 5
    fi
    sleep 0.5
done
log "slurm up: node localhost $state ($CPUS CPUs), partition debug"
