#!/usr/bin/env bash
# `make demo`: the main flow on the local provider, on this machine. The cluster is taken down
# at the end, also when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export CLUSTER_STACK=local

if [ -f "${CLUSTER_STATE_DIR:-.cluster}/local/inventory.json" ]; then
  echo "a local cluster is already up: run 'python deploy.py down --stack local' first (the demo makes its own)" >&2
  exit 2
fi

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
finish() {
  step "python deploy.py down"
  python deploy.py down --stack local
  step "python deploy.py cost --stack local"
  python deploy.py cost --stack local
}
trap finish EXIT

step "python deploy.py up --local --nodes 2"
python deploy.py up --local --nodes 2
step "python deploy.py status"
python deploy.py status
step "fab bootstrap"
fab bootstrap
step "fab run-ddp"
fab run-ddp
step "fab logs --lines 3"
fab logs --lines 3
