"""The ``conductor`` policy's rule on hand-made pools: fetch or recompute with a store
pool, queue priorities, the price of work, CPP group sizes and fetches, ``explain``.

Cost model defaults (:mod:`mooncake_conductor.cost`). One instance: 100k tokens
30.56 s, 60k 13.31 s, 10240 tokens 1.23 s (0.029 s with all of it cached). CPP
makespans (planned chunks) for groups of 2 / 3 / 4: 100k 17.46 / 12.37 / 9.59 s;
60k 7.85 / 5.63 / 4.42 s; 10240 tokens 0.85 / 0.65 / 0.54 s. Fetching 20 blocks
(10240 tokens) takes 0.037 s, 100 blocks 0.186 s."""

import random

from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import CPPConfig, CPPPlan, choose_chunk, plan_cpp_for
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.policies.base import PolicyContext, SLOConfig
from mooncake_conductor.policies.registry import create_policy
from mooncake_conductor.state import ClusterState

from .helpers import BT, COST, cluster, policy, queue, request

KEYS = list(range(20))  # 10240 tokens
N = 20 * BT
BIG = request(list(range(196)), tokens=100_000)
MID = request(list(range(118)), tokens=60_000)


def plan(n: int, size: int, cached: int = 0) -> CPPPlan:
    """The default planner's plan (the chunk size with the shortest makespan)."""
    return plan_cpp_for(COST, n, cached, size, CPPConfig())


def makespan(n: int, size: int, cached: int = 0) -> float:
    """What the policies price a group with (the plan's makespan, in closed form)."""
    return choose_chunk(COST, n, cached, size, CPPConfig())[1]


def test_no_prefill_instance_at_all_is_rejected() -> None:
    c = ClusterState(prefill=[], decode=[], index=PrefixIndex(100))
    pl = policy("conductor").choose(request(KEYS), c, 0.0)
    assert pl.prefill is None and pl.reject_reason == "no-prefill-instance"


# -- fetch or recompute --------------------------------------------------------------------
def test_the_rest_of_a_local_prefix_is_fetched_from_the_store_pool() -> None:
    """The store pool (id 3) holds all 20 blocks, idle instance 0 holds 16. Instance 0
    fetches the other 4 (0.007 s + 0.029 s) rather than recompute them (0.32 s); the
    others would fetch all 20 (0.066 s)."""
    c = cluster(3)
    c.store_id = 3
    c.index.add_instance(3)
    c.index.store(3, KEYS)
    c.index.store(0, KEYS[:16])
    pl = policy("conductor").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks, pl.source) == (0, 16, 4, 3)
    assert pl.transfer_s == COST.transfer_time(4 * BT)  # nothing to overlap it with
    assert pl.prefill_s == COST.prefill_time(N, N)
    assert pl.migrate is True


def test_a_local_placement_names_no_source() -> None:
    c = cluster(2)
    c.index.store(0, KEYS)
    pl = policy("conductor").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks, pl.source) == (0, 20, 0, None)


def test_without_overlap_the_whole_transfer_adds_to_the_queue() -> None:
    # the holder is busy; instance 1 waits 0.02 s, less than the 0.037 s fetch
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 30.0)
    queue(c.prefill[1], 0.02)
    pl = policy("conductor", overlap_transfer=False).choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.fetch_blocks) == (1, 20)
    assert pl.queue_s == 0.02 and pl.transfer_s == COST.transfer_time(N)


def test_a_fetch_hidden_behind_a_queue_ties_with_an_idle_instance() -> None:
    """100 blocks on busy instance 0. Instance 1 waits 0.15 s, less than the 0.186 s
    fetch, which overlaps it: its TTFT equals idle instance 2's, so both are chosen
    over seeds. Without overlap instance 1 is 0.15 s worse: only instance 2."""
    keys = list(range(100))
    c = cluster(3)
    c.index.store(0, keys)
    queue(c.prefill[0], 30.0)
    queue(c.prefill[1], 0.15)
    picks = {policy("conductor", seed=s).choose(request(keys), c, 0.0).prefill
             for s in range(12)}
    assert picks == {1, 2}
    picks = {policy("conductor", seed=s, overlap_transfer=False).choose(
        request(keys), c, 0.0).prefill for s in range(12)}
    assert picks == {2}


