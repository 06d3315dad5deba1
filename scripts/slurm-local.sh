#!/usr/bin/env bash
# A private single-node SLURM on 127.0.0.1 (slurmctld + slurmd, authenticated by a private munged) for
# hydra/launcher=heisenhunt_slurm on one machine and for tests/slurm. Everything (munge key and socket,
# slurm.conf, state and spool dirs, logs, pid files) lives under $HH_SLURM_DIR; /etc/slurm and the
# system's munged are never touched.
#   eval "$(scripts/slurm-local.sh start)"   # prints `export SLURM_CONF=...` (sbatch, srun, squeue read it)
#   sbatch --wrap hostname; srun hostname
#   scripts/slurm-local.sh stop
#   scripts/slurm-local.sh install          # apt-get install slurm-wlm munge where they are missing
# Runs as root (SlurmUser=root); no cgroups (proctrack/linuxproc, task/none), so it runs in containers
# and gVisor. Ports: HH_SLURM_CTLD_PORT and HH_SLURM_D_PORT, else free ones. Progress goes to stderr, only
# the exports to stdout; the start prints how long the service took to come up.
set -euo pipefail
dir=${HH_SLURM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/heisenhunt/slurm}
say() { echo "slurm-local: $*" >&2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
  local need=()
  command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || need+=(slurm-wlm)
  command -v munged >/dev/null || [ -x /usr/sbin/munged ] || need+=(munge)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
  fi
}

slurm_conf() {  # slurm_conf DIR NODE CPUS MEM_MB CTLD_PORT D_PORT
  cat <<CFG
ClusterName=heisenhunt
SlurmctldHost=$2(127.0.0.1)
SlurmctldPort=$5
SlurmdPort=$6
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$1/munge/munge.socket
StateSaveLocation=$1/state
SlurmdSpoolDir=$1/spool
SlurmctldPidFile=$1/slurmctld.pid
SlurmdPidFile=$1/slurmd.pid
SlurmctldLogFile=$1/slurmctld.log
SlurmdLogFile=$1/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: the processes of a job are found through /proc and killed as a group
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# finished jobs' states (CANCELLED, TIMEOUT, NODE_FAIL...) for sacct-less lookups; scontrol keeps them MinJobAge
JobCompType=jobcomp/filetxt
JobCompLoc=$1/jobcomp.txt
MinJobAge=600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# SIGTERM, then SIGKILL this many seconds later: the arm's teardown runs in between
KillWait=30
# a job past its time limit is ended at once (no grace beyond KillWait)
OverTimeLimit=0
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$2 NodeAddr=127.0.0.1 NodeHostname=$2 CPUs=$3 RealMemory=$4 State=UNKNOWN
PartitionName=debug Nodes=$2 Default=YES MaxTime=INFINITE State=UP
CFG
}

start() {
  install
  local t0 node cpus mem ctld_port d_port
  t0=$(date +%s.%N)
  mkdir -p "$dir"/{munge,state,spool} && chmod 700 "$dir" "$dir/munge"
  if ! alive "$dir/munged.pid"; then
    [ -f "$dir/munge/munge.key" ] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$dir/munge/munge.key"
    # --force: as root, and with a socket dir that is not /run/munge
    /usr/sbin/munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
      --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed"
  fi
  if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid"; then
    say "already running (slurmctld pid $(cat "$dir/slurmctld.pid"), conf $dir/slurm.conf)"
  else
    node=$(hostname -s)
    cpus=${HH_SLURM_CPUS:-$(nproc)}
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    ctld_port=${HH_SLURM_CTLD_PORT:-$(free_port)}
    d_port=${HH_SLURM_D_PORT:-$(free_port)}
    slurm_conf "$dir" "$node" "$cpus" "$mem" "$ctld_port" "$d_port" >"$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    # -i: ignore state left by an earlier start (its jobs are gone with its slurmd)
    /usr/sbin/slurmctld -i -f "$SLURM_CONF"
    /usr/sbin/slurmd -f "$SLURM_CONF" -N "$node"
    for _ in $(seq 300); do
      sinfo -h -N -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)' && break
      sleep 0.1
    done
    sinfo -h -N -o '%T' | grep -Eq '^(idle|mixed|allocated)' || {
      say "the node did not come up: $(sinfo -N 2>&1 | tail -1); logs in $dir"; exit 1;
    }
  fi
  say "SLURM up in $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s (node $(hostname -s), conf $dir/slurm.conf, logs $dir)"
  echo "export SLURM_CONF=$dir/slurm.conf"
}

stop() {
  local pidfile pid
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"; do
    if alive "$pidfile"; then
      pid=$(cat "$pidfile")
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
  done
  say "stopped"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  install) install ;;
  config) shift; slurm_conf "$@" ;;
  *) echo "usage: $0 start|stop|install|config DIR NODE CPUS MEM_MB CTLD_PORT D_PORT" >&2; exit 2 ;;
esac
