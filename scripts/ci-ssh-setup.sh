#!/usr/bin/env bash
# A private OpenSSH server on 127.0.0.1 for conf/cluster/ssh_local.yaml (the simulated PD deployment
# driven over real SSH). Own host key, own user key, own known_hosts, all under $HH_SSHD_DIR; the
# user's ~/.ssh is never read or written.
#   eval "$(scripts/ci-ssh-setup.sh start)"   # prints the HH_SSH_* exports ssh_local.yaml reads
#   python -m orchestrator cluster=ssh_local ...
#   scripts/ci-ssh-setup.sh stop
#   scripts/ci-ssh-setup.sh config ADDRESS PORT HOST_KEY DIR [LOG_LEVEL]   # prints the sshd_config only
# `config` is the one sshd_config of the project: the SSH tests (tests/remote/conftest.py) write
# theirs with it too. Installs openssh-server with apt-get when it is missing (needs root). Progress goes to stderr,
# only the exports to stdout.
set -euo pipefail
dir=${HH_SSHD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/heisenhunt/sshd}
sshd=/usr/sbin/sshd
say() { echo "ci-ssh-setup: $*" >&2; }

# A private sshd: keys only, no PAM, its pid file and authorized_keys in DIR.
sshd_config() {
  [ $# -ge 4 ] || { echo "usage: $0 config ADDRESS PORT HOST_KEY DIR [LOG_LEVEL]" >&2; exit 2; }
  cat <<CFG
Port $2
ListenAddress $1
HostKey $3
PidFile $4/sshd.pid
AuthorizedKeysFile $4/authorized_keys
# DIR is not a root-owned 0755 chain (a cache or temporary directory)
StrictModes no
UsePAM no
# CI runs as root; keys only
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AllowTcpForwarding yes
Subsystem sftp internal-sftp
UseDNS no
MaxSessions 16
LogLevel ${5:-INFO}
CFG
}

running() { [ -f "$dir/sshd.pid" ] && kill -0 "$(cat "$dir/sshd.pid")" 2>/dev/null; }

start() {
  if [ ! -x "$sshd" ]; then
    say "installing openssh-server"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends openssh-server >&2
  fi
  mkdir -p "$dir" && chmod 700 "$dir"
  [ -f "$dir/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C heisenhunt-sshd -f "$dir/host_ed25519"
  [ -f "$dir/user_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C heisenhunt-user -f "$dir/user_ed25519"
  cp "$dir/user_ed25519.pub" "$dir/authorized_keys"
  : >"$dir/ssh_config"  # an empty client config: ~/.ssh/config must not redirect 127.0.0.1
  if running; then
    port=$(cat "$dir/port")
    say "sshd already running on 127.0.0.1:$port (pid $(cat "$dir/sshd.pid"))"
  else
    port=${HH_SSHD_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    [ "$(id -u)" = 0 ] && mkdir -p /run/sshd  # privilege separation directory
    sshd_config 127.0.0.1 "$port" "$dir/host_ed25519" "$dir" >"$dir/sshd_config"
    "$sshd" -t -f "$dir/sshd_config"
    "$sshd" -f "$dir/sshd_config" -E "$dir/sshd.log"  # daemonizes, writes the pid file
    echo "$port" >"$dir/port"
    for _ in $(seq 50); do
      python3 - "$port" <<'PY' 2>/dev/null && break || sleep 0.1
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1) as s:
    assert s.recv(8).startswith(b"SSH-2.0")
PY
    done
    say "sshd started on 127.0.0.1:$port (pid $(cat "$dir/sshd.pid")), log $dir/sshd.log"
  fi
  echo "[127.0.0.1]:$port $(cut -d' ' -f1,2 "$dir/host_ed25519.pub")" >"$dir/known_hosts"
  cat <<ENV
export HH_SSH_PORT=$port
export HH_SSH_USER=$(id -un)
export HH_SSH_KEY_FILE=$dir/user_ed25519
export HH_SSH_KNOWN_HOSTS=$dir/known_hosts
export HH_SSH_CONFIG=$dir/ssh_config
ENV
}

stop() {
  if running; then
    kill "$(cat "$dir/sshd.pid")"
    say "sshd stopped"
  fi
  rm -f "$dir/sshd.pid"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  config) shift; sshd_config "$@" ;;
  *) echo "usage: $0 start|stop|config" >&2; exit 2 ;;
esac
