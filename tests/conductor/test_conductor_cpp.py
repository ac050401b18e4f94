"""The conductor policy's chunked-pipeline (CPP) choices on small hand-made pools.

Single-instance prefill (cost model defaults): 100k tokens 30.56 s, 60k 13.31 s.
Pipeline makespans (:func:`plan_cpp_for`, planned chunks) for groups of 2 / 3 / 4:
100k 17.46 / 12.37 / 9.59 s; 60k 7.85 / 5.63 / 4.42 s."""

from mooncake_conductor.cpp import CPPConfig, CPPPlan, choose_chunk, plan_cpp_for
from mooncake_conductor.policies.base import SLOConfig
from mooncake_conductor.state import ClusterState

from .helpers import BT, COST, cluster, policy, queue, request

BIG = request(list(range(196)), tokens=100_000)  # one instance alone breaks the 30 s SLO
MID = request(list(range(118)), tokens=60_000)  # one instance alone meets it


def plan(n: int, size: int, cached: int = 0) -> CPPPlan:
    """The default planner's plan (the chunk size with the shortest makespan)."""
    return plan_cpp_for(COST, n, cached, size, CPPConfig())


def makespan(n: int, size: int, cached: int = 0) -> float:
    """What the policies price a group with (the plan's makespan, in closed form)."""
    return choose_chunk(COST, n, cached, size, CPPConfig())[1]


def loaded(n: int) -> ClusterState:
    """``n`` prefill instances, the last busy with 20 queued requests: kappa (the price of
    a GPU second) is (1 busy + 20 waiting) / n."""
    c = cluster(n)
    queue(c.prefill[-1], 100.0, requests=20)
    return c


def test_rescue_uses_all_idle_instances_and_the_plans_makespan() -> None:
    pl = policy("conductor").choose(BIG, cluster(4), 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2, 3]
    assert (pl.queue_s, pl.transfer_s) == (0.0, 0.0)
    assert pl.prefill_s == makespan(100_000, 4)


def test_rescue_beats_the_work_price_when_the_slo_is_at_stake() -> None:
    """kappa 4.2: group sizes compete on TTFT + kappa x GPU seconds, and the pair scores
    best (17.46 + 4.2 x 34.9 = 164.1 s against 168.2 for three and 170.7 for four). It
    scores worse than one instance (30.56 + 4.2 x 30.56 = 158.9), but the single
    instance breaks the TTFT SLO and the pair does not."""
    pl = policy("conductor").choose(BIG, loaded(5), 0.0)
    assert len(pl.cpp_group) == 2 and 4 not in pl.cpp_group
    assert pl.ttft_s == makespan(100_000, 2) < 30.0


def test_a_rescue_never_takes_a_group_that_misses_the_slo() -> None:
    """A 15 s SLO at kappa 4.2: the pair still scores best (164.1) but takes 17.46 s;
    of the groups that meet the SLO, three score best (168.2 against 170.7 for four)."""
    pl = policy("conductor", slo=SLOConfig(ttft_s=15.0)).choose(BIG, loaded(5), 0.0)
    assert len(pl.cpp_group) == 3
    assert pl.ttft_s == makespan(100_000, 3) < 15.0


def test_without_an_slo_at_stake_the_work_price_decides() -> None:
    """60k tokens meet the SLO on one instance; a pair would be faster (7.9 s against
    13.3 s) but costs 15.7 GPU seconds at kappa 4.2: one instance serves it."""
    pl = policy("conductor").choose(MID, loaded(5), 0.0)
    assert pl.cpp_group == []
    assert pl.ttft_s == COST.prefill_time(60_000)


def test_opportunistic_groups_leave_a_share_of_the_pool_idle() -> None:
    # idle pool of 4, reserve_idle_share 0.25: at most 3 join, the fastest such group
    pl = policy("conductor", cpp={"reserve_idle_share": 0.25}).choose(MID, cluster(4), 0.0)
    assert len(pl.cpp_group) == 3
    assert pl.ttft_s == makespan(60_000, 3)


def test_a_rescue_uses_idle_instances_only() -> None:
    # instance 3 is half a second from free: a group of 4 would be faster (10.3 s)
    c = cluster(4)
    queue(c.prefill[3], 0.5)
    pl = policy("conductor").choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2]
    assert pl.ttft_s == makespan(100_000, 3)


def first_stage(n: int, size: int) -> float:
    """Stage 0's first chunk in the planned pipeline: stage ``k`` first works ``k`` times
    that long after the group starts."""
    return plan(n, size).stage_s[0]


def test_a_late_rescue_takes_a_member_free_before_its_stage_works() -> None:
    """15 s SLO: the idle pair (17.46 s) misses it. Instance 2 is busy for 1.5 first-chunk
    stage times of a group of three, so as stage 2 it is free before it first works: the
    group of three starts at once and meets the SLO (12.37 s). Instance 3 (busy 100 s)
    would delay a group of four."""
    c = cluster(4)
    queue(c.prefill[2], 1.5 * first_stage(100_000, 3))
    queue(c.prefill[3], 100.0)
    pl = policy("conductor", slo=SLOConfig(ttft_s=15.0)).choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2]
    assert pl.queue_s == 0.0
    assert pl.ttft_s == makespan(100_000, 3)


