#!/usr/bin/env bash
# Compare our scheduler with the paper's and the peers' on any Mooncake-format trace.
#   examples/conductor/compare_on_your_trace.sh [TRACE.jsonl]
set -euo pipefail
trace=${1:-}
args=(--preset paper-fig5 --compare all --json /tmp/compare.json --plot /tmp/compare.png)
if [ -n "$trace" ]; then args+=(--trace "$trace"); fi
mooncake-operator trace-stats ${trace:+"$trace"}
mooncake-operator simulate "${args[@]}"
echo "results: /tmp/compare.json, chart: /tmp/compare.png"
