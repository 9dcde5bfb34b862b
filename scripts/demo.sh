#!/usr/bin/env bash
# `make demo [BIND=127.0.0.10] [SSH_PORT=2222] [MASTER_PORT=29500]`: the main flow on the local provider,
# on this machine, at the addresses given (node-0's loopback address, its SSH port, the rendezvous port;
# each defaults to the tool's own). The cluster is taken down at the end, also when a step fails; then
# the logs of the stack's nodes are copied first to a folder that `down` keeps, and that folder is named.
set -euo pipefail
cd "$(dirname "$0")/.."
export CLUSTER_STACK=local
STATE="${CLUSTER_STATE_DIR:-.cluster}"

# Each value whole, before anything is created (up and bootstrap check them again, but bootstrap runs
# only after up has made the cluster).
for name in SSH_PORT MASTER_PORT; do
  value="${!name:-}"
  if [ -n "$value" ] && { ! [[ "$value" =~ ^[0-9]{1,5}$ ]] || ((10#$value < 1024 || 10#$value > 65535)); }; then
    echo "error: $name='$value': give a port, 1024..65535 (make demo $name=...)" >&2
    exit 2
  fi
done
if [ -n "${BIND:-}" ] && ! [[ "$BIND" =~ ^127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]]; then
  echo "error: BIND='$BIND': give node-0's loopback address, e.g. BIND=127.0.0.10 (make demo BIND=...)" >&2
  exit 2
fi
up_flags=(--local --nodes 2)
[ -n "${BIND:-}" ] && up_flags+=(--bind "$BIND")
[ -n "${SSH_PORT:-}" ] && up_flags+=(--ssh-port "$SSH_PORT")
bootstrap_flags=()
[ -n "${MASTER_PORT:-}" ] && bootstrap_flags+=(--master-port "$MASTER_PORT")

if [ -f "$STATE/local/inventory.json" ]; then
  echo "a local cluster is already up: run 'python deploy.py down --stack local' first (the demo makes its own)" >&2
  exit 2
fi

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
keep_logs() {
  # `down` removes the stack's folder but its runs/: a log a failed step named would be gone.
  local stack kept
  [ -d "$STATE/local" ] || return 0
  stack="$(cd "$STATE/local" && pwd)"
  kept="$(cd "$STATE" && pwd)/demo-logs/$(date -u +%Y%m%d-%H%M%S)"
  mkdir -p "$kept"
  (cd "$stack" && find . -path ./runs -prune -o -type f -name '*.log' -print0 | xargs -0r cp --parents -t "$kept")
  printf '\nthe logs a failed step names are kept: %s/PATH is now %s/PATH\n' "$stack" "$kept" >&2
}
finish() {
  local status=$?
  trap - EXIT
  if [ "$status" -ne 0 ]; then keep_logs; fi
  step "python deploy.py down"
  python deploy.py down --stack local
  step "python deploy.py cost --stack local"
  python deploy.py cost --stack local
  exit "$status"
}
trap finish EXIT

step "python deploy.py up ${up_flags[*]}"
python deploy.py up "${up_flags[@]}"
step "python deploy.py status"
python deploy.py status
step "fab bootstrap ${bootstrap_flags[*]}"
fab bootstrap "${bootstrap_flags[@]}"
step "fab run-ddp"
fab run-ddp
step "fab logs --lines 3"
fab logs --lines 3