def test_a_rescue_waits_for_no_member() -> None:
    """As above, but instance 2 comes free only after 2.5 stage times: a group with it
    would start late, so only the idle pair is left (late: no group meets the SLO); the
    same with ``rescue_staggered`` off."""
    for busy, staggered in ((2.5, True), (1.5, False)):
        c = cluster(4)
        queue(c.prefill[2], busy * first_stage(100_000, 3))
        queue(c.prefill[3], 100.0)
        pl = policy("conductor", slo=SLOConfig(ttft_s=15.0),
                    cpp={"rescue_staggered": staggered}).choose(BIG, c, 0.0)
        assert sorted(pl.cpp_group) == [0, 1], (busy, staggered)
        assert pl.ttft_s == makespan(100_000, 2)


def test_a_rescue_an_idle_group_serves_in_time_takes_no_busy_member() -> None:
    """The default 30 s SLO: one instance misses it (30.56 s), the idle pair (17.46 s)
    meets it, so instance 2, free in time for stage 2 of a faster group of three, is not
    asked."""
    c = cluster(4)
    queue(c.prefill[2], 0.5 * first_stage(100_000, 3))
    queue(c.prefill[3], 100.0)
    pl = policy("conductor").choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1]
    assert pl.ttft_s == makespan(100_000, 2)


def test_a_group_waits_for_its_busiest_member() -> None:
    """``rescue_idle_only`` off, every instance busy (1..4 s), no price on work (at
    kappa 2 the pair would score best): the group of all four starts when the last one
    is free, 4 s + 9.83 s beating 3 s + 12.37 s."""
    c = cluster(4)
    for i, p in enumerate(c.prefill):
        queue(p, float(i + 1))
    pl = policy("conductor", work_weight=0.0, cpp={"rescue_idle_only": False}).choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1, 2, 3]
    assert pl.queue_s == 4.0
    assert pl.ttft_s == 4.0 + makespan(100_000, 4)


def test_the_group_size_counts_the_wait_for_members() -> None:
    # two idle, two 10 s from free: a pair now (17.5 s) beats all four later (19.8 s)
    c = cluster(4)
    queue(c.prefill[2], 10.0)
    queue(c.prefill[3], 10.0)
    pl = policy("conductor", cpp={"rescue_idle_only": False}).choose(BIG, c, 0.0)
    assert sorted(pl.cpp_group) == [0, 1]
    assert pl.ttft_s == makespan(100_000, 2)


def test_cpp_needs_enough_new_tokens_not_a_long_prompt() -> None:
    """20000 tokens of which instance 0 holds 18432: 1568 to compute, under
    ``min_new_tokens`` (2048, two of the smallest chunk), so no group; with the threshold
    at 0 a group of four is faster (0.27 s against 0.33 s)."""
    keys = list(range(40))
    for threshold, group in ((None, False), (0, True)):
        c = cluster(4)
        c.index.store(0, keys[:36])
        cfg = {} if threshold is None else {"cpp": {"min_new_tokens": threshold}}
        pl = policy("conductor", **cfg).choose(request(keys, tokens=20_000), c, 0.0)
        assert pl.prefill == 0 and pl.local_blocks == 36
        assert bool(pl.cpp_group) is group
        if not group:
            assert pl.ttft_s == COST.prefill_time(20_000, 36 * BT)


def test_the_group_leader_is_the_member_holding_the_prefix() -> None:
    # a 20 s SLO makes the 100k prompt a rescue even with 16384 tokens cached on one
    for seed in range(8):
        c = cluster(4)
        c.index.store(2, BIG.keys[:32])
        pl = policy("conductor", seed=seed, slo=SLOConfig(ttft_s=20.0)).choose(BIG, c, 0.0)
        assert len(pl.cpp_group) == 4 and pl.cpp_group[0] == pl.prefill == 2, seed
        assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (32, 0, None)
        assert pl.ttft_s == makespan(100_000, 4, cached=32 * BT)


def test_only_a_fetch_migrates() -> None:
    keys = list(range(20))
    c = cluster(2)
    c.index.store(0, keys)
    local = policy("conductor").choose(request(keys), c, 0.0)
    assert (local.prefill, local.fetch_blocks, local.migrate) == (0, 0, False)
    queue(c.prefill[0], 5.0)  # the holder is busy: fetch to the idle one
    fetched = policy("conductor").choose(request(keys), c, 0.0)
    assert (fetched.prefill, fetched.source, fetched.fetch_blocks) == (1, 0, 20)
    assert fetched.migrate is True
    kept = policy("conductor", migrate_on_fetch=False).choose(request(keys), c, 0.0)
    assert kept.fetch_blocks == 20 and kept.migrate is False


def test_an_opportunistic_group_takes_a_member_free_before_its_stage_works() -> None:
    """60k tokens, one instance meets the SLO (no rescue). Instance 2 is busy for 1.5
    first-chunk stage times of a group of three: as stage 2 it is free before it first
    works, so the group of three starts at once (5.63 s against 7.85 s for the idle pair);
    busy for 2.5 it would delay the group, and with ``opportunistic_staggered`` off only
    idle instances join."""
    for busy, staggered, group in ((1.5, True, [0, 1, 2]), (2.5, True, [0, 1]),
                                   (1.5, False, [0, 1])):
        c = cluster(4)
        queue(c.prefill[2], busy * first_stage(60_000, 3))
        queue(c.prefill[3], 100.0)
        pl = policy("conductor", cpp={"opportunistic_staggered": staggered}).choose(MID, c, 0.0)
        assert sorted(pl.cpp_group) == group, (busy, staggered)
        assert pl.queue_s == 0.0
        assert pl.ttft_s == makespan(60_000, len(group))
