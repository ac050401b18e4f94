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

# Prometheus and promtool (Debian's 2.42) for the alert-rule tests and the monitoring
# end-to-end test. --no-install-recommends: no node exporter; RUNLEVEL=1: the package's
# service (which would listen on every interface) is not started; the tests start their own.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
      prometheus >/dev/null
  else
    echo "prometheus is missing: run 'sudo apt-get install prometheus'" >&2
    exit 1
  fi
fi

echo "== local Kubernetes control plane (built once, then cached by version)"
mooncake-operator local-cluster build

echo "== real engines (vLLM, SGLang) for the conformance tests (installed once, then cached)"
mooncake-operator conformance install

echo "== lint, types, layering"
ruff check .
mypy operator/mooncake_conductor operator/mooncake_contract operator/mooncake_sim \
  operator/mooncake_operator operator/mooncake_gateway operator/mooncake_localcluster \
  operator/mooncake_cli operator/mooncake_testbed operator/mooncake_conformance \
  operator/mooncake_monitoring operator/mooncake_kube \
  worker/mooncake_worker
lint-imports

echo "== tests"
# Tests needing an external program fail when it is missing (tests/needs.py); this script
# installed them all, so nothing is opted out here.
$PY -m pytest -m "not store" "$@"

echo "== mutation testing gate (docs/mutation-testing.md): kill rates of the gated targets"
# A few minutes: the simulator's metrics and one core module, each against its floor in
# mutation.toml. `python scripts/mutation.py` (no --gate) runs every target (an hour+).
$PY scripts/mutation.py --gate --report mutation-report

echo "== Mooncake Store tests, in a network namespace that has only loopback"
# The PyPI transfer engine listens on 0.0.0.0 whatever it is told; inside its own
# network namespace the only interface is lo, so nothing can leave 127.0.0.0/8.
rc=0
if unshare --net --map-root-user true 2>/dev/null; then
  unshare --net --map-root-user sh -c \
    'ip link set lo up && exec "$0" -m pytest -m store "$@"' "$PY" "$@" || rc=$?
else
  echo "unshare is not permitted here: running the store tests in the host namespace" >&2
  $PY -m pytest -m store "$@" || rc=$?
fi
# 5 = no store test selected (e.g. a path argument without any): not a failure
if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
