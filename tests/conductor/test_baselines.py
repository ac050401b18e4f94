"""Each baseline's rule on small hand-made cases: the strongest honest reading of its
source (docs/policies.md), and the stronger variants under their own names."""

from __future__ import annotations

from mooncake_conductor.cost import CostModel
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.policies.base import Placement
from mooncake_conductor.policies.dynamo_kv import DynamoKVPolicy
from mooncake_conductor.policies.sglang_cache_aware import SGLangBase

from .helpers import BT, COST, cluster, policy, queue, request

KEYS = list(range(100, 120))  # 20 blocks, 10,240 tokens
OTHER = list(range(500, 520))


# -- the paper's baselines count the running prefill -----------------------------------------
def test_least_load_counts_the_running_prefill() -> None:
    c = cluster(2)
    c.prefill[0].busy_until = 5.0  # running, nothing queued
    queue(c.prefill[1], 1.0)  # 1 s queued
    assert policy("least-load").choose(request(KEYS), c, 0.0).prefill == 1


def test_local_cache_aware_excludes_an_instance_busy_past_the_slack() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    cold = COST.prefill_time(len(KEYS) * BT)
    c.prefill[0].busy_until = 2 * cold  # longer wait than recomputing: not eligible
    assert policy("local-cache-aware").choose(request(KEYS), c, 0.0).prefill == 1
    c.prefill[0].busy_until = 0.5 * cold
    assert policy("local-cache-aware").choose(request(KEYS), c, 0.0).prefill == 0


# -- SGLang: upstream and "+" ---------------------------------------------------------------
def place(p: object, c: object, keys: list[int], rid: int, iid: int) -> None:
    assert isinstance(p, SGLangBase)
    p.on_placed(request(keys, rid=rid), Placement(prefill=iid), c)  # type: ignore[arg-type]


def test_sglang_low_match_goes_to_the_smallest_tree_not_the_least_loaded() -> None:
    c = cluster(2)
    up, plus = policy("sglang-cache-aware"), policy("sglang-cache-aware+")
    for p in (up, plus):
        place(p, c, KEYS, 1, 0)  # worker 0: a big tree, one outstanding request
        for rid in range(2, 6):
            place(p, c, OTHER[:1], rid, 1)  # worker 1: a tiny tree, four outstanding
    fresh = request(list(range(900, 920)))
    assert up.choose(fresh, c, 0.0).prefill == 1  # smallest tree
    assert plus.choose(fresh, c, 0.0).prefill == 0  # least loaded


def test_sglang_best_match_ties_go_to_the_first_tenant_upstream_and_by_load_in_plus() -> None:
    c = cluster(3)
    up, plus = policy("sglang-cache-aware"), policy("sglang-cache-aware+")
    for p in (up, plus):
        place(p, c, KEYS, 1, 2)  # worker 2 stored the prefix first
        place(p, c, KEYS, 2, 0)
        place(p, c, KEYS, 3, 2)  # and is now the busier of the two
    assert up.choose(request(KEYS), c, 0.0).prefill == 2
    assert plus.choose(request(KEYS), c, 0.0).prefill == 0


def test_sglang_load_is_released_when_the_request_finishes() -> None:
    c = cluster(2)
    p = policy("sglang-cache-aware")
    assert isinstance(p, SGLangBase)
    for rid in range(100):
        place(p, c, KEYS, rid, 0)
    assert p.choose(request(KEYS), c, 0.0).prefill == 1  # imbalanced: shortest queue
    for rid in range(100):
        p.on_finished(request(KEYS, rid=rid), Placement(prefill=0))
    assert p.choose(request(KEYS), c, 0.0).prefill == 0  # balanced again: the best match


# -- Dynamo: the router's books ---------------------------------------------------------------
def test_dynamo_counts_uncached_in_flight_blocks_until_the_first_token() -> None:
    c = cluster(2)
    p = policy("dynamo-kv")
    assert isinstance(p, DynamoKVPolicy)
    c.index.store(1, KEYS[:15])
    # worker 1 holds 15 of 20: cost1 = (20 - 15) + 20 = 25 < cost0 = 20 + 20 = 40
    pl = p.choose(request(KEYS, rid=1), c, 0.0)
    assert pl.prefill == 1
    p.on_placed(request(KEYS, rid=1), pl, c)
    books = p._books[1]
    assert books.uncached == 5  # the prompt minus the overlap it was routed with
    assert len(books.blocks) == 20  # decode term: its distinct blocks
    # the same prompt again on 1: (5 + 20 - 15) + (20 + 20) = 50 > 40 on 0
    assert p.choose(request(KEYS, rid=2), c, 0.0).prefill == 0
    p.on_prefilled(request(KEYS, rid=1), pl)
    assert books.uncached == 0 and not books.blocks and not books.requests
    p.on_finished(request(KEYS, rid=1), pl)  # nothing left to release: a no-op
    assert books.uncached == 0


def test_dynamo_decode_term_counts_shared_blocks_once() -> None:
    c = cluster(2)
    p = policy("dynamo-kv")
    assert isinstance(p, DynamoKVPolicy)
    p.on_placed(request(KEYS, rid=1), Placement(prefill=0), c)
    p.on_placed(request([*KEYS, 7], rid=2), Placement(prefill=0), c)
    assert len(p._books[0].blocks) == 21
    assert p._books[0].uncached == 41


