"""The conductor's named stages (:mod:`mooncake_conductor.scoring`): each scorer on its
own, the filter and the picker, and the policy deciding the same by its stages (the
Python path, ``explain``) as by the fused kernel (the FIFO path). The kernel against
the stages bit for bit: ``test_kernels.py``."""

from __future__ import annotations

import math
import random

from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.policies.base import PolicyContext, SLOConfig
from mooncake_conductor.policies.registry import create_policy
from mooncake_conductor.scoring import (
    SCORERS,
    Option,
    PoolPrices,
    breakdown,
    pool_prices,
    score,
    shut_out,
    slo_guard,
    tie_band,
    work_price,
)
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState

from .helpers import BT, COST, request


def _opt(iid: int, queue_s: float, transfer_s: float, prefill_s: float, fetch: int = 0,
         position: int = 0, size: int = 1) -> Option:
    return Option(iid, 0, fetch, queue_s, transfer_s, prefill_s, 0.0, position, size)


FREE = PoolPrices(kappa=0.0, first=0.0, second=0.0, first_at=0, shut_rate=0.0)


def test_the_stages_and_their_order() -> None:
    assert [name for name, _ in SCORERS] == ["queue", "transfer", "prefill", "work_price",
                                             "shut_out"]


def test_an_idle_pool_ranks_by_ttft_alone() -> None:
    o = _opt(0, 1.0, 0.25, 2.0)
    assert o.ttft_s == 3.25
    assert score(o, FREE) == 3.25
    assert breakdown(o, FREE) == {"queue": 1.0, "transfer": 0.25, "prefill": 2.0,
                                  "work_price": 0.0, "shut_out": 0.0}


def test_work_is_priced_per_gpu_second_of_every_member() -> None:
    prices = PoolPrices(kappa=1.5, first=0.0, second=0.0, first_at=0, shut_rate=0.0)
    assert work_price(_opt(0, 0.0, 0.0, 2.0), prices) == 3.0
    assert work_price(_opt(0, 5.0, 9.0, 2.0, size=3), prices) == 9.0  # queue and fetch: free


def test_kappa_counts_busy_instances_and_waiting_requests() -> None:
    # 4 instances: one runs, one has 2 queued, two are idle -> (2 busy + 2 waiting) / 4
    prices = pool_prices([3.0, 5.0, 0.0, 0.0], [0, 2, 0, 0], [True, False, False, False],
                         work_weight=2.0, shut_rate=0.0, open_s=10.0)
    assert prices.kappa == 2.0 * (2 + 2) / 4


def test_the_shut_out_counts_the_first_other_instance_to_free() -> None:
    # free at 4 s (position 1) and 6 s: arrivals at 0.5/s wait t**2/4
    prices = pool_prices([6.0, 4.0, 9.0], [1, 1, 1], [True, True, True], 0.0, 0.5, 10.0)
    assert (prices.first, prices.first_at, prices.second) == (4.0, 1, 6.0)
    # on the instance that frees first, the pool stays shut until the next one frees
    assert shut_out(_opt(1, 4.0, 0.0, 3.0, position=1), prices) == 0.5 * 6.0 ** 2 / 2
    # elsewhere the first one still frees at 4 s, unless this choice is done sooner
    assert shut_out(_opt(0, 6.0, 0.0, 3.0, position=0), prices) == 0.5 * 4.0 ** 2 / 2
    assert shut_out(_opt(0, 1.0, 0.0, 1.0, position=0), prices) == 0.5 * 2.0 ** 2 / 2


def test_no_shut_out_once_the_pool_saturates_or_an_instance_is_idle() -> None:
    saturated = pool_prices([6.0, 4.0], [1, 1], [True, True], 0.0, 0.5, open_s=3.0)
    assert saturated.shut_rate == 0.0
    assert shut_out(_opt(0, 6.0, 0.0, 3.0), saturated) == 0.0
    idle = pool_prices([0.0, 4.0], [0, 1], [False, True], 0.0, 0.5, open_s=3.0)
    assert idle.shut_rate == 0.5
    assert shut_out(_opt(1, 4.0, 0.0, 3.0, position=1), idle) == 0.0  # free at once
    edge = pool_prices([3.0, 4.0], [1, 1], [True, True], 0.0, 0.5, open_s=3.0)
    assert edge.shut_rate == 0.5  # the first frees just within the open share


def test_the_slo_guard_acts_only_with_the_shut_out_priced() -> None:
    options = [_opt(0, 0.0, 0.0, 40.0), _opt(1, 0.0, 0.0, 20.0, position=1)]
    priced = PoolPrices(0.0, 1.0, 2.0, 0, shut_rate=1.0)
    assert slo_guard(options, [10.0, 50.0], 30.0, priced) == [math.inf, 50.0]
    assert slo_guard(options, [10.0, 50.0], 30.0, FREE) == [10.0, 50.0]
    # when no option meets the SLO, none is ruled out
    assert slo_guard(options, [10.0, 50.0], 5.0, priced) == [10.0, 50.0]
    # one that ends right at the SLO meets it
    assert slo_guard(options, [10.0, 50.0], 20.0, priced) == [math.inf, 50.0]


