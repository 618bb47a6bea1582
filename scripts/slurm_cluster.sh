#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for the tests and for trying `cluster=slurm`
# without a cluster: munge, slurmctld, N slurmd daemons posing as nodes n1..nN, and
# accounting (MariaDB + slurmdbd) so that sacct, and through it submitit, can tell how a job
# ended. No systemd: each daemon runs in the foreground as a background child of this script,
# its PID kept in DIR/pids. Needs root; installs Debian's packages when they are missing.
#
#   scripts/slurm_cluster.sh start DIR     # NODES=2 (default) emulated nodes; prints SLURM_CONF
#   scripts/slurm_cluster.sh stop DIR
#   source DIR/env.sh                      # then sbatch, squeue, `pdecomp cluster=slurm ...`
#
# Settings (environment): NODES (2), PORT_BASE (6817; slurmctld, slurmdbd, the database and
# the nodes take the ports from there up), ACCOUNTING (1).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
DIR=$(mkdir -p "$2" && cd "$2" && pwd)
NODES=${NODES:-2}
PORT_BASE=${PORT_BASE:-6817}
ACCOUNTING=${ACCOUNTING:-1}
DAEMONS="munged mariadbd slurmdbd slurmctld"   # start order; slurmd-nK follow
# munged wants its socket on a path every directory of which anyone may enter; DIR may sit
# under a private one (a test's temporary directory), so the socket gets its own in /tmp.
SOCKET_DIR=/tmp/pdecomp-munge-$(printf %s "$DIR" | md5sum | cut -c1-12)

alive() { [ -f "$DIR/pids/$1.pid" ] && kill -0 "$(cat "$DIR/pids/$1.pid")" 2>/dev/null; }

stop() {
  local names="" n pid
  for n in $DAEMONS; do names="$n $names"; done
  for pidfile in "$DIR"/pids/slurmd-*.pid; do
    [ -e "$pidfile" ] && names="$(basename "$pidfile" .pid) $names"
  done
  for n in $names; do
    alive "$n" || { rm -f "$DIR/pids/$n.pid"; continue; }
    pid=$(cat "$DIR/pids/$n.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$DIR/pids/$n.pid"
  done
  rm -rf "$SOCKET_DIR"
  echo "stopped the cluster in $DIR"
}

# Run a daemon in the foreground, in the background; remember its PID.
launch() {
  local name=$1; shift
  "$@" >"$DIR/log/$name.out" 2>&1 &
  echo $! >"$DIR/pids/$name.pid"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq $((seconds * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "error: $what did not come up within ${seconds}s; see $DIR/log" >&2
  tail -n 3 "$DIR"/log/*"${what%% *}"* >&2 2>/dev/null || true
  exit 1
}

install_packages() {
  local want="slurmctld slurmd slurm-client munge" missing=""
  [ "$ACCOUNTING" = 1 ] && want="$want slurmdbd mariadb-server"
  for p in $want; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  [ "$(id -u)" = 0 ] || { echo "error: packages missing ($missing) and not root" >&2; exit 1; }
  echo "installing$missing"
  apt-get update -qq
  # Debian's policy-rc.d stops the packages starting their services; this script starts them.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >"$DIR/log/apt.log" 2>&1 \
    || { echo "error: apt-get install failed; see $DIR/log/apt.log" >&2; exit 1; }
}

start() {
  [ "$(id -u)" = 0 ] || { echo "error: the local cluster needs root (its daemons run as root)" >&2; exit 1; }
  alive slurmctld && { echo "already running in $DIR"; cat "$DIR/env.sh"; return 0; }
  mkdir -p "$DIR"/{munge,state,spool,log,run,pids} "$SOCKET_DIR"
  install_packages

  local host cpus mem_mb ctld_port dbd_port db_port sock
  host=$(hostname -s); cpus=$(nproc)
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 8 / 10 / 1024 ))
  ctld_port=$PORT_BASE; dbd_port=$((PORT_BASE + 1)); db_port=$((PORT_BASE + 2))
  sock="$SOCKET_DIR/munge.socket"

  # munge: the key directory is private; the socket's is open to all.
  chmod 700 "$DIR/munge"; chmod 755 "$SOCKET_DIR"
  [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key"
  launch munged munged --foreground --socket="$sock" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed" \
    --log-file="$DIR/log/munged.log"
  wait_for 10 munged test -S "$sock"

  local accounting="AccountingStorageType=accounting_storage/none"
  if [ "$ACCOUNTING" = 1 ]; then
    local db="$DIR/db"
    if [ ! -d "$db/mysql" ]; then
      mariadb-install-db --user=root --datadir="$db" --auth-root-authentication-method=normal \
        --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1
    fi
    launch mariadbd mariadbd --no-defaults --user=root --datadir="$db" \
      --socket="$DIR/run/mariadb.sock" --pid-file="$DIR/run/mariadb.pid" \
      --bind-address=127.0.0.1 --port="$db_port" --log-error="$DIR/log/mariadb.err"
    wait_for 30 mariadb mariadb --no-defaults -S "$DIR/run/mariadb.sock" -uroot -e 'select 1'
    mariadb --no-defaults -S "$DIR/run/mariadb.sock" -uroot -e \
      "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
       GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    # slurmdbd takes no config path: it reads slurmdbd.conf beside $SLURM_CONF.
    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$sock
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$dbd_port
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/slurmdbd.conf"
    # With munge on a socket of its own, slurmctld finds it through AccountingStoragePass.
    accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
AccountingStoragePass=$sock"
  fi

  # Every node is this machine (slurmd -N name, a port each); each offers all its cores, so a
  # job may span the nodes however few cores there are.
  local nodes="" i
  for i in $(seq 1 "$NODES"); do
    nodes+="NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT_BASE + 10 + i)) CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"$'\n'
  done
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=pdecomp-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$accounting
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MailProg=/bin/true
# Cancelled and requeued jobs are killed 5 s after SIGTERM (default 30 s).
KillWait=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$nodes
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  cat >"$DIR/env.sh" <<EOF
export SLURM_CONF=$DIR/slurm.conf
EOF
  export SLURM_CONF="$DIR/slurm.conf"

  if [ "$ACCOUNTING" = 1 ]; then
    : >"$DIR/log/slurmdbd.log"  # it appends: an old "started" must not count
    launch slurmdbd slurmdbd -D
    wait_for 30 slurmdbd grep -q started "$DIR/log/slurmdbd.log"
  fi
  launch slurmctld slurmctld -D -f "$SLURM_CONF"
  for i in $(seq 1 "$NODES"); do
    launch "slurmd-n$i" slurmd -D -N "n$i" -f "$SLURM_CONF"
  done
  wait_for 30 "$NODES idle node(s)" bash -c \
    "[ \$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle) -ge $NODES ]"
  sinfo -N
  echo "cluster up in $DIR: source $DIR/env.sh"
}

case $cmd in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
