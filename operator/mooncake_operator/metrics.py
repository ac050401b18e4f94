"""The operator's Prometheus metrics (``mooncake_operator_*``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("mooncake_operator_reconciles_total",
                     "Reconciles by outcome (ok, invalid, error)", ["outcome"])
RECONCILE_SECONDS = Histogram("mooncake_operator_reconcile_seconds",
                              "Wall time of one reconcile")
WRITES = Counter("mooncake_operator_api_writes_total",
                 "Writes to the API server by verb and kind", ["verb", "kind"])
READS = Counter("mooncake_operator_api_reads_total",
                "Reads from the API server by verb and kind", ["verb", "kind"])
INDEX_GHOSTS = Counter("mooncake_operator_index_ghosts_total",
                       "Objects an audit found in kopf's indexes but gone from the API (a "
                       "deletion a broken watch missed), by kind", ["kind"])
ERRORS = Counter("mooncake_operator_errors_total", "Reconcile errors by kind", ["kind"])
REPLICA_PATCHES = Counter("mooncake_operator_replica_patches_total",
                          "Replica-annotation patches by the Conductor controller",
                          ["cluster"])
HOT_PREFIXES = Gauge("mooncake_operator_hot_prefixes",
                     "Hot prefixes replicated now", ["cluster"])
CLUSTERS = Gauge("mooncake_operator_clusters", "MooncakeClusters handled")
LEADER = Gauge("mooncake_operator_leader",
               "1 while this replica holds the leader Lease and may write (leader.py)")
READY_PODS = Gauge("mooncake_operator_ready_pods", "Ready engine pods by cluster and role",
                   ["cluster", "role"])
FAILURES_IN_A_ROW = Gauge("mooncake_operator_reconcile_failures_in_a_row",
                          "Reconciles of a cluster that failed since its last good one",
                          ["cluster"])
CONDITION = Gauge("mooncake_operator_cluster_condition",
                  "A MooncakeCluster's status conditions (type Ready, Progressing, Degraded): "
                  "1 while True, 0 while False, labelled with the current reason",
                  ["cluster", "type", "reason"])
_condition_labels: dict[str, set[tuple[str, str, str]]] = {}


def publish_conditions(cluster: str, conditions: Iterable[tuple[str, bool, str]]) -> None:
    """Set ``cluster``'s condition series from ``(type, is_true, reason)``; a series whose
    reason changed is removed, so each type has one series per cluster."""
    now = set()
    for ctype, true, reason in conditions:
        labels = (cluster, ctype, reason)
        CONDITION.labels(*labels).set(1 if true else 0)
        now.add(labels)
    for labels in _condition_labels.get(cluster, set()) - now:
        CONDITION.remove(*labels)
    _condition_labels[cluster] = now


def forget_cluster(cluster: str) -> None:
    """Drop a deleted cluster's per-cluster series."""
    publish_conditions(cluster, ())
    _condition_labels.pop(cluster, None)
    for family, label_sets in ((READY_PODS, [(cluster, r) for r in ("prefill", "decode")]),
                               (HOT_PREFIXES, [(cluster,)]),
                               (REPLICA_PATCHES, [(cluster,)]),
                               (FAILURES_IN_A_ROW, [(cluster,)])):
        for labels in label_sets:
            with contextlib.suppress(KeyError):
                family.remove(*labels)
