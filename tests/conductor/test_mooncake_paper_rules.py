"""``mooncake-paper``: Algorithm 1's single placement, or a chunked-pipeline group of idle
instances (leader = the one holding the most of the prompt, the rest of the reused
prefix fetched to it) when the group's TTFT is smaller, on hand-made pools.

Cost model defaults. One instance: 100k tokens 30.56 s, 10240 tokens 1.23 s, 1024
tokens 0.134 s. CPP makespans (planned chunks), groups of 2 / 3 / 4: 100k 17.46 /
12.37 / 9.59 s; 10240 tokens 0.85 / 0.65 / 0.54 s; 1024 tokens 0.13427 s for a pair."""

import pytest
from mooncake_conductor.cpp import CPPConfig, CPPPlan, choose_chunk, plan_cpp, plan_cpp_for

from .helpers import BT, COST, cluster, policy, request

BIG = request(list(range(196)), tokens=100_000)


def plan(n: int, size: int, cached: int = 0) -> CPPPlan:
    """The default planner's plan (the chunk size with the shortest makespan)."""
    return plan_cpp_for(COST, n, cached, size, CPPConfig())


def makespan(n: int, size: int, cached: int = 0) -> float:
    """What the policies price a group with (the plan's makespan, in closed form)."""
    return choose_chunk(COST, n, cached, size, CPPConfig())[1]


def test_an_idle_pool_runs_a_long_prompt_on_the_largest_group() -> None:
    pl = policy("mooncake-paper").choose(BIG, cluster(4), 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2, 3] and pl.prefill == pl.cpp_group[0]
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (0, 0, None)
    assert (pl.queue_s, pl.transfer_s) == (0.0, 0.0)
    assert pl.prefill_s == makespan(100_000, 4)
    assert pl.cpp_chunk_tokens == plan(100_000, 4).chunk_tokens == 2048


def test_max_group_caps_the_group() -> None:
    pl = policy("mooncake-paper", cpp={"max_group": 2, "chunk_tokens": 2048}).choose(
        BIG, cluster(4), 0.0)
    assert len(pl.cpp_group) == 2 and pl.cpp_chunk_tokens == 2048
    # a fixed size is used as given
    assert pl.prefill_s == pytest.approx(plan_cpp(COST, 100_000, 0, 2, 2048).makespan_s,
                                         rel=1e-12)


def test_two_idle_instances_make_a_pair() -> None:
    pl = policy("mooncake-paper").choose(BIG, cluster(2), 0.0)
    assert sorted(pl.cpp_group) == [0, 1]
    assert pl.prefill_s == makespan(100_000, 2)


def test_cpp_disabled_keeps_the_single_placement() -> None:
    pl = policy("mooncake-paper", cpp={"enabled": False}).choose(BIG, cluster(4), 0.0)
    assert pl.cpp_group == [] and pl.ttft_s == COST.prefill_time(100_000)


def test_cpp_counts_the_tokens_to_compute_not_the_prompt() -> None:
    """20000 tokens, instance 0 holds 24 blocks (12288 tokens): 7712 to compute, under
    ``min_new_tokens`` 8192, so the single placement stands."""
    c = cluster(4)
    keys = list(range(40))
    c.index.store(0, keys[:24])
    pl = policy("mooncake-paper").choose(request(keys, tokens=20_000), c, 0.0)
    assert pl.cpp_group == [] and (pl.prefill, pl.local_blocks) == (0, 24)
    assert pl.ttft_s == COST.prefill_time(20_000, 24 * BT)


def test_exactly_min_new_tokens_is_enough() -> None:
    keys = list(range(20))  # 10240 tokens, nothing cached
    pl = policy("mooncake-paper", cpp={"min_new_tokens": 10240}).choose(
        request(keys), cluster(4), 0.0)
    assert len(pl.cpp_group) == 4 and pl.prefill_s == makespan(10240, 4)


def test_an_instance_with_any_wait_is_not_idle() -> None:
    # instance 1 is half a second from free: one idle instance, no group
    c = cluster(2)
    c.prefill[1].busy_until = 0.5
    pl = policy("mooncake-paper").choose(BIG, c, 0.0)
    assert pl.cpp_group == [] and pl.prefill == 0
    assert pl.ttft_s == COST.prefill_time(100_000)


def test_a_group_slower_than_one_instance_is_not_taken() -> None:
    # 1024 tokens: a pair's pipeline (0.13427 s) loses to one instance (0.13389 s)
    pl = policy("mooncake-paper", cpp={"min_new_tokens": 0}).choose(
        request([1, 2]), cluster(2), 0.0)
    assert pl.cpp_group == [] and pl.prefill_s == COST.prefill_time(1024)


def test_the_leader_is_the_idle_instance_holding_the_prefix() -> None:
    """Instance 2 holds 32 blocks: Algorithm 1 places the prompt there (local), and the
    group of four is led by it with nothing to fetch."""
    c = cluster(4)
    c.index.store(2, BIG.keys[:32])
    pl = policy("mooncake-paper").choose(BIG, c, 0.0)
    assert pl.prefill == pl.cpp_group[0] == 2 and sorted(pl.cpp_group) == [0, 1, 2, 3]
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (32, 0, None)
    assert pl.transfer_s == 0.0
    assert pl.prefill_s == makespan(100_000, 4, 32 * BT)


def test_the_rest_of_the_prefix_is_fetched_to_the_leader() -> None:
    """Busy instance 0 holds 20 blocks, idle instance 1 holds 8 of them. Algorithm 1
    fetches the other 12 to instance 1; the group of the three idle ones, led by
    instance 1, does the same: T(12 blocks) + makespan(3, 20 blocks cached)."""
    c = cluster(4)
    c.index.store(0, BIG.keys[:20])
    c.index.store(1, BIG.keys[:8])
    c.prefill[0].busy_until = 100.0
    pl = policy("mooncake-paper").choose(BIG, c, 0.0)
    assert pl.cpp_group == [1, 2, 3] and pl.prefill == 1
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (8, 12, 0)
    assert pl.transfer_s == COST.transfer_time(12 * BT)
    assert pl.prefill_s == makespan(100_000, 3, 20 * BT)


def test_a_prefix_on_a_busy_instance_is_fetched_not_recomputed() -> None:
    """Instance 0 holds 100 blocks and is 0.1 s from free, less than fetching them
    (0.19 s): Algorithm 1 places the prompt there (20.33 s). The three idle instances
    fetch the prefix from it to their leader, 0.19 + 8.61 s, instead of recomputing it
    (12.37 s)."""
    c = cluster(4)
    c.index.store(0, BIG.keys[:100])
    c.prefill[0].busy_until = 0.1
    single = policy("mooncake-paper", cpp={"enabled": False}).choose(BIG, c, 0.0)
    assert (single.prefill, single.local_blocks, single.source) == (0, 100, None)
    pl = policy("mooncake-paper").choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [1, 2, 3] and pl.prefill == pl.cpp_group[0]
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (0, 100, 0)
    assert pl.transfer_s == COST.transfer_time(100 * BT)
    assert pl.prefill_s == makespan(100_000, 3, 100 * BT)
