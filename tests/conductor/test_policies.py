from collections import Counter

import pytest
from mooncake_conductor.index import DRAM, HBM
from mooncake_conductor.policies import policy_names
from mooncake_conductor.policies.base import Placement, SLOConfig
from mooncake_conductor.policies.registry import create_policy
from mooncake_conductor.state import PrefillState
from pydantic import ValidationError

from .helpers import BT, COST, cluster, policy, queue, request

KEYS = list(range(100, 120))  # a 20-block (10,240-token) prompt


def test_registry_lists_every_policy_and_rejects_unknown() -> None:
    assert set(policy_names()) >= {
        "random",
        "round-robin",
        "least-load",
        "local-cache-aware",
        "score",
        "kvcache-centric",
        "sglang-cache-aware",
        "dynamo-kv",
        "llm-d",
        "aibrix-conductor",
        "conductor",
    }
    with pytest.raises(KeyError, match="unknown policy"):
        policy("nope")
    with pytest.raises(ValidationError):
        policy("score", alpha=-1)
    with pytest.raises(ValidationError):
        policy("least-load", bogus=1)


def test_every_policy_skips_down_instances_and_reports_none_left() -> None:
    for name in policy_names():
        c = cluster(3)
        c.prefill[0].up = c.prefill[2].up = False
        assert policy(name).choose(request(KEYS), c, 0.0).prefill == 1, name
        c.prefill[1].up = False
        pl = policy(name).choose(request(KEYS), c, 0.0)
        assert pl.prefill is None and pl.reject_reason == "no-prefill-instance", name


def test_random_spreads_over_all() -> None:
    c, p = cluster(4), policy("random", seed=3)
    assert set(Counter(p.choose(request(KEYS), c, 0).prefill for _ in range(200))) == {0, 1, 2, 3}


def test_round_robin_cycles() -> None:
    c, p = cluster(3), policy("round-robin")
    assert [p.choose(request(KEYS), c, 0).prefill for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_picks_shortest_queue_and_ignores_cache() -> None:
    c = cluster(3)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 5.0)
    queue(c.prefill[1], 1.0)
    queue(c.prefill[2], 3.0)
    pl = policy("least-load").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.local_blocks == 0


def test_least_load_breaks_ties_at_random() -> None:
    c, p = cluster(4), policy("least-load", seed=1)
    assert len({p.choose(request(KEYS), c, 0).prefill for _ in range(100)}) == 4


def test_local_cache_aware_prefers_longest_local_prefix_within_slack() -> None:
    c = cluster(3)
    c.index.store(0, KEYS[:5])
    c.index.store(1, KEYS[:15])
    queue(c.prefill[1], 0.5)  # within one cold prefill (~1.3 s) of the idle instances
    pl = policy("local-cache-aware").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (1, 15)
    queue(c.prefill[1], 10.0)  # now far past the slack: the next best holder wins
    pl = policy("local-cache-aware").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 5)


def test_score_weights_cache_and_load_and_skips_overloaded() -> None:
    c = cluster(3)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 4.0)
    # alpha*1 + beta*(1-0.4) = 0.88 beats alpha*0 + beta*1 = 0.3
    assert policy("score").choose(request(KEYS), c, 0.0).prefill == 0
    # cache counts for nothing: the idle ones win
    assert policy("score", alpha=0.0).choose(request(KEYS), c, 0.0).prefill in (1, 2)
    queue(c.prefill[0], 6.0)  # 10 s = overload_s: hard constraint
    assert policy("score").choose(request(KEYS), c, 0.0).prefill in (1, 2)


def test_score_overload_path_takes_least_loaded() -> None:
    c = cluster(2)
    queue(c.prefill[0], 30.0)
    queue(c.prefill[1], 20.0)
    assert policy("score").choose(request(KEYS), c, 0.0).prefill == 1