def test_the_ranking_follows_a_recalibrated_cost_model() -> None:
    """Instance 0 has 18 of 20 blocks in flight (pending, so nothing to fetch) behind 4 s
    of queued work; instance 1 is idle and empty; kappa = (1 busy + 1 waiting) / 2 = 1.
    Scores: instance 0 4 + 2 * 0.18 = 4.37 s, instance 1 2 * 1.23 = 2.46 s. Predicted
    prefills 3x slower: 4 + 2 * 0.55 = 5.1 s against 7.4 s, instance 0."""
    cost = CostModel()
    pol = create_policy("conductor", PolicyContext(cost=cost, slo=SLOConfig(),
                                                   rng=random.Random(0)), {})
    c = cluster(2)
    c.index.add_pending(0, KEYS[:18])
    queue(c.prefill[0], 4.0)
    assert pol.choose(request(KEYS), c, 0.0).prefill == 1
    cost.set_prefill_scale(3.0)
    pl = pol.choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.queue_s) == (0, 18, 4.0)
    assert pl.prefill_s == cost.prefill_time(N, 18 * BT)



class _CountingCost(CostModel):
    """A cost model that counts how often its ranking constants are read."""

    reads = 0

    def prefill_constants(self) -> list[float]:
        self.reads += 1
        return super().prefill_constants()


def test_the_ranking_constants_are_copied_once_per_calibration() -> None:
    cost = _CountingCost()
    pol = create_policy("conductor", PolicyContext(cost=cost, slo=SLOConfig(),
                                                   rng=random.Random(0)), {})
    c = cluster(2)
    for _ in range(3):
        pol.choose(request(KEYS), c, 0.0)
    assert cost.reads == 1  # at creation only
    cost.set_prefill_scale(2.0)
    for _ in range(3):
        pol.choose(request(KEYS), c, 0.0)
    assert cost.reads == 2

# -- priority queues (priority_weight > 0) ------------------------------------------------
def test_a_stored_prefix_does_not_wait_behind_later_priorities() -> None:
    """Instance 0 stores the prompt; a request of priority 50 waits there. Ours,
    priority 1 + 1 * 0.029 (weight 1), goes ahead of it: no queue."""
    c = cluster(1)
    c.index.store(0, KEYS)
    c.prefill[0].enqueue(7, 50.0, 3.0, 20, N)
    pl = policy("conductor", priority_weight=1.0).choose(request(KEYS, arrival=1.0), c, 1.0)
    assert pl.local_blocks == 20 and pl.queue_s == 0.0
    assert pl.priority == 1.0 + COST.prefill_time(N, N)


def test_a_fetch_is_prioritised_by_its_own_shorter_prefill() -> None:
    """Weight 1, arrival and now 1 s. Instance 1 runs until 1.5 s and has queued work of
    priority 1.5 (2 s) and 1000 (5 s). Fetching the prompt from busy instance 0 gives
    priority 1 + 0.029: only the running prefill is ahead (0.5 s, the fetch hides
    behind it). Recomputing (priority 2.23) would also wait for the 2 s item."""
    c = cluster(2)
    c.index.store(0, KEYS)
    c.prefill[0].busy_until = 100.0
    c.prefill[1].busy_until = 1.5
    c.prefill[1].enqueue(1, 1.5, 2.0, 4, 4 * BT)
    c.prefill[1].enqueue(2, 1000.0, 5.0, 4, 4 * BT)
    pl = policy("conductor", priority_weight=1.0).choose(request(KEYS, arrival=1.0), c, 1.0)
    assert (pl.prefill, pl.fetch_blocks, pl.source) == (1, 20, 0)
    assert (pl.queue_s, pl.transfer_s) == (0.5, 0.0)
    assert pl.priority == 1.0 + COST.prefill_time(N, N)


