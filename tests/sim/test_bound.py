"""The TTFT lower bound: it holds request by request for every policy, and its rule."""

from __future__ import annotations

import random

import pytest
from mooncake_conductor.cost import CostModel, CostModelConfig
from mooncake_conductor.cpp import ChunkPricer, CPPConfig
from mooncake_conductor.policies import policy_names
from mooncake_sim.bound import (
    bounds_for,
    cpp_reach,
    execution_factors,
    loss_split,
    rejected_work_share,
    request_bounds,
    served_reuse_ceiling,
    ttft_lower_bound,
)
from mooncake_sim.engine import SimConfig, Simulation
from mooncake_sim.synth import generate
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace, seen_prefix_blocks

BLOCK = 512
COST = CostModel(CostModelConfig())


def _config(policy: str, speed: float, realism: bool) -> SimConfig:
    return SimConfig(prefill=4, decode=4, speed=speed, prefill_cache_tokens=400_000,
                     prediction_error=0.2 if realism else 0.0,
                     model_bias=0.1 if realism else 0.0,
                     nic_contention=realism, event_lag_ms=100.0 if realism else 0.0,
                     conductor={"policy": policy, "seed": 3,
                                "slo": {"ttft_s": 10.0, "tbt_s": 0.1}})


def _traces() -> dict[str, list[TraceRecord]]:
    # the bundled trace's long prompts (CPP territory) and a synthetic shape with reuse
    return {"conversation": load_trace(bundled_trace(), limit=160),
            "toolagent": generate("toolagent", 160, seed=5)}


@pytest.mark.parametrize(("trace", "realism"), [("conversation", True), ("toolagent", False)])
def test_no_served_request_beats_its_bound_under_any_policy(trace: str, realism: bool) -> None:
    records = _traces()[trace]
    for speed in (0.5, 4.0):  # light and heavy load: queues, CPP, fetches, rejections
        configs = [_config(p, speed, realism) for p in policy_names()]
        bounds = bounds_for(records, configs)
        for cfg in configs:
            sim = Simulation(records, cfg)
            res = sim.run()
            served = 0
            for req, b in zip(sim.reqs, bounds, strict=True):
                if req.decision is not None and not req.decision.rejected:
                    served += 1
                    assert req.ttft >= b * (1 - 1e-9), (cfg.conductor.policy, req.info.rid)
            assert served == res["completed"]
            slo = cfg.conductor.slo.ttft_s
            assert res["ttft_mean_charged_s"] >= ttft_lower_bound(bounds, slo) * (1 - 1e-9)
            # the served requests' hit ratio never passes their own reuse ceiling
            ceiling = served_reuse_ceiling(records, res["rejected_ids"])
            assert res["token_hit_ratio"] <= ceiling + 1e-12, cfg.conductor.policy
            # the excess over the bound splits exactly into wait, prefill and rejections
            parts = loss_split(res, bounds, slo)
            assert sum(parts.values()) == pytest.approx(
                res["ttft_mean_charged_s"] - ttft_lower_bound(bounds, slo), abs=1e-9)


def test_factors_are_the_simulators_own() -> None:
    records = _traces()["toolagent"]
    cfg = _config("conductor", 1.0, realism=True)
    sim = Simulation(records, cfg)
    assert execution_factors(cfg, len(records)) == pytest.approx(list(sim._factor), rel=1e-15)
    plain = _config("conductor", 1.0, realism=False)
    assert execution_factors(plain, 3) == [1.0, 1.0, 1.0]