def test_kvcache_centric_fetches_from_the_holder_when_it_is_busy() -> None:
    c = cluster(2)
    c.index.store(0, KEYS[:16])
    queue(c.prefill[0], 5.0)
    pl = policy("kvcache-centric").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.source == 0 and pl.fetch_blocks == 16
    n = len(KEYS) * BT
    assert pl.transfer_s == pytest.approx(COST.transfer_time(16 * BT))
    assert pl.prefill_s == pytest.approx(COST.prefill_time(n, 16 * BT))
    assert pl.ttft_s == pytest.approx(pl.transfer_s + pl.prefill_s)


def test_kvcache_centric_threshold_prefers_recompute() -> None:
    c = cluster(2)
    c.index.store(0, KEYS[:16])
    c.index.store(1, KEYS[:10])
    queue(c.prefill[0], 5.0)
    # best/local = 1.6 < 2: instance 1 recomputes from its own 10 blocks
    pl = policy("kvcache-centric", kvcache_balancing_threshold=2.0).choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.fetch_blocks == 0 and pl.local_blocks == 10


def test_kvcache_centric_queue_counts_the_running_prefill() -> None:
    c = cluster(2)
    c.prefill[0].busy_until = 100.0  # running, nothing queued: 100 s before a new start
    c.index.store(0, KEYS)
    pl = policy("kvcache-centric").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.fetch_blocks == 20 and pl.queue_s == 0.0
    assert policy("conductor").choose(request(KEYS), c, 0.0).prefill == 1


def test_sglang_uses_its_own_tree_not_the_engine_cache() -> None:
    c = cluster(3)
    p = policy("sglang-cache-aware")
    c.index.store(2, KEYS)  # the engine has it, the router never sent it there
    first = p.choose(request(KEYS), c, 0.0)
    p.on_placed(request(KEYS), first, c)
    again = p.choose(request(KEYS), c, 0.0)
    assert again.prefill == first.prefill  # follows its own tree
    # a different prompt (match rate 0 < 0.3) goes to the smallest tree: not the first's
    other = p.choose(request(list(range(500, 520))), c, 0.0)
    assert other.prefill != first.prefill


def test_sglang_imbalance_overrides_cache() -> None:
    c = cluster(2)
    p = policy("sglang-cache-aware")
    pl = p.choose(request(KEYS), c, 0.0)
    for rid in range(100):  # the router's own count: 100 - 0 > 64 and 100 > 0 * 1.5
        p.on_placed(request(KEYS, rid=rid), pl, c)
    assert p.choose(request(KEYS), c, 0.0).prefill != pl.prefill


def test_dynamo_cost_and_tier_weights() -> None:
    c = cluster(2)
    c.index.store(0, KEYS[:8], DRAM)
    c.index.store(1, KEYS[:7], HBM)
    # cost0 = 20 - 8*0.75 = 14, cost1 = 20 - 7 = 13 (+ new blocks for both)
    p = policy("dynamo-kv")
    assert p.choose(request(KEYS), c, 0.0).prefill == 1
    # one in-flight 4-block request routed to 1 (nothing cached): +4 prefill, +4 decode
    other = request(list(range(900, 904)), rid=5)
    p.on_placed(other, Placement(prefill=1), c)
    assert p.choose(request(KEYS), c, 0.0).prefill == 0


def test_dynamo_temperature_samples() -> None:
    c = cluster(3)
    c.index.store(0, KEYS)
    p = policy("dynamo-kv", temperature=5.0, seed=2)
    assert len({p.choose(request(KEYS), c, 0.0).prefill for _ in range(200)}) == 3


def test_llm_d_weights() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 1.0, requests=2)
    # prefix 3*1 + queue 2*0 + kv 2*1 = 5 beats 0 + 2 + 2 = 4
    assert policy("llm-d-precise").choose(request(KEYS), c, 0.0).prefill == 0
    assert policy("llm-d-precise", prefix_weight=1.0).choose(request(KEYS), c, 0.0).prefill == 1