def test_reusing_a_pending_prefix_stays_behind_its_prefill_even_when_stored_elsewhere() -> None:
    """Instance 1 has the prompt pending for a queued request of priority 50; busy
    instance 0 stores it. Reusing the pending blocks on instance 1 orders ours after
    that request (priority > 50, its 3 s counted), not ahead as a 0-block fetch."""
    c = cluster(2)
    c.index.store(0, KEYS)
    c.prefill[0].busy_until = 30.0
    c.index.add_pending(1, KEYS)
    c.prefill[1].enqueue(7, 50.0, 3.0, 20, N)
    pl = policy("conductor", priority_weight=1.0).choose(request(KEYS, arrival=1.0), c, 1.0)
    assert (pl.prefill, pl.local_blocks, pl.fetch_blocks) == (1, 20, 0)
    assert pl.priority is not None and pl.priority > 50.0
    assert pl.queue_s == 3.0


def test_a_cpp_group_waits_only_for_work_ordered_before_it() -> None:
    """Weight 1, every instance runs until 2 s with 5 s queued at priority 1000. One
    instance: 2 + 30.56 s breaks the SLO; the group of four (priority 9.83) starts at
    2 s, ahead of the queued work: 2 + 9.83 s."""
    c = cluster(4)
    for i, p in enumerate(c.prefill):
        p.busy_until = 2.0
        p.enqueue(100 + i, 1000.0, 5.0, 4, 4 * BT)
    pl = policy("conductor", priority_weight=1.0, cpp={"rescue_idle_only": False}).choose(
        BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2, 3]
    assert pl.queue_s == 2.0 and pl.prefill_s == makespan(100_000, 4)
    assert pl.priority == makespan(100_000, 4)


# -- CPP: when, how large, from where ------------------------------------------------------
def test_max_group_two_still_makes_pairs() -> None:
    pl = policy("conductor", cpp={"max_group": 2}).choose(BIG, cluster(4), 0.0)
    assert len(pl.cpp_group) == 2 and pl.prefill_s == makespan(100_000, 2)


def test_max_group_one_is_cpp_off_decision_for_decision() -> None:
    """No group can form, so the policy draws nothing for one: with the same seed, the
    tie-breaks among 4 idle instances come out as with CPP disabled."""
    c = cluster(4)
    one = policy("conductor", seed=3, cpp={"max_group": 1})
    off = policy("conductor", seed=3, cpp={"enabled": False})
    picks = [one.choose(request(KEYS), c, 0.0).prefill for _ in range(12)]
    assert picks == [off.choose(request(KEYS), c, 0.0).prefill for _ in range(12)]
    assert len(set(picks)) > 1


def test_a_pool_of_two_can_pair_up() -> None:
    pl = policy("conductor").choose(BIG, cluster(2), 0.0)
    assert sorted(pl.cpp_group) == [0, 1] and pl.prefill_s == makespan(100_000, 2)


def test_exactly_min_new_tokens_is_enough_for_a_group() -> None:
    # 10240 new tokens on an idle pool of 4: all 4 join, 0.54 s
    pl = policy("conductor", cpp={"min_new_tokens": 10240}).choose(
        request(KEYS), cluster(4), 0.0)
    assert len(pl.cpp_group) == 4 and pl.prefill_s == makespan(N, 4)
    pl = policy("conductor", cpp={"min_new_tokens": 10241}).choose(
        request(KEYS), cluster(4), 0.0)
    assert pl.cpp_group == []


def test_reserve_idle_share_sets_how_many_stay_idle() -> None:
    # half of an idle pool of 4 stays idle: a pair
    pl = policy("conductor", cpp={"reserve_idle_share": 0.5}).choose(MID, cluster(4), 0.0)
    assert len(pl.cpp_group) == 2 and pl.prefill_s == makespan(60_000, 2)