def test_without_cpp_the_bound_is_the_plain_compute_time() -> None:
    records = [TraceRecord(0.0, 3000, 10, (1, 2, 3, 4, 5, 6)),
               TraceRecord(1.0, 5000, 10, (1, 2, 3, 7, 8, 9, 10, 11, 12, 13))]
    bounds = request_bounds(records, COST, max_group=1, chunk_sizes=(1024, 4096))
    assert bounds == [COST.prefill_compute_time(3000, 0),
                      COST.prefill_compute_time(5000, 3 * BLOCK)]
    # a policy without CPP (or routing only) reaches no further than one instance
    assert cpp_reach(_config("least-load", 1.0, False)) == (1, ())
    routed = _config("conductor", 1.0, False)
    routed.conductor.routing_only = True
    assert cpp_reach(routed) == (1, ())
    assert cpp_reach(_config("conductor", 1.0, False))[0] == 4
    # and factors scale it
    assert request_bounds(records, COST, factors=[2.0, 0.5]) == [2 * bounds[0],
                                                                 0.5 * bounds[1]]


def test_cpp_over_more_instances_lowers_the_bound_of_a_long_prompt() -> None:
    long = [TraceRecord(0.0, 120_000, 10, tuple(range(235)))]
    sizes = (1024, 2048, 4096, 8192)
    one, two, four = (request_bounds(long, COST, g, sizes)[0] for g in (1, 2, 4))
    assert four < two < one
    assert one == COST.prefill_compute_time(120_000, 0)
    # a short prompt gains nothing from a pipeline: the bound stays its compute time
    short = [TraceRecord(0.0, 600, 10, (1, 2))]
    assert request_bounds(short, COST, 4, sizes) == [COST.prefill_compute_time(600, 0)]


def test_the_pipelines_are_priced_as_the_cpp_planner_prices_them() -> None:
    # the bound prices every prompt's pipelines at once; the planner one by one
    rng = random.Random(4)
    records = []
    for i in range(300):
        n = rng.choice([300, 1024, 2048, 5000, 9000, 40_000, 130_000])
        shared = rng.randint(0, n // 512)
        ids = tuple(range(shared)) + tuple(10_000 * (i + 1) + j
                                           for j in range(-(-n // 512) - shared))
        records.append(TraceRecord(float(i), n, 10, ids))
    sizes = (1024, 2048, 4096, 8192)
    got = request_bounds(records, COST, 4, sizes)
    want = []
    cfg = CPPConfig(chunk_choices=sizes)
    for r, k in zip(records, _seen(records), strict=True):
        cached = min(k * BLOCK, r.input_length)
        best = COST.prefill_compute_time(r.input_length, cached)
        if r.input_length > cached:
            pricer = ChunkPricer(COST, r.input_length, cached, cfg)
            best = min(best, *(pricer.choose(g)[1] for g in (2, 3, 4)))
        want.append(best)
    assert got == pytest.approx(want, rel=1e-12)
    assert any(g < COST.prefill_compute_time(r.input_length, 0)
               for g, r in zip(got, records, strict=True) if r.input_length > 40_000)


def _seen(records: list[TraceRecord]) -> list[int]:
    return [k for _, k in seen_prefix_blocks(records)]


def test_the_charged_bound_caps_each_request_at_the_slo() -> None:
    assert ttft_lower_bound([1.0, 50.0, 3.0], 30.0) == pytest.approx((1 + 30 + 3) / 3)


def test_rejected_work_share_is_a_share() -> None:
    work = [1.0, 3.0, 6.0]
    assert rejected_work_share(work, []) == 0.0
    assert rejected_work_share(work, [2, 2]) == pytest.approx(0.6)
    assert rejected_work_share(work, [0, 1, 2]) == pytest.approx(1.0)


def test_served_ceiling_leaves_out_what_the_rejected_would_have_left_cached() -> None:
    records = [TraceRecord(0.0, 1024, 1, (1, 2)), TraceRecord(1.0, 1024, 1, (1, 2)),
               TraceRecord(2.0, 1024, 1, (3, 4))]
    assert served_reuse_ceiling(records, []) == pytest.approx(1 / 3)
    # the first request rejected: the second has nothing to reuse
    assert served_reuse_ceiling(records, [0]) == 0.0
    # the one with no reuse rejected: the served share rises above the all-requests one
    assert served_reuse_ceiling(records, [2]) == pytest.approx(1 / 2)