def test_aibrix_formula() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    c.prefill[0].avg_prefill_s = 1.0
    queue(c.prefill[0], 1.0, requests=2)
    # pod0: 2*1000 + (0.005*10240+1) + 5 = 2057 ms; pod1: 0 + 1 + (0.001*10240^1.5+5) = 1042 ms
    assert policy("aibrix-conductor").choose(request(KEYS), c, 0.0).prefill == 1
    c.prefill[0].avg_prefill_s = 0.1
    assert policy("aibrix-conductor").choose(request(KEYS), c, 0.0).prefill == 0


def test_conductor_overlaps_fetch_with_queue() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 30.0)
    queue(c.prefill[1], 1.0)
    pl = policy("conductor").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.fetch_blocks == 20
    assert pl.transfer_s == 0.0  # the fetch (~0.04 s) hides behind the 1 s queue
    assert pl.queue_s == pytest.approx(1.0)


def test_conductor_counts_in_flight_prefixes() -> None:
    c = cluster(2)
    c.index.add_pending(1, KEYS[:18])
    pl = policy("conductor").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.local_blocks == 18
    assert (
        policy("conductor", include_pending=False).choose(request(KEYS), c, 0.0).local_blocks == 0
    )


def test_conductor_does_not_pile_ties_onto_one_instance() -> None:
    c = cluster(4)
    for i in range(4):
        c.index.store(i, KEYS[:1])  # a shared system-prompt block everywhere
    p = policy("conductor", seed=5)
    picks = Counter(p.choose(request(KEYS), c, 0.0).prefill for _ in range(200))
    assert len(picks) == 4 and min(picks.values()) > 20


def test_conductor_priority_is_shortest_first_with_aging() -> None:
    c = cluster(1)
    sjf = policy("conductor", priority_weight=2.0)
    short = sjf.choose(request(KEYS[:2], arrival=10.0), c, 10.0)
    long = sjf.choose(request(KEYS, arrival=10.0), c, 10.0)
    assert short.priority is not None and long.priority is not None
    assert short.priority < long.priority
    assert short.priority == pytest.approx(10.0 + 2.0 * short.prefill_s)
    # the default is FIFO: priority = arrival
    assert policy("conductor").choose(request(KEYS, arrival=10.0), c, 10.0).priority == 10.0


def test_conductor_never_orders_a_request_before_the_prefill_it_reuses() -> None:
    c = cluster(1)
    c.prefill[0].enqueue(7, 50.0, 3.0, 20, 20 * BT)  # queued, will write KEYS
    c.index.add_pending(0, KEYS)
    pl = policy("conductor", priority_weight=2.0).choose(request([*KEYS, 1], arrival=1.0), c, 1.0)
    assert pl.local_blocks == 20
    assert pl.priority is not None and pl.priority > 50.0


def test_conductor_uses_cpp_when_one_instance_breaks_the_slo() -> None:
    c = cluster(4)
    keys = list(range(1000, 1000 + 200))  # 102,400 tokens: ~35 s on one node
    pl = policy("conductor").choose(request(keys), c, 0.0)
    assert len(pl.cpp_group) >= 2 and pl.prefill == pl.cpp_group[0]
    assert pl.ttft_s < 30.0 < COST.prefill_time(len(keys) * BT)
    off = policy("conductor", cpp={"enabled": False}).choose(request(keys), c, 0.0)
    assert off.cpp_group == [] and off.ttft_s > 30.0


def test_conductor_explain_lists_candidates() -> None:
    c = cluster(3)
    pl = policy("conductor", explain=True).choose(request(KEYS), c, 0.0)
    assert 1 <= len(pl.candidates) <= 5
    assert {"instance", "ttft_s", "queue_s", "transfer_s", "prefill_s"} <= set(pl.candidates[0])


def test_create_policy_from_name_and_params() -> None:
    import random

    from mooncake_conductor.policies.base import PolicyContext

    ctx = PolicyContext(cost=COST, slo=SLOConfig(), rng=random.Random(0))
    p = create_policy("score", ctx, {"alpha": 0.2, "beta": 0.8})
    assert p.params.alpha == 0.2  # type: ignore[attr-defined]