# -- llm-d: approximate by default, KV usage of running requests -----------------------------
def test_llm_d_default_learns_from_its_own_routing_not_the_engines() -> None:
    c = cluster(2)
    c.index.store(1, KEYS)  # the engine on 1 holds it; llm-d's default scorer cannot see it
    approx, precise = policy("llm-d", seed=1), policy("llm-d-precise", seed=1)
    assert precise.choose(request(KEYS), c, 0.0).prefill == 1
    first = approx.choose(request(KEYS), c, 0.0)
    approx.on_placed(request(KEYS), first, c)
    assert all(approx.choose(request(KEYS), c, 0.0).prefill == first.prefill
               for _ in range(10))  # now it follows its own history


def test_llm_d_approximate_scorer_hashes_at_most_16k_tokens() -> None:
    c = cluster(2)
    p = policy("llm-d")
    long_keys = list(range(2000, 2100))  # 51,200 tokens; only the first 32 blocks count
    p.on_placed(request(long_keys[:32]), Placement(prefill=1), c)
    # 32 of 32 considered blocks match on 1: prefix 3 + queue 2 + kv 2 = 7 vs 4
    assert p.choose(request(long_keys), c, 0.0).prefill == 1


def test_llm_d_kv_usage_counts_running_requests_not_queued_ones() -> None:
    c = cluster(2)
    p = policy("llm-d-precise", queue_weight=0.0, prefix_weight=0.0)
    queue(c.prefill[0], 1.0, requests=2)  # queued prompts: not in vLLM's usage
    c.prefill[1].running_tokens = COST.kv_capacity_tokens // 2
    assert p.choose(request(KEYS), c, 0.0).prefill == 0


# -- AIBrix's default router -----------------------------------------------------------------
def test_aibrix_prefix_cache_follows_its_table_within_the_load_bound() -> None:
    c = cluster(4)
    p = policy("aibrix-prefix-cache")
    p.on_placed(request(KEYS), Placement(prefill=2), c)
    assert p.choose(request(KEYS), c, 0.0).prefill == 2
    queue(c.prefill[2], 1.0, requests=7)
    for i in (0, 1, 3):
        queue(c.prefill[i], 1.0, requests=1)
    # loads 1, 1, 7, 1: the gate stays shut (7 - 1 < 8); mean 2.5, std 2.6, bound 7.7 >= 7
    assert p.choose(request(KEYS), c, 0.0).prefill == 2
    queue(c.prefill[2], 1.0, requests=6)  # 13 vs 1: gate open, 13 > 2 x (4 + 1): filtered
    assert p.choose(request(KEYS), c, 0.0).prefill != 2


def test_aibrix_prefix_cache_without_a_match_takes_the_least_loaded() -> None:
    c = cluster(3)
    p = policy("aibrix-prefix-cache")
    queue(c.prefill[0], 1.0, requests=2)
    queue(c.prefill[2], 1.0, requests=1)
    assert p.choose(request(KEYS), c, 0.0).prefill == 1


# -- the paper's whole system ----------------------------------------------------------------
def test_mooncake_paper_uses_cpp_on_idle_instances_for_long_prompts() -> None:
    c = cluster(4)
    keys = list(range(1000, 1200))  # 102,400 tokens: ~35 s on one node
    pl = policy("mooncake-paper").choose(request(keys), c, 0.0)
    assert len(pl.cpp_group) >= 2 and pl.prefill == pl.cpp_group[0]
    assert pl.ttft_s < COST.prefill_time(len(keys) * BT)
    assert policy("kvcache-centric").choose(request(keys), c, 0.0).cpp_group == []
    short = policy("mooncake-paper").choose(request(KEYS[:10]), c, 0.0)
    assert short.cpp_group == []  # 5,120 tokens: under cpp.min_new_tokens
    # busy instances never join a group
    for p in c.prefill[1:]:
        p.busy_until = 100.0
    assert policy("mooncake-paper").choose(request(keys), c, 0.0).cpp_group == []


def test_mooncake_paper_rejects_early_like_algorithm_1() -> None:
    conductor = Conductor(ConductorConfig(policy="mooncake-paper"), CostModel())
    assert conductor.capabilities.admission and conductor.decode_selector.__class__.__name__ != ""
    c = cluster(1)
    c.prefill[0].busy_until = 100.0  # a 100 s wait breaks the 30 s TTFT SLO
    decision = conductor.schedule(request(KEYS), c, 0.0)
    assert decision.reject_reason == "ttft-slo"


def test_aibrix_prefix_cache_skips_a_match_above_mean_plus_two_std() -> None:
    c = cluster(8)
    p = policy("aibrix-prefix-cache")
    p.on_placed(request(KEYS), Placement(prefill=7), c)
    queue(c.prefill[7], 1.0, requests=6)
    # loads 0 x 7 and 6: the gate stays shut (6 < 8); mean 0.75, std 1.98, bound 4.7 < 6
    assert p.choose(request(KEYS), c, 0.0).prefill != 7


def test_aibrix_prefix_cache_still_imbalanced_after_the_filter_takes_the_least_loaded() -> None:
    c = cluster(2)
    p = policy("aibrix-prefix-cache")
    p.on_placed(request(KEYS), Placement(prefill=1), c)
    queue(c.prefill[1], 1.0, requests=9)
    # 9 - 0 >= 8: 9 <= 2 x (4.5 + 1) stays, but 9 - 0 > 8 is still imbalanced
    assert p.choose(request(KEYS), c, 0.0).prefill == 0
