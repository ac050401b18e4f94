"""Admission in :class:`Conductor.schedule`: predicted SLO misses are rejected only when
admission is on (the policy's default or the configuration's ``admission``)."""

from typing import Any

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import ClusterState

from .helpers import COST, cluster, queue, request

KEYS = list(range(20))  # 10240 tokens
TIGHT_TBT = {"ttft_s": 30.0, "tbt_s": 0.02}


def overloaded_decode() -> ClusterState:
    """Two idle prefill instances; the one decode instance's next step takes far longer
    than a 20 ms TBT SLO."""
    c = cluster(2, decode=1)
    c.decode[0].batch, c.decode[0].context_tokens = 300, 1_300_000
    return c


def schedule(c: ClusterState, **cfg: Any) -> Any:
    return Conductor(ConductorConfig(**cfg)).schedule(request(KEYS), c, 0.0)


def test_predicted_tbt_miss_is_rejected_by_conductor_with_admission() -> None:
    d = schedule(overloaded_decode(), policy="conductor", slo=TIGHT_TBT)
    assert d.rejected and d.reject_reason == "tbt-slo"
    assert d.decode.predicted_tbt_s > 0.02


def test_conductor_without_admission_decodes_a_predicted_tbt_miss() -> None:
    c = overloaded_decode()
    d = schedule(c, policy="conductor", slo=TIGHT_TBT, admission=False)
    assert not d.rejected and d.reject_reason is None
    assert d.decode.decode == 0 and d.decode.reject_reason is None
    assert d.decode.predicted_tbt_s == pytest.approx(
        COST.decode_step_time(301, 1_300_000 + 20 * 512))


@pytest.mark.parametrize("policy", ["random", "least-load", "round-robin", "kvcache-centric"])
def test_tbt_slo_selector_without_admission_rejects_nothing(policy: str) -> None:
    d = schedule(overloaded_decode(), policy=policy, slo=TIGHT_TBT, decode_selector="tbt-slo",
                 admission=False)
    assert not d.rejected and d.decode.decode == 0


@pytest.mark.parametrize("policy", ["random", "least-load"])
def test_tbt_slo_selector_with_admission_rejects_the_miss(policy: str) -> None:
    d = schedule(overloaded_decode(), policy=policy, slo=TIGHT_TBT, decode_selector="tbt-slo",
                 admission=True)
    assert d.rejected and d.reject_reason == "tbt-slo"


def test_a_tbt_slo_within_reach_is_served_with_admission() -> None:
    d = schedule(overloaded_decode(), policy="conductor", slo={"ttft_s": 30.0, "tbt_s": 10.0})
    assert not d.rejected and d.decode.decode == 0


def test_no_decode_instance_is_rejected_even_without_admission() -> None:
    c = cluster(2, decode=1)
    c.decode[0].up = False
    for policy in ("conductor", "least-load"):
        d = schedule(c, policy=policy, decode_selector="tbt-slo", admission=False)
        assert d.reject_reason == "no-decode-instance", policy


def _queued(seconds: float) -> ClusterState:
    c = cluster(2)
    for p in c.prefill:
        queue(p, seconds)
    return c


def test_predicted_ttft_miss_only_with_admission() -> None:
    off_cpp = {"cpp": {"enabled": False}}
    d = schedule(_queued(40.0), policy="conductor", params=off_cpp)
    assert d.reject_reason == "ttft-slo"
    d = schedule(_queued(40.0), policy="conductor", params=off_cpp, admission=False)
    assert not d.rejected and d.placement.ttft_s > 30.0
    d = schedule(_queued(40.0), policy="least-load")
    assert not d.rejected
    d = schedule(_queued(40.0), policy="least-load", admission=True)
    assert d.reject_reason == "ttft-slo"


def test_ttft_exactly_at_the_slo_is_served() -> None:
    # an idle pool: least-load's predicted TTFT is the prefill alone
    exact = COST.prefill_time(20 * 512)
    d = schedule(cluster(2), policy="least-load", admission=True,
                 slo={"ttft_s": exact, "tbt_s": 1.0})
    assert d.placement.ttft_s == exact and not d.rejected
    d = schedule(cluster(2), policy="least-load", admission=True,
                 slo={"ttft_s": exact * (1 - 1e-9), "tbt_s": 1.0})
    assert d.reject_reason == "ttft-slo"


def test_a_rejected_request_is_not_recorded_as_an_access() -> None:
    c = _queued(40.0)
    c.index.store(0, KEYS)
    cfg: dict[str, Any] = {"policy": "conductor", "params": {"cpp": {"enabled": False}},
                           "replication": {"min_rate_per_s": 1e-3}}  # one access is hot
    cond = Conductor(ConductorConfig(**cfg))
    d = cond.schedule(request(KEYS), c, 0.0)
    assert d.reject_reason == "ttft-slo"
    assert cond.hot.hot(0.0) == []
    # served, the same request is recorded
    cond = Conductor(ConductorConfig(**cfg, admission=False))
    assert not cond.schedule(request(KEYS), c, 0.0).rejected
    assert [keys for _, _, keys in cond.hot.hot(0.0)] == [tuple(KEYS)]


def test_policy_defaults_and_overrides() -> None:
    def admits(**settings: Any) -> bool:
        return Conductor(ConductorConfig(**settings)).capabilities.admission

    assert admits(policy="conductor") is True
    assert admits(policy="kvcache-centric") is True
    assert admits(policy="least-load") is False
    assert admits(policy="conductor", admission=False) is False
    assert admits(policy="random", admission=True) is True
    cond = Conductor(ConductorConfig(policy="conductor"))
    assert cond.decode_selector.name == "tbt-lookahead" and cond.capabilities.replication is True
    cond = Conductor(ConductorConfig(policy="conductor", decode_selector="least-load",
                                     replicate=False))
    assert cond.decode_selector.name == "least-load" and cond.capabilities.replication is False


def test_the_tracker_records_the_prefix_the_cluster_holds() -> None:
    c = cluster(2)
    c.index.store(0, KEYS[:10])
    cond = Conductor(ConductorConfig(policy="conductor",
                                     replication={"min_rate_per_s": 1e-3}))
    d = cond.schedule(request(KEYS), c, 0.0)
    assert d.placement.reused_blocks == 10
    assert [keys for _, _, keys in cond.hot.hot(0.0)] == [tuple(KEYS[:10])]


def test_replication_plans_only_when_on() -> None:
    """A hot prefix held only by a loaded instance: copied to the idle one when
    replication is on, left alone when it is off."""
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 10.0)
    plans = {}
    for replicate in (True, False):
        cond = Conductor(ConductorConfig(policy="conductor", replicate=replicate))
        for t in range(10):
            cond.hot.record(KEYS, float(t))
        plans[replicate] = cond.plan_replication(c, 10.0)
    assert [(a.source, a.target, a.keys) for a in plans[True]] == [(0, 1, tuple(KEYS))]
    assert plans[False] == []
