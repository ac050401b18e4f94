"""``routing_only`` (equal capability): every policy routes on local caches alone, with no
KV fetch, no CPP group, no admission and no replication, so policies are compared on
routing only. Hand-made pools where each capability would otherwise change the choice."""

from typing import Any

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import ClusterState

from .helpers import COST, cluster, queue, request

KEYS = list(range(20))  # 10240 tokens
BIG_KEYS = list(range(196))


def held_by_busy() -> ClusterState:
    """Instance 0 holds the whole prompt and has 20 s of queued work; 1 is idle, empty:
    fetching the prefix to 1 beats both recomputing there and waiting on 0."""
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 20.0)
    return c


def decide(c: ClusterState, **cfg: Any) -> Any:
    return Conductor(ConductorConfig(**cfg)).schedule(request(KEYS), c, 0.0)


@pytest.mark.parametrize("policy", ["conductor", "kvcache-centric", "mooncake-paper"])
def test_a_fetching_policy_fetches_unless_routing_only(policy: str) -> None:
    full = decide(held_by_busy(), policy=policy)
    assert (full.placement.prefill, full.placement.fetch_blocks) == (1, 20)
    assert full.placement.source == 0
    only = decide(held_by_busy(), policy=policy, routing_only=True)
    assert only.placement.fetch_blocks == 0 and only.placement.source is None
    # without the fetch the idle instance recomputes: its TTFT is the cold prefill
    assert only.placement.prefill == 1
    assert only.placement.ttft_s == pytest.approx(COST.prefill_time(len(KEYS) * 512))


@pytest.mark.parametrize("policy", ["conductor", "mooncake-paper"])
def test_no_cpp_group_when_routing_only(policy: str) -> None:
    big = request(BIG_KEYS, tokens=100_000)
    full = Conductor(ConductorConfig(policy=policy)).schedule(big, cluster(4), 0.0)
    assert len(full.placement.cpp_group) > 1
    only = Conductor(ConductorConfig(policy=policy, routing_only=True)).schedule(
        big, cluster(4), 0.0)
    assert only.placement.cpp_group == []
    assert only.placement.prefill_s == pytest.approx(COST.prefill_time(100_000))


def test_routing_only_turns_admission_and_replication_off() -> None:
    on = Conductor(ConductorConfig(policy="conductor"))
    assert on.capabilities.admission and on.capabilities.replication
    for cfg in ({}, {"admission": True, "replicate": True}):
        off = Conductor(ConductorConfig(policy="conductor", routing_only=True, **cfg))
        assert not off.capabilities.admission and not off.capabilities.replication


def test_a_predicted_tbt_miss_is_served_when_routing_only() -> None:
    c = cluster(2, decode=1)
    c.decode[0].batch, c.decode[0].context_tokens = 300, 1_300_000
    tight = {"ttft_s": 30.0, "tbt_s": 0.02}
    assert decide(c, policy="conductor", slo=tight).reject_reason == "tbt-slo"
    d = decide(c, policy="conductor", slo=tight, routing_only=True)
    assert not d.rejected and d.decode.decode == 0


def test_routing_only_keeps_the_local_cache_choice() -> None:
    """Local reuse is routing, not a capability: the instance holding the prefix (idle)
    is still chosen, reusing it."""
    c = cluster(2)
    c.index.store(1, KEYS[:10])
    d = decide(c, policy="conductor", routing_only=True)
    assert (d.placement.prefill, d.placement.local_blocks) == (1, 10)
