"""The operator's per-cluster series (mooncake_operator.metrics): conditions with their
current reason, and what a deleted cluster leaves behind (nothing)."""

from __future__ import annotations

from mooncake_operator import metrics
from prometheus_client import REGISTRY


def _series(name: str, cluster: str) -> dict[tuple[str, ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in REGISTRY.collect()
            for s in fam.samples if s.name == name and s.labels.get("cluster") == cluster}


def test_one_series_per_condition_type_with_its_current_reason() -> None:
    c = "ns/conds"
    metrics.publish_conditions(c, [("Ready", False, "EngineNotReady"),
                                   ("Degraded", True, "EngineCrashLooping")])
    metrics.publish_conditions(c, [("Ready", True, "AllReady"),
                                   ("Degraded", False, "AsExpected")])
    got = _series("mooncake_operator_cluster_condition", c)
    assert got == {
        (("cluster", c), ("reason", "AllReady"), ("type", "Ready")): 1.0,
        (("cluster", c), ("reason", "AsExpected"), ("type", "Degraded")): 0.0,
    }


def test_a_forgotten_cluster_exports_nothing() -> None:
    c = "ns/gone"
    metrics.publish_conditions(c, [("Ready", True, "AllReady")])
    metrics.READY_PODS.labels(c, "prefill").set(2)
    metrics.HOT_PREFIXES.labels(c).set(1)
    metrics.REPLICA_PATCHES.labels(c).inc()
    metrics.FAILURES_IN_A_ROW.labels(c).set(0)
    metrics.forget_cluster(c)
    left = [s for fam in REGISTRY.collect() for s in fam.samples
            if s.labels.get("cluster") == c]
    assert left == []
    metrics.forget_cluster(c)  # twice: nothing to remove, no error
