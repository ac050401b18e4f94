"""The peer routers on small hand-made cases: Dynamo's KV router (``dynamo-kv``), SGLang's
``cache_aware`` (``sglang-cache-aware`` and ``+``), llm-d's picker (``llm-d``), AIBrix's
default router (``aibrix-prefix-cache``) and its P/D policy (``aibrix-conductor``).
Each expected outcome is worked out in the comments from the rule in the policy's
docstring (docs/policies.md): the costs and scores, the thresholds, the tie-breaks."""

from __future__ import annotations

import math
import random

import pytest
from mooncake_conductor.index import DRAM, STORE
from mooncake_conductor.policies.base import Placement, PolicyContext, PrefillPolicy, SLOConfig
from mooncake_conductor.policies.registry import create_policy
from mooncake_conductor.state import ClusterState

from .helpers import COST, cluster, policy, queue, request

K = [1, 2, 3, 4]  # 4 blocks, 2,048 tokens


def teach(p: PrefillPolicy, c: ClusterState, keys: list[int], rid: int, iid: int) -> None:
    """The router placed request ``rid`` (``keys``) on instance ``iid``."""
    p.on_placed(request(keys, rid=rid), Placement(prefill=iid), c)


class FixedDraw(random.Random):
    """A generator whose every uniform draw is ``u``: a weighted draw then takes the first
    item whose cumulative weight exceeds ``u`` x the total."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


# -- dynamo-kv ------------------------------------------------------------------------------
def test_dynamo_credits_overlap_and_counts_the_routed_requests_books() -> None:
    # prefill_load_scale 1.2; cost = 1.2 * max(prefill + new - overlap, 0) + (decode + new)
    c = cluster(2)
    c.index.store(0, K)
    p = policy("dynamo-kv", prefill_load_scale=1.2)
    # R1 = K: worker 0 overlaps 4 -> 1.2 * 0 + 4 = 4; worker 1: 1.2 * 4 + 4 = 8.8
    r1 = request(K, rid=1)
    pl = p.choose(r1, c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 4)
    p.on_placed(r1, pl, c)  # worker 0 books: 0 uncached blocks, 4 distinct blocks
    # Probe K + [5]: worker 0: 1.2 * (0 + 5 - 4) + (4 + 5) = 10.2; worker 1: 1.2 * 5 + 5 = 11
    assert p.choose(request([*K, 5], rid=2), c, 0.0).prefill == 0
    # R1's first token: its books are released, worker 0 is as cold as worker 1 but holds K
    p.on_prefilled(r1, pl)
    assert p.choose(request([*K, 5], rid=3), c, 0.0).prefill == 0


def test_dynamo_fully_cached_prefill_costs_nothing() -> None:
    # Worker 0 holds K on device; worker 1 holds K's first block on disk (0.25).
    c = cluster(2)
    c.index.store(0, K)
    c.index.store(1, K[:1], tier=STORE)
    p = policy("dynamo-kv")
    # R1 = K[:3]: worker 0: max(0 + 3 - 3, 0) + 3 = 3; worker 1: (3 - 0.25) + 3 = 5.75
    r1 = request(K[:3], rid=1)
    pl = p.choose(r1, c, 0.0)
    assert pl.prefill == 0
    p.on_placed(r1, pl, c)  # fully cached: 0 uncached blocks, 3 distinct blocks
    # Probe K: worker 0: max(0 + 4 - 4, 0) + (3 + 4) = 7; worker 1: (4 - 0.25) + 4 = 7.75
    assert p.choose(request(K, rid=2), c, 0.0).prefill == 0


def test_dynamo_overlap_is_the_workers_own_prefix_by_tier() -> None:
    # Worker 0 holds K but carries 10 in-flight uncached blocks; worker 1 holds K's last
    # three blocks but not its first (no prefix: overlap 0); worker 2 holds K's first two.
    c = cluster(3)
    c.index.store(0, K)
    c.index.store(1, K[1:])
    c.index.store(2, K[:2])
    p = policy("dynamo-kv")
    teach(p, c, list(range(50, 60)), rid=10, iid=0)
    # worker 0: (10 + 4 - 4) + (10 + 4) = 24; worker 1: 4 + 4 = 8; worker 2: (4 - 2) + 4 = 6
    pl = p.choose(request(K), c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (2, 2)


def test_dynamo_books_a_request_routed_without_a_match_as_all_uncached() -> None:
    c = cluster(2)
    c.index.store(1, [1], tier=STORE)  # worker 1 holds the probe's first block on disk
    p = policy("dynamo-kv")
    teach(p, c, [40, 41, 42], rid=10, iid=1)  # worker 1 books: 3 uncached, 3 blocks
    # R1 = [1, 2, 3]: worker 0: 3 + 3 = 6; worker 1: (3 + 3 - 0.25) + (3 + 3) = 11.75
    r1 = request([1, 2, 3], rid=1)
    pl = p.choose(r1, c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 0)
    p.on_placed(r1, pl, c)  # no overlap: 3 uncached blocks, 3 blocks
    # Probe [1, 2, 3]: worker 0: (3 + 3) + (3 + 3) = 12; worker 1: 11.75
    assert p.choose(request([1, 2, 3], rid=2), c, 0.0).prefill == 1


def test_dynamo_decode_blocks_count_distinct_blocks_still_in_flight() -> None:
    c = cluster(2)
    c.index.store(1, [7], tier=DRAM)  # the probe's block on worker 1's host memory: 0.75
    p = policy("dynamo-kv")
    a, b = request([1, 2, 3], rid=1), request([1, 2, 4], rid=2)
    p.on_placed(a, Placement(prefill=0), c)
    p.on_placed(b, Placement(prefill=0), c)  # worker 0: 6 uncached, blocks {1, 2, 3, 4}
    p.on_prefilled(a, Placement(prefill=0))  # worker 0: 3 uncached, blocks {1, 2, 4}
    teach(p, c, [40, 41, 42], rid=10, iid=1)  # worker 1: 3 uncached, 3 blocks
    # Probe [7]: worker 0: (3 + 1) + (3 + 1) = 8; worker 1: (3 + 1 - 0.75) + (3 + 1) = 7.25
    assert p.choose(request([7], rid=3), c, 0.0).prefill == 1
    p.on_finished(b, Placement(prefill=0))  # failed before its first token: released
    # worker 0: 1 + 1 = 2
    assert p.choose(request([7], rid=4), c, 0.0).prefill == 0


def test_dynamo_equal_costs_are_drawn_and_booked() -> None:
    seen = set()
    for seed in range(16):
        p = policy("dynamo-kv", seed=seed)
        c = cluster(2)
        req = request(K)
        pl = p.choose(req, c, 0.0)
        assert pl.local_blocks == 0
        p.on_placed(req, pl, c)
        assert pl.prefill is not None
        seen.add(pl.prefill)
    assert seen == {0, 1}


def dynamo_draw(u: float, temperature: float, store: bool = True) -> int | None:
    ctx = PolicyContext(cost=COST, slo=SLOConfig(), rng=FixedDraw(u))
    p = create_policy("dynamo-kv", ctx, {"temperature": temperature})
    c = cluster(2)
    if store:
        c.index.store(0, K)
    return p.choose(request(K), c, 0.0).prefill


def test_dynamo_temperature_softmax_over_normalised_costs() -> None:
    # Costs 4 (worker 0) and 8 (worker 1) normalise to 0 and 1; at temperature 0.5 the
    # logits are 0 and -2: P(worker 0) = 1 / (1 + e^-2) = 0.881.
    assert 1 / (1 + math.exp(-2)) == pytest.approx(0.8808, abs=1e-4)
    assert dynamo_draw(0.87, 0.5) == 0
    assert dynamo_draw(0.89, 0.5) == 1
    # temperature 1: P(worker 0) = 1 / (1 + e^-1) = 0.731
    assert dynamo_draw(0.72, 1.0) == 0
    assert dynamo_draw(0.74, 1.0) == 1
    # equal costs: a uniform draw
    assert dynamo_draw(0.45, 0.5, store=False) == 0
    assert dynamo_draw(0.55, 0.5, store=False) == 1


# -- sglang-cache-aware ---------------------------------------------------------------------
def test_sglang_absolute_imbalance_must_be_exceeded() -> None:
    # loads 2 and 1: max - min = 1, not > 1: balanced, so the best match (worker 0, K)
    c = cluster(2)
    p = policy("sglang-cache-aware", balance_abs_threshold=1, balance_rel_threshold=1.0)
    teach(p, c, K, rid=1, iid=0)
    teach(p, c, [9], rid=2, iid=0)
    teach(p, c, [8], rid=3, iid=1)
    assert p.choose(request(K), c, 0.0).prefill == 0


@pytest.mark.parametrize(("w0_load", "chosen"), [(3, 0), (4, 1)])
def test_sglang_relative_imbalance_must_be_exceeded(w0_load: int, chosen: int) -> None:
    # loads (3, 2): 3 > 2 x 1.5 is false -> balanced -> the best match, worker 0;
    # loads (4, 2): imbalanced -> the shortest queue, worker 1, despite the cache
    c = cluster(2)
    p = policy("sglang-cache-aware", balance_abs_threshold=0)
    teach(p, c, K, rid=1, iid=0)
    for i in range(w0_load - 1):
        teach(p, c, [100 + i], rid=10 + i, iid=0)
    teach(p, c, [8], rid=3, iid=1)
    teach(p, c, [7], rid=4, iid=1)
    assert p.choose(request(K), c, 0.0).prefill == chosen


def test_sglang_load_counts_each_placed_request_once() -> None:
    # One request on worker 0, none on worker 1: loads (1, 0).
    c = cluster(2)
    p = policy("sglang-cache-aware", balance_abs_threshold=1, balance_rel_threshold=1.0)
    teach(p, c, K, rid=1, iid=0)
    # 1 - 0 = 1, not > 1: balanced -> worker 0 (best match)
    assert p.choose(request(K), c, 0.0).prefill == 0
    q = policy("sglang-cache-aware", balance_abs_threshold=0, balance_rel_threshold=1.0)
    teach(q, c, K, rid=1, iid=0)
    # 1 - 0 > 0 and 1 > 0: imbalanced -> worker 1, which the router never used (load 0)
    assert q.choose(request(K), c, 0.0).prefill == 1


def test_sglang_finishing_releases_one_request() -> None:
    # thresholds 0 and 1: whenever the loads differ the least loaded wins
    c = cluster(2)
    p = policy("sglang-cache-aware", balance_abs_threshold=0, balance_rel_threshold=1.0)
    for i, keys in enumerate(([9], [10], [11])):
        teach(p, c, keys, rid=i, iid=0)
    teach(p, c, K, rid=10, iid=1)
    teach(p, c, [8], rid=11, iid=1)
    p.on_finished(request([9], rid=0), Placement(prefill=0))
    # loads (2, 2): balanced -> the best match, worker 1
    assert p.choose(request(K), c, 0.0).prefill == 1
    q = policy("sglang-cache-aware", balance_abs_threshold=0, balance_rel_threshold=1.0)
    teach(q, c, [9], rid=0, iid=0)
    teach(q, c, K, rid=10, iid=1)
    q.on_finished(request([9], rid=0), Placement(prefill=0))
    # loads (0, 1): worker 0
    assert q.choose(request(K), c, 0.0).prefill == 0


def test_sglang_finishing_a_request_it_never_counted_keeps_load_at_zero() -> None:
    # e.g. placed before this router started counting; thresholds 0 and 1 as above
    c = cluster(2)
    p = policy("sglang-cache-aware", balance_abs_threshold=0, balance_rel_threshold=1.0)
    teach(p, c, K, rid=1, iid=0)
    p.on_finished(request([8], rid=99), Placement(prefill=1))  # worker 1 never counted
    p.on_finished(request(K, rid=1), Placement(prefill=0))
    p.on_finished(request([8], rid=98), Placement(prefill=0))  # worker 0 is back at 0
    p.on_finished(request([8], rid=97), Placement(prefill=None))
    # loads (0, 0): balanced -> the best match, worker 0
    assert p.choose(request(K), c, 0.0).prefill == 0


def test_sglang_imbalance_ties_on_load_are_drawn() -> None:
    seen = set()
    for seed in range(16):
        c = cluster(3)
        p = policy("sglang-cache-aware", seed=seed, balance_abs_threshold=0,
                   balance_rel_threshold=1.0)
        teach(p, c, K, rid=1, iid=0)  # loads (1, 0, 0)
        seen.add(p.choose(request(K), c, 0.0).prefill)
    assert seen == {1, 2}


def test_sglang_ignores_what_it_sent_to_an_instance_that_is_down() -> None:
    c = cluster(3)
    p = policy("sglang-cache-aware")
    teach(p, c, K, rid=1, iid=0)
    c.prefill[0].up = False
    # no live worker matches: the smallest tree among 1 and 2
    assert p.choose(request(K), c, 0.0).prefill in (1, 2)


def test_sglang_a_prompt_nobody_was_sent_goes_to_the_smallest_tree() -> None:
    c = cluster(2)
    p = policy("sglang-cache-aware")
    teach(p, c, [9, 10, 11], rid=1, iid=0)
    assert p.choose(request([1, 2]), c, 0.0).prefill == 1


@pytest.mark.parametrize(
    ("learned", "threshold", "chosen"),
    [
        (1, 0.3, 1),  # 512 / 2,048 = 0.25, not above 0.3: smallest tree (worker 1)
        (2, 0.5, 1),  # 0.5 is not above 0.5
        (2, 0.4, 0),  # 0.5 > 0.4: the best match
    ],
)
def test_sglang_match_rate_must_exceed_the_cache_threshold(
    learned: int, threshold: float, chosen: int
) -> None:
    c = cluster(2)
    p = policy("sglang-cache-aware", cache_threshold=threshold)
    teach(p, c, K[:learned], rid=1, iid=0)
    assert p.choose(request(K), c, 0.0).prefill == chosen


def test_sglang_match_rate_of_a_one_token_prompt() -> None:
    # 1 token matched of 1: rate 1.0 > 0.6
    c = cluster(2)
    p = policy("sglang-cache-aware", cache_threshold=0.6)
    teach(p, c, [1], rid=1, iid=0)
    assert p.choose(request([1], tokens=1), c, 0.0).prefill == 0


@pytest.mark.parametrize(
    ("tree_chars", "threshold", "chosen"),
    [
        # 4,096 characters / 4 = 1,024 tokens = 2 blocks kept of K: rate 0.5
        (4096, 0.6, 1),
        (4096, 0.4, 0),
        # 2,048 characters = 512 tokens = 1 block: rate 0.25
        (2048, 0.3, 1),
        (2048, 0.2, 0),
    ],
)
def test_sglang_tree_is_bounded_in_characters(
    tree_chars: int, threshold: float, chosen: int
) -> None:
    c = cluster(2)
    p = policy("sglang-cache-aware", max_tree_size=tree_chars, cache_threshold=threshold)
    teach(p, c, K, rid=1, iid=0)
    assert p.choose(request(K), c, 0.0).prefill == chosen


def test_sglang_best_match_ties_go_to_the_first_tenant_of_the_deepest_node() -> None:
    # Block 1 was stored by worker 1 first, block 2 by worker 0 first; both match [1, 2]
    # of [1, 2, 3] (2/3 > 0.3): the node is block 2, its first tenant worker 0.
    c = cluster(2)
    p = policy("sglang-cache-aware")
    teach(p, c, [1], rid=1, iid=1)
    teach(p, c, [1, 2], rid=2, iid=0)
    teach(p, c, [1, 2], rid=3, iid=1)
    assert p.choose(request([1, 2, 3]), c, 0.0).prefill == 0


@pytest.mark.parametrize("learned", [K, [1]])  # a tie on the best match; a low match
def test_sglang_plus_breaks_equal_loads_at_random(learned: list[int]) -> None:
    seen = set()
    for seed in range(16):
        c = cluster(2)
        p = policy("sglang-cache-aware+", seed=seed)
        teach(p, c, learned, rid=1, iid=0)
        teach(p, c, learned, rid=2, iid=1)
        seen.add(p.choose(request(K), c, 0.0).prefill)
    assert seen == {0, 1}


# -- llm-d ----------------------------------------------------------------------------------
# score = 3 * prefix + 2 * queue + 2 * (1 - usage); queue = (max_q - q) / (max_q - min_q)
def test_llm_d_prefix_scorer_considers_only_the_hashed_blocks() -> None:
    # approx_max_tokens 1,024: 2 blocks of K considered. Server 0 was sent K (remembers
    # [1, 2]) and has 1 request waiting; server 1 none.
    c = cluster(2)
    p = policy("llm-d", approx_max_tokens=1024)
    teach(p, c, K, rid=1, iid=0)
    queue(c.prefill[0], 1.0)
    # server 0: 3 * 2/2 + 2 * 0 + 2 = 5; server 1: 0 + 2 * 1 + 2 = 4
    assert p.choose(request(K), c, 0.0).prefill == 0


def test_llm_d_prefix_scorer_with_one_block_considered() -> None:
    # approx_max_tokens 512: 1 block. server 0: 3 * 1/1 + 0 + 2 = 5; server 1: 4
    c = cluster(2)
    p = policy("llm-d", approx_max_tokens=512)
    teach(p, c, [1, 2], rid=1, iid=0)
    queue(c.prefill[0], 1.0)
    assert p.choose(request([1, 2]), c, 0.0).prefill == 0


@pytest.mark.parametrize(("lru_tokens", "chosen"), [(1024, 0), (512, 1)])
def test_llm_d_remembers_only_hashed_blocks_within_its_lru(lru_tokens: int, chosen: int) -> None:
    # approx_max_tokens 512: each prompt teaches its first block only. Server 0 was sent
    # [1, 2] then [3, 4]: it remembers {1, 3} with room for 2 blocks, {3} with room for 1.
    # Probe [1, 5], server 0 with 1 request waiting: 3 * 1 + 0 + 2 = 5 against server 1's 4
    # when it still remembers block 1, else 2 against 4.
    c = cluster(2)
    p = policy("llm-d", approx_max_tokens=512, approx_lru_tokens=lru_tokens)
    teach(p, c, [1, 2], rid=1, iid=0)
    teach(p, c, [3, 4], rid=2, iid=0)
    queue(c.prefill[0], 1.0)
    assert p.choose(request([1, 5]), c, 0.0).prefill == chosen


def test_llm_d_queue_scorer_normalises_over_min_and_max() -> None:
    # queues 1 and 3; server 1 was sent [1] (1/2 of the probe).
    # server 0: 0 + 2 * (3 - 1)/(3 - 1) + 2 = 4; server 1: 3 * 0.5 + 0 + 2 = 3.5
    c = cluster(2)
    p = policy("llm-d")
    teach(p, c, [1], rid=1, iid=1)
    queue(c.prefill[0], 1.0)
    queue(c.prefill[1], 3.0, requests=3)
    assert p.choose(request([1, 2]), c, 0.0).prefill == 0


def test_llm_d_kv_usage_is_running_tokens_over_capacity() -> None:
    # server 0 runs a quarter of the KV capacity and was sent [1] (1/3 of the probe):
    # 3 * 1/3 + 2 + 2 * 0.75 = 4.5; server 1, idle: 0 + 2 + 2 = 4
    c = cluster(2)
    p = policy("llm-d")
    teach(p, c, [1], rid=1, iid=0)
    c.prefill[0].running_tokens = COST.kv_capacity_tokens // 4
    assert p.choose(request([1, 2, 3]), c, 0.0).prefill == 0


def test_llm_d_kv_usage_is_capped_at_full() -> None:
    # server 0 at twice the capacity, server 1 at it: both full (0 points); server 0 was
    # sent [1] (1/2): 1.5 + 2 + 0 = 3.5 against 2
    c = cluster(2)
    p = policy("llm-d")
    teach(p, c, [1], rid=1, iid=0)
    c.prefill[0].running_tokens = 2 * COST.kv_capacity_tokens
    c.prefill[1].running_tokens = COST.kv_capacity_tokens
    assert p.choose(request([1, 2]), c, 0.0).prefill == 0


def test_llm_d_learns_nothing_from_a_placement_without_an_instance() -> None:
    c = cluster(2)
    p = policy("llm-d")
    p.on_placed(request(K), Placement(prefill=None, reject_reason="ttft-slo"), c)
    teach(p, c, [9], rid=2, iid=1)
    queue(c.prefill[0], 1.0)
    # nobody was sent K: server 0: 0 + 0 + 2 = 2; server 1: 0 + 2 + 2 = 4
    assert p.choose(request(K), c, 0.0).prefill == 1


# -- aibrix-prefix-cache ----------------------------------------------------------------------
def loaded(loads: list[int]) -> ClusterState:
    c = cluster(len(loads))
    for inst, n in zip(c.prefill, loads, strict=True):
        if n:
            queue(inst, float(n), rid=1000 * (inst.iid + 1), requests=n)
    return c


@pytest.mark.parametrize(
    ("loads", "learned", "chosen"),
    [
        # max - min = 7 < 8: no gate; pod 3 has all of K, under mean + 2 sd (2 + 5.83)
        ([1, 0, 0, 7], {3: 4}, {3}),
        # 8 - 1 = 7 < 8: no gate, pod 4 stays (its 8 is over 2 x (2.6 + 1)) and is under
        # mean + 2 sd = 2.6 + 2 x 2.73: its full match beats pod 3's half
        ([1, 1, 1, 2, 8], {4: 4, 3: 2}, {4}),
        # max - min = 8 >= 8: pods over 2 x (2 + 1) = 6 go (pod 3); the rest (0, 0, 0) is
        # balanced, so pod 1's half of K wins among them
        ([0, 0, 0, 8], {3: 4, 1: 2}, {1}),
        # 9 > 2 x (3 + 1): pod 3 goes; (0, 0, 3) balanced; pod 2 at 3 <= 1 + 2 x 1.41
        ([0, 0, 3, 9], {3: 4, 2: 4}, {2}),
        # nobody over 2 x (3.75 + 1) = 9.5; still 9 > 8 apart: the least loaded outright
        ([0, 1, 5, 9], {2: 4}, {0}),
        # pod 3 exactly at 2 x (4 + 1) = 10 stays; 10 > 8 apart: the least loaded
        ([0, 1, 5, 10], {2: 4}, {0}),
        # 25 > 2 x (9.4 + 1) goes; (5, 5, 6, 6): 1 apart, pod 2 at 6 <= 5.5 + 2 x 0.5
        ([5, 5, 6, 6, 25], {2: 4}, {2}),
        # 30 goes; (0, 8, 8) exactly 8 apart is not > 8: the table, pod 1
        ([0, 8, 8, 30], {1: 4}, {1}),
        # nobody over 2 x (4.75 + 1); 10 apart: the least loaded, 0 or 1 at random
        ([0, 0, 9, 10], {2: 4}, {0, 1}),
    ],
)
def test_aibrix_prefix_cache_load_gates(
    loads: list[int], learned: dict[int, int], chosen: set[int]
) -> None:
    c = loaded(loads)
    p = policy("aibrix-prefix-cache")
    for iid, blocks in learned.items():
        teach(p, c, K[:blocks], rid=iid, iid=iid)
    assert p.choose(request(K), c, 0.0).prefill in chosen


def test_aibrix_prefix_cache_load_gate_ties_are_drawn() -> None:
    seen = {policy("aibrix-prefix-cache", seed=s).choose(request(K), loaded([0, 0, 9, 10]),
                                                          0.0).prefill for s in range(16)}
    assert seen == {0, 1}


def test_aibrix_prefix_cache_ranks_by_match_share_first() -> None:
    # pods 0, 1, 2 were sent 1, 4 and 2 blocks of K; equal loads: the highest share, pod 1
    c = cluster(3)
    p = policy("aibrix-prefix-cache")
    for iid, blocks in ((0, 1), (1, 4), (2, 2)):
        teach(p, c, K[:blocks], rid=iid, iid=iid)
    assert p.choose(request(K), c, 0.0).prefill == 1


def test_aibrix_prefix_cache_ranks_equal_shares_by_load() -> None:
    # both pods were sent K; pod 0 has 1 request, pod 1 none (both under 0.5 + 2 x 0.5)
    c = loaded([1, 0])
    p = policy("aibrix-prefix-cache")
    teach(p, c, K, rid=1, iid=0)
    teach(p, c, K, rid=2, iid=1)
    assert p.choose(request(K), c, 0.0).prefill == 1


def test_aibrix_prefix_cache_one_matching_block_counts() -> None:
    # pod 0 (1 request) was sent K's first block; pod 1 (idle) nothing: pod 0 matches
    # 1/4 and is under the bound 0.5 + 2 x 0.5
    c = loaded([1, 0])
    p = policy("aibrix-prefix-cache")
    teach(p, c, K[:1], rid=1, iid=0)
    assert p.choose(request(K), c, 0.0).prefill == 0


@pytest.mark.parametrize(
    ("table", "pod1_learned", "chosen"),
    [
        # 32 x 512 chars / 4 = 4,096 tokens / 2 pods / 512 = 4 blocks per pod
        ((32, 512), 4, 1),  # both remember 4 blocks of 16: equal share, less loaded pod 1
        ((32, 512), 3, 0),  # 4 against 3
        # 8 x 128 / 4 = 256 tokens: under one block per pod, still one block
        ((8, 128), 1, 1),
    ],
)
def test_aibrix_prefix_cache_table_size(
    table: tuple[int, int], pod1_learned: int, chosen: int
) -> None:
    prompt = list(range(1, 17))  # 16 blocks
    c = loaded([1, 0])
    p = policy("aibrix-prefix-cache", table_blocks=table[0], table_block_chars=table[1])
    teach(p, c, prompt, rid=1, iid=0)
    teach(p, c, prompt[:pod1_learned], rid=2, iid=1)
    assert p.choose(request(prompt), c, 0.0).prefill == chosen


# -- aibrix-conductor ----------------------------------------------------------------------
@pytest.mark.parametrize(("avg_s", "chosen"), [(0.0824, 1), (0.0825, 0)])
def test_aibrix_conductor_queued_prefills_priced_in_milliseconds(
    avg_s: float, chosen: int
) -> None:
    # pod 0: idle, nothing cached: 0 + (0 + 1) + (0.001 x 2048^1.5 + 5) = 98.68 ms
    # pod 1: K cached, 1 request in, avg prefill avg_s: 1000 avg_s + (0.005 x 2048 + 1) + 5
    # = 1000 avg_s + 16.24 ms: below pod 0 up to avg_s = 82.44 ms
    assert abs(0.001 * 2048**1.5 + 6 - 98.68) < 0.005
    c = cluster(2)
    c.index.store(1, K)
    queue(c.prefill[1], 1.0)
    c.prefill[1].avg_prefill_s = avg_s
    assert policy("aibrix-conductor").choose(request(K), c, 0.0).prefill == chosen


def test_aibrix_conductor_equal_estimates_are_drawn() -> None:
    seen = {policy("aibrix-conductor", seed=s).choose(request(K), cluster(2), 0.0).prefill
            for s in range(16)}
    assert seen == {0, 1}