def test_a_ttft_exactly_at_the_slo_is_no_rescue() -> None:
    """SLO = one instance's 13.31 s: the SLO is met, so the group is opportunistic and
    (with a quarter of the pool kept idle) one of the 4 idle instances stays idle: a
    group of 3."""
    slo = SLOConfig(ttft_s=COST.prefill_time(60_000))
    pl = policy("conductor", slo=slo, cpp={"reserve_idle_share": 0.25}).choose(
        MID, cluster(4), 0.0)
    assert len(pl.cpp_group) == 3 and pl.prefill_s == makespan(60_000, 3)


def test_at_the_slo_under_load_the_work_price_still_decides() -> None:
    """As above on a loaded pool (kappa 4.2, 4 idle of 5, so a pair at most): the pair is
    faster (7.85 s) but 7.85 + 4.2 x 15.7 > 13.31 + 4.2 x 13.31, and no rescue is due."""
    c = cluster(5)
    queue(c.prefill[4], 100.0, requests=20)
    slo = SLOConfig(ttft_s=COST.prefill_time(60_000))
    pl = policy("conductor", slo=slo).choose(MID, c, 0.0)
    assert pl.cpp_group == [] and pl.ttft_s == COST.prefill_time(60_000)


def test_a_light_load_prices_a_group_by_its_gpu_seconds() -> None:
    """8 instances, one with 3 queued requests: kappa = (1 + 3) / 8 = 0.5. One instance
    scores 13.31 x 1.5 = 19.96; the group of 4 (7 idle, max_group 4) 4.42 + 0.5 x 17.7
    = 13.27: the group."""
    c = cluster(8)
    queue(c.prefill[7], 3.0, requests=3)
    pl = policy("conductor").choose(MID, c, 0.0)
    assert len(pl.cpp_group) == 4 and pl.prefill_s == makespan(60_000, 4)


def test_a_group_fetches_the_rest_of_the_prefix_to_its_leader() -> None:
    """Busy instance 0 holds 20 blocks, idle instance 1 holds 8. With a 20 s SLO one
    instance (29.4 s) is a rescue case: the three idle instances, led by instance 1,
    fetch the other 12 blocks: 0.022 + 11.89 s."""
    c = cluster(4)
    c.index.store(0, BIG.keys[:20])
    c.index.store(1, BIG.keys[:8])
    c.prefill[0].busy_until = 100.0
    pl = policy("conductor", slo=SLOConfig(ttft_s=20.0)).choose(BIG, c, 0.0)
    assert pl.prefill == pl.cpp_group[0] == 1 and sorted(pl.cpp_group) == [1, 2, 3]
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (8, 12, 0)
    assert (pl.queue_s, pl.transfer_s) == (0.0, COST.transfer_time(12 * BT))
    assert pl.prefill_s == makespan(100_000, 3, 20 * BT)
    assert pl.cpp_chunk_tokens == plan(100_000, 3, 20 * BT).chunk_tokens
    assert pl.migrate is True


# -- explain -------------------------------------------------------------------------------
def test_explain_lists_the_five_best_options_with_their_group_sizes() -> None:
    """An idle pool of 6, 10240 tokens: the group of 4 (0.54 s) first, then four of the
    six single instances (1.23 s each)."""
    pl = policy("conductor", explain=True).choose(request(KEYS), cluster(6), 0.0)
    assert len(pl.cpp_group) == 4
    cands = pl.candidates
    assert len(cands) == 5
    assert (cands[0]["instance"], cands[0]["group"]) == (pl.prefill, 4)
    assert cands[0]["ttft_s"] == makespan(N, 4)
    singles = cands[1:]
    assert all(o["group"] == 1 and o["ttft_s"] == COST.prefill_time(N) for o in singles)
    assert len({o["instance"] for o in singles}) == 4
    assert {o["instance"] for o in singles} <= set(range(6))
