#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs every check and test.
# Idempotent: a second run only re-checks. Long first step: building the local
# Kubernetes control plane from Go modules (cached by version afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
echo "== python packages"
$PY -m pip install -q -e '.[dev,store]'

echo "== system packages"
# Mooncake Store's transfer engine (PyPI wheel) links libibverbs even for TCP.
if ! ldconfig -p | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "libibverbs1 is missing: run 'sudo apt-get install libibverbs1'" >&2
    exit 1
  fi
fi

echo "== local Kubernetes control plane (built once, then cached by version)"
mooncake-operator local-cluster build

echo "== lint, types, layering"
ruff check .
mypy operator/mooncake_conductor operator/mooncake_sim
lint-imports

echo "== tests"
# The store and cluster tests must run, not skip, when this script prepared them.
export MOONCAKE_REQUIRE_STORE=1 MOONCAKE_REQUIRE_CLUSTER=1
$PY -m pytest "$@"