def test_conductor_compiled_ranking_equals_pricing_in_python() -> None:
    """With FIFO queues the conductor ranks every instance in one compiled pass; with
    ``explain`` it prices them one at a time in Python. Same seed, same choices."""
    import random

    r = random.Random(11)
    for trial in range(150):
        n = r.choice([2, 8, 64])
        pruned, full = cluster(n=n), cluster(n=n)
        if trial % 2:  # matching on the compiled mirror of a large index
            for c in (pruned, full):
                c.index.vector_min_keys = 1
        chains = [list(range(1000 * c, 1000 * c + 40)) for c in range(6)]
        for inst in range(n):
            for _ in range(r.randint(0, 2)):
                held = r.choice(chains)[: r.randint(1, 40)]
                for c in (pruned, full):
                    c.index.store(inst, held)
            wait = r.choice([0.0, 0.0, r.random() * 5])
            if r.random() < 0.3:
                pending = r.choice(chains)[: r.randint(1, 40)]
                for c in (pruned, full):
                    c.index.add_pending(inst, pending)
            running_until = r.choice([0.0, 0.5])
            for c in (pruned, full):
                if wait:
                    queue(c.prefill[inst], wait)
                c.prefill[inst].busy_until = running_until
        if trial % 3 == 0:  # a store pool holds a prefix too
            held = r.choice(chains)[: r.randint(1, 40)]
            for c in (pruned, full):
                c.store_id = n
                c.index.store(n, held)
        for inst in r.sample(range(n), r.randint(0, n - 1)):  # some instances down
            for c in (pruned, full):
                c.prefill[inst].up = False
        keys = [*r.choice(chains)[: r.randint(1, 40)], 10**6 + trial]
        req = request(keys)
        for cpp in (False, True):
            a = policy("conductor", seed=trial, cpp={"enabled": cpp}).choose(req, pruned, 0.1)
            b = policy("conductor", seed=trial, cpp={"enabled": cpp}, explain=True).choose(
                req, full, 0.1)
            assert (a.prefill, a.local_blocks, a.fetch_blocks, a.source, a.cpp_group) == (
                b.prefill, b.local_blocks, b.fetch_blocks, b.source, b.cpp_group)
            assert (a.ttft_s, a.priority) == (b.ttft_s, b.priority)


def test_conductor_ranks_instances_the_index_has_not_seen() -> None:
    """A live instance whose id the index never stored anything for (and past 64) is
    priced like any other, on the compiled and the Python path."""
    for vector_min_keys in (1, 10**9):
        c = cluster(n=3)
        c.index.vector_min_keys = vector_min_keys
        c.prefill.append(PrefillState(iid=90, name="p90"))
        c.index.store(0, KEYS[:3])
        queue(c.prefill[0], 30.0)
        queue(c.prefill[1], 20.0)
        queue(c.prefill[2], 20.0)
        req = request(KEYS)
        a = policy("conductor", seed=1).choose(req, c, 0.0)
        b = policy("conductor", seed=1, explain=True).choose(req, c, 0.0)
        assert a.prefill == b.prefill == 90
        assert (a.ttft_s, a.fetch_blocks) == (b.ttft_s, b.fetch_blocks)


def test_conductor_sees_an_instance_go_down_and_come_back() -> None:
    c = cluster(n=2)
    c.index.store(0, KEYS)
    pol = policy("conductor")
    assert pol.choose(request(KEYS), c, 0.0).prefill == 0
    c.prefill[0].up = False
    assert pol.choose(request(KEYS), c, 0.0).prefill == 1
    c.prefill[1].up = False
    assert pol.choose(request(KEYS), c, 0.0).reject_reason == "no-prefill-instance"
    c.prefill[0].up = True
    assert pol.choose(request(KEYS), c, 0.0).prefill == 0
