"""The operator's Prometheus metrics (``mooncake_operator_*``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("mooncake_operator_reconciles_total",
                     "Reconciles by outcome (ok, invalid, error)", ["outcome"])
RECONCILE_SECONDS = Histogram("mooncake_operator_reconcile_seconds",
                              "Wall time of one reconcile")
WRITES = Counter("mooncake_operator_api_writes_total",
                 "Writes to the API server by verb and kind", ["verb", "kind"])
ERRORS = Counter("mooncake_operator_errors_total", "Reconcile errors by kind", ["kind"])
REPLICA_PATCHES = Counter("mooncake_operator_replica_patches_total",
                          "Replica-annotation patches by the Conductor controller",
                          ["cluster"])
HOT_PREFIXES = Gauge("mooncake_operator_hot_prefixes",
                     "Hot prefixes replicated now", ["cluster"])
CLUSTERS = Gauge("mooncake_operator_clusters", "MooncakeClusters handled")
READY_PODS = Gauge("mooncake_operator_ready_pods", "Ready engine pods by cluster and role",
                   ["cluster", "role"])