def test_the_picker_keeps_the_band_and_prefers_no_copy() -> None:
    options = [_opt(0, 0.0, 0.0, 1.0, fetch=3), _opt(1, 0.0, 0.0, 1.0), _opt(2, 0, 0, 2.0)]
    assert tie_band(options, [1.0, 1.01, 2.0], 0.02, 0.0) == [1]
    assert tie_band(options, [1.0, 1.03, 2.0], 0.02, 0.0) == [0]  # out of the band
    assert tie_band(options, [1.0, 1.03, 2.0], 0.02, 0.01) == [1]  # the absolute band
    assert tie_band(options[:1], [1.0], 0.0, 0.0) == [0]


def _pool(r: random.Random, now: float) -> ClusterState:
    n = r.choice([2, 3, 6, 9])
    c = ClusterState(
        prefill=[PrefillState(iid=i, name=f"p{i}") for i in range(n)],
        decode=[DecodeState(iid=0, capacity_tokens=COST.kv_capacity_tokens)],
        index=PrefixIndex(10_000, instances=n + 1))
    c.store_id = n if r.random() < 0.5 else None
    for p in c.prefill:
        p.busy_until = r.choice([0.0, now + r.random() * 4])
        for k in range(r.choice([0, 0, 1, 3])):
            p.enqueue(1_000 + k, 0.0, r.random() * 3, 4, 4 * BT)
        if r.random() < 0.2:
            p.up = False
    c.prefill[r.randrange(n)].up = True
    for holder in range(n + 1):
        if r.random() < 0.5:
            c.index.store(holder, list(range(r.randint(1, 60))))
    return c


def test_the_policy_decides_the_same_by_its_stages_and_by_the_kernel() -> None:
    """Same pools, same random draws: ``explain`` runs the stages one instance at a time,
    the default the fused ranking; the placements are the same (CPP groups, shut-out
    priced once enough arrivals are seen, tight SLOs included)."""
    r = random.Random(11)
    slo = SLOConfig(ttft_s=8.0)
    by = {mode: create_policy("conductor", PolicyContext(cost=COST, slo=slo,
                                                         rng=random.Random(3)),
                              {"explain": mode == "stages"})
          for mode in ("stages", "kernel")}
    fetched = groups = 0
    for rid in range(400):
        now = rid * 0.2
        c = _pool(r, now)
        keys = list(range(r.randint(1, 200)))
        req = request(keys, tokens=len(keys) * BT - r.randrange(BT), arrival=now, rid=rid)
        got = {mode: p.choose(req, c, now) for mode, p in by.items()}
        got["stages"].candidates = []
        assert got["stages"] == got["kernel"], rid
        fetched += got["kernel"].fetch_blocks > 0
        groups += len(got["kernel"].cpp_group) > 1
    # the fetch option and CPP groups decided some, and the shut-out was priced
    assert fetched > 20 and groups > 5
    assert all(p._arrivals.settled for p in by.values())  # type: ignore[attr-defined]


def test_explain_shows_the_stages_the_choice_ranks_by_and_changes_nothing() -> None:
    r = random.Random(5)
    slo = SLOConfig(ttft_s=8.0)
    pol = create_policy("conductor", PolicyContext(cost=COST, slo=slo, rng=random.Random(3)),
                        {"cpp": {"enabled": False}})
    agreed = 0
    for rid in range(200):
        now = rid * 0.2
        c = _pool(r, now)
        keys = list(range(r.randint(1, 120)))
        req = request(keys, arrival=now, rid=rid)
        # as the gateway does: the decision first (it measures the arrival), then explain
        chosen = pol.choose(req, c, now)
        rng_before = pol.ctx.rng.getstate()
        rows = pol.explain(req, c, now, top=100)
        assert pol.explain(req, c, now, top=100) == rows  # nothing observed or drawn
        assert pol.ctx.rng.getstate() == rng_before
        assert {row["instance"] for row in rows} == {p.iid for p in c.prefill if p.up}
        for row in rows:
            ttft = row["queue_s"] + row["transfer_s"] + row["prefill_s"]
            assert row["ttft_s"] == ttft
            if math.isfinite(row["score_s"]):
                assert row["score_s"] == ttft + row["work_price_s"] + row["shut_out_s"]
        assert [row["score_s"] for row in rows] == sorted(row["score_s"] for row in rows)
        top = [row for row in rows if row["score_s"] <= rows[0]["score_s"] * 1.02 + 0.005]
        assert chosen.prefill in {row["instance"] for row in top}  # inside the tie band
        agreed += len(top) == 1
    assert agreed > 50  # most choices are unique: explain's first row is the choice


def test_a_policy_without_its_own_pricing_explains_recompute_by_ttft() -> None:
    c = _pool(random.Random(2), 1.0)
    pol = create_policy("least-load", PolicyContext(cost=COST, slo=SLOConfig(),
                                                    rng=random.Random(0)), {})
    req = request(list(range(30)), arrival=1.0)
    rows = pol.explain(req, c, 1.0, top=2)
    assert len(rows) == min(2, sum(p.up for p in c.prefill))
    for row in rows:
        p = next(p for p in c.prefill if p.iid == row["instance"])
        assert row["queue_s"] == p.wait_time(1.0)
        assert row["prefill_s"] == COST.prefill_time(req.input_tokens, row["cached_tokens"])
    assert [row["ttft_s"] for row in rows] == sorted(row["ttft_s"] for row in rows)
