"""The paper's scheduler and baselines on small hand-made cases: ``kvcache-centric``
(Algorithm 1), ``local-cache-aware`` and ``round-robin``. Each expected outcome follows
from the rule in the policy's docstring (docs/policies.md), worked out in the comments."""

from __future__ import annotations

import pytest
from mooncake_conductor.policies.registry import create_policy, policy_class
from mooncake_conductor.policies.round_robin import RoundRobinParams

from .helpers import BT, COST, cluster, policy, queue, request

K4 = [11, 12, 13, 14]  # 4 blocks, 2,048 tokens
K8 = [21, 22, 23, 24, 25, 26, 27, 28]  # 8 blocks, 4,096 tokens


# -- kvcache-centric (Algorithm 1) ----------------------------------------------------------
def test_kvcache_centric_fetches_a_prefix_only_the_store_pool_holds() -> None:
    # The store pool (index id 3) is searched with the instances: best_len = 4 > 0 local,
    # so every idle instance fetches all 4 blocks from the pool.
    c = cluster(3)
    c.store_id = 3
    c.index.store(3, K4)
    pl = policy("kvcache-centric").choose(request(K4), c, 0.0)
    assert pl.prefill in (0, 1, 2)
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (0, 4, 3)
    assert pl.transfer_s == COST.transfer_time(4 * BT)


def test_kvcache_centric_still_matches_the_instances_when_a_store_pool_exists() -> None:
    # Instance 1 holds all 4 blocks, the pool only 2: best_len = 4 on instance 1 itself,
    # not > its own 4, so it recomputes nothing and fetches nothing (source None); the
    # others would pay a transfer for the same prefill, so instance 1 wins.
    c = cluster(3)
    c.store_id = 3
    c.index.store(3, K4[:2])
    c.index.store(1, K4)
    pl = policy("kvcache-centric").choose(request(K4), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks, pl.source) == (1, 4, 0, None)
    assert pl.transfer_s == 0.0
    assert pl.prefill_s == COST.prefill_time(4 * BT, 4 * BT)


def test_kvcache_centric_never_fetches_from_an_instance_that_is_down() -> None:
    # Instance 0 (down) still has all 8 blocks in the index; the live best is instance 1's
    # 4. Instance 1 recomputes from its 4 (no transfer), instance 2 would fetch the same 4
    # and pay the transfer on top: instance 1, nothing fetched.
    c = cluster(3)
    c.index.store(0, K8)
    c.index.store(1, K8[:4])
    c.prefill[0].up = False
    pl = policy("kvcache-centric").choose(request(K8), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks, pl.source) == (1, 4, 0, None)
    assert pl.prefill_s == COST.prefill_time(8 * BT, 4 * BT)


def test_kvcache_centric_fetch_placement_terms() -> None:
    # Instance 0 holds the 4 blocks but has 10 s queued; instance 1 holds 1 block and has
    # 0.5 s queued: best_len 4 > 1, so it fetches the 3 missing blocks (1,536 tokens) from
    # instance 0: TTFT = 0.5 + transfer(1,536) + prefill(2,048 with 2,048 reused).
    c = cluster(2)
    c.index.store(0, K4)
    c.index.store(1, K4[:1])
    queue(c.prefill[0], 10.0)
    queue(c.prefill[1], 0.5)
    pl = policy("kvcache-centric").choose(request(K4), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks, pl.source) == (1, 1, 3, 0)
    assert pl.queue_s == 0.5
    assert pl.transfer_s == COST.transfer_time(3 * BT)
    assert pl.prefill_s == COST.prefill_time(4 * BT, 4 * BT, 0)


def test_kvcache_centric_fetched_prefix_loads_from_host_memory() -> None:
    # A fully fetched 4,096-token prompt: nothing to compute (the 10 ms pass overhead),
    # but all 4,096 reused tokens load host-to-device (none counted as already in HBM),
    # 11.65 ms: the load bounds the prefill.
    c = cluster(2)
    c.index.store(0, K8)
    queue(c.prefill[0], 10.0)
    pl = policy("kvcache-centric").choose(request(K8), c, 0.0)
    assert (pl.prefill, pl.fetch_blocks) == (1, 8)
    assert COST.h2d_time(8 * BT) > 0.010
    assert pl.prefill_s == pytest.approx(COST.h2d_time(8 * BT), rel=1e-12)


@pytest.mark.parametrize(
    ("threshold", "fetched"),
    [(2.0, 0), (1.5, 2)],  # 4 > 2 x 2 is false: recompute; 4 > 2 x 1.5: fetch
)
def test_kvcache_centric_balancing_threshold_is_strict(threshold: float, fetched: int) -> None:
    # Instance 0 holds 4 blocks (10 s queued), instance 1 holds 2: instance 1 wins either
    # way; it fetches only when best_len > local_len x threshold.
    c = cluster(2)
    c.index.store(0, K4)
    c.index.store(1, K4[:2])
    queue(c.prefill[0], 10.0)
    pl = policy("kvcache-centric", kvcache_balancing_threshold=threshold).choose(
        request(K4), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks) == (1, 2, fetched)
    if fetched:
        assert pl.source == 0
        assert pl.prefill_s == COST.prefill_time(4 * BT, 4 * BT, 0)
    else:
        assert (pl.source, pl.transfer_s) == (None, 0.0)
        assert pl.prefill_s == COST.prefill_time(4 * BT, 2 * BT)


# -- local-cache-aware ----------------------------------------------------------------------
@pytest.mark.parametrize(("slack", "chosen"), [(1.0, 0), (0.5, 1)])
def test_local_cache_aware_queue_limit_is_slack_times_a_cold_prefill(
    slack: float, chosen: int
) -> None:
    # Instance 0 holds the prompt with exactly one cold prefill queued; instance 1 is idle
    # and cold. Limit = 0 + slack x cold: at slack 1 instance 0 sits on the limit
    # (eligible, longest local prefix wins); at slack 0.5 it is past it.
    cold = COST.prefill_time(4 * BT)
    c = cluster(2)
    c.index.store(0, K4)
    queue(c.prefill[0], cold)
    pl = policy("local-cache-aware", slack=slack).choose(request(K4), c, 0.0)
    assert pl.prefill == chosen
    assert pl.local_blocks == (4 if chosen == 0 else 0)


def test_local_cache_aware_ties_on_prefix_and_queue_are_drawn() -> None:
    # Two idle, cold instances: equal prefix, equal queue -> random, and both come up.
    seen = {policy("local-cache-aware", seed=s).choose(request(K4), cluster(2), 0.0).prefill
            for s in range(16)}
    assert seen == {0, 1}


# -- round-robin ----------------------------------------------------------------------------
def test_round_robin_keeps_its_validated_params() -> None:
    p = policy("round-robin")
    assert isinstance(p.params, RoundRobinParams)
    assert p.params == policy_class("round-robin").Params()
    ctx = p.ctx
    with pytest.raises(ValueError):
        create_policy("round-robin", ctx, {"slack": 1.0})
