"""The colocated chunked-prefill baseline: step costs, interference, KV room, prefix cache,
routers, shedding, config validation and determinism, on small hand-made traces."""

from __future__ import annotations

import math
import random

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_sim.colocated import (
    ColocatedConfig,
    ColocatedSim,
    simulate_colocated,
)
from mooncake_sim.colocated_route import (
    InstanceLoad,
    LlmdWeights,
    SGLangRule,
    least_load,
    llmd_weighted,
    sglang_cache_aware,
)
from mooncake_sim.synth import generate
from mooncake_sim.trace import TraceRecord
from pydantic import ValidationError

COST = CostModel()


def rec(t_s: float, n_in: int, n_out: int, ids: tuple[int, ...] | None = None,
        base: int = 0) -> TraceRecord:
    blocks = -(-n_in // 512)
    return TraceRecord(t_s * 1000.0, n_in, n_out,
                       ids if ids is not None else tuple(range(base, base + blocks)))


def one_instance(**kw: object) -> ColocatedConfig:
    return ColocatedConfig.model_validate({"instances": 1, **kw})


# -- replay -------------------------------------------------------------------------------------
def test_a_lone_request_decodes_at_the_decode_step_time() -> None:
    sim = ColocatedSim([rec(0, 1000, 11)], one_instance(cache_tokens=0))
    res = sim.run()
    ttft, tbt = sim.served()[0]
    assert ttft == pytest.approx(COST.prefill_compute_time(1000))
    assert tbt == pytest.approx(COST.decode_step_time(1, 1001))
    assert res["completed"] == 1 and res["rejected"] == 0


def test_a_long_prompt_is_prefilled_in_chunks() -> None:
    sim = ColocatedSim([rec(0, 4096, 2)], one_instance(cache_tokens=0, chunk_tokens=1024))
    res = sim.run()
    whole = COST.prefill_compute_time(4096)
    assert res["prefill_steps"] == 4
    assert whole < sim.served()[0][0] < 1.5 * whole


def _interference(chunk: int) -> float:
    """TBT of one long decode while long prompts keep arriving on its instance."""
    records = [rec(0, 1000, 400, base=10_000)]
    records += [rec(1.0 + 2.0 * i, 16_000, 2, base=20_000 + 100 * i) for i in range(4)]
    sim = ColocatedSim(records, one_instance(cache_tokens=0, chunk_tokens=chunk))
    sim.run()
    return sim.served()[0][1]


def test_prefill_interference_raises_tbt_as_the_chunk_budget_grows() -> None:
    tbts = [_interference(c) for c in (256, 1024, 4096)]
    assert tbts[0] < tbts[1] < tbts[2]
    assert tbts[0] > COST.decode_step_time(1, 1400)


def test_a_larger_budget_lowers_ttft_at_low_load() -> None:
    records = [rec(0, 16_000, 8)]
    ttft = {c: ColocatedSim(records, one_instance(cache_tokens=0, chunk_tokens=c))
            for c in (512, 8192)}
    for s in ttft.values():
        s.run()
    assert ttft[8192].served()[0][0] < 0.8 * ttft[512].served()[0][0]


def test_requests_wait_for_kv_room() -> None:
    records = [rec(0, 3000, 50, base=0), rec(0.001, 3000, 50, base=100)]
    tight = ColocatedSim(records, one_instance(cache_tokens=0, kv_capacity_tokens=4000))
    res = tight.run()
    roomy = ColocatedSim(records, one_instance(cache_tokens=0))
    roomy.run()
    assert res["kv_waits"] == 1
    first, second = tight.served()
    # the second starts only when the first has decoded all of its 50 tokens
    assert second[0] > first[0] + 49 * COST.decode_step_time(1, 3000)
    assert roomy.served()[1][0] < second[0]


def test_a_cached_prefix_skips_compute() -> None:
    shared = tuple(range(16))
    records = [rec(0, 8192, 2, ids=shared), rec(100, 8192 + 512, 2, ids=(*shared, 99))]
    warm = ColocatedSim(records, one_instance())
    res = warm.run()
    assert res["token_hit_ratio"] == pytest.approx(8192 / (2 * 8192 + 512))
    assert warm.served()[1][0] < 0.2 * warm.served()[0][0]
    cold = simulate_colocated(records, one_instance(cache_tokens=0))
    assert cold["token_hit_ratio"] == 0.0


def test_a_synthetic_chat_trace_hits_the_cache_and_not_without_one() -> None:
    records = generate("conversation", 150, seed=3)
    hit = simulate_colocated(records, ColocatedConfig(instances=2, speed=0.5))
    cold = simulate_colocated(records, ColocatedConfig(instances=2, speed=0.5, cache_tokens=0))
    assert hit["token_hit_ratio"] > 0.2
    assert cold["token_hit_ratio"] == 0.0
    assert hit["completed"] == cold["completed"] == 150
    assert hit["ttft_mean_s"] < cold["ttft_mean_s"]


# -- routers ------------------------------------------------------------------------------------
def load(requests: int = 0, queued: int = 0, kv: float = 0.0, cached: int = 0,
         matched: int = 0) -> InstanceLoad:
    return InstanceLoad(requests=requests, queued=queued, kv_usage=kv, cached_tokens=cached,
                        matched_tokens=matched)


def test_sglang_goes_to_the_best_match_above_the_threshold() -> None:
    route = sglang_cache_aware(SGLangRule())
    loads = [load(requests=5, cached=100), load(requests=9, cached=9000, matched=4000)]
    assert route(loads, 10_000, random.Random(0)) == 1


def test_sglang_goes_to_the_smallest_cache_below_the_threshold() -> None:
    route = sglang_cache_aware(SGLangRule())
    loads = [load(requests=1, cached=9000, matched=2000), load(requests=9, cached=100)]
    assert route(loads, 10_000, random.Random(0)) == 1


def test_sglang_switches_to_the_shortest_queue_past_the_imbalance_thresholds() -> None:
    rule = SGLangRule(balance_abs_threshold=32, balance_rel_threshold=1.5)
    route = sglang_cache_aware(rule)
    at_edge = [load(requests=40, matched=9000), load(requests=8)]  # 40 - 8 = 32: not past
    assert route(at_edge, 10_000, random.Random(0)) == 0
    past = [load(requests=41, matched=9000), load(requests=8)]
    assert route(past, 10_000, random.Random(0)) == 1
    # absolute gap past, relative not (100 < 70 * 1.5): still the cache rule
    close = [load(requests=100, matched=9000), load(requests=70)]
    assert route(close, 10_000, random.Random(0)) == 0


def test_llmd_weighs_prefix_queue_and_kv() -> None:
    route = llmd_weighted(LlmdWeights())
    # prefix 3 * 0.9 + kv 2 * 0.8 = 4.3 beats queue 2 + kv 2 of the idle one
    loads = [load(queued=4, kv=0.2, matched=9000), load(queued=0, kv=0.0)]
    assert route(loads, 10_000, random.Random(0)) == 0
    # a small match loses to an idle instance
    loads = [load(queued=4, kv=0.2, matched=1000), load(queued=0, kv=0.0)]
    assert route(loads, 10_000, random.Random(0)) == 1
    only_queue = llmd_weighted(LlmdWeights(prefix=0, kv_utilization=0))
    assert only_queue([load(queued=3), load(queued=1), load(queued=2)], 100,
                      random.Random(0)) == 1


def test_least_load_counts_requests_then_queue() -> None:
    rng = random.Random(0)
    assert least_load([load(requests=3), load(requests=2, queued=2), load(requests=2)],
                      100, rng) == 2
    picks = {least_load([load(), load()], 100, random.Random(s)) for s in range(20)}
    assert picks == {0, 1}  # ties at random


# -- shedding -----------------------------------------------------------------------------------
def _burst() -> list[TraceRecord]:
    return [rec(0.01 * i, 30_000, 4, base=1000 * i) for i in range(12)]


def test_shedding_rejects_only_what_would_miss_the_ttft_slo() -> None:
    slo = 10.0
    on = simulate_colocated(_burst(), one_instance(shedding=True, ttft_s=slo, cache_tokens=0))
    off = simulate_colocated(_burst(), one_instance(ttft_s=slo, cache_tokens=0))
    assert off["rejected"] == 0 and off["ttft_p99_s"] > slo
    assert 0 < on["rejected"] < 12
    assert on["reject_reasons"] == {"overload": on["rejected"]}
    assert on["ttft_p99_s"] <= slo
    roomy = simulate_colocated(_burst(), one_instance(shedding=True, ttft_s=1000.0,
                                                      cache_tokens=0))
    assert roomy["rejected"] == 0


def test_the_prediction_matches_an_idle_instance() -> None:
    sim = ColocatedSim([], one_instance(chunk_tokens=8192))
    flops = COST.flops(4096)
    assert sim.predicted_ttft(sim.insts[0], 0.0, 4096, flops) == pytest.approx(
        COST.prefill_compute_time(4096))


# -- config and determinism ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"instances": 0}, {"chunk_tokens": 0}, {"router": "random"},
                                 {"tbt_top_share": 0}, {"speed": -1}, {"cache_tokens": -1},
                                 {"no_such": 1}, {"sglang": {"cache_threshold": 2}}])
def test_a_bad_config_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ColocatedConfig.model_validate(bad)


@pytest.mark.parametrize("router", ["sglang-cache-aware", "llm-d", "least-load"])
def test_a_seed_gives_the_same_replay(router: str) -> None:
    records = generate("toolagent", 200, seed=5)

    def run(seed: int) -> dict[str, object]:
        r = simulate_colocated(records, ColocatedConfig(instances=4, router=router, seed=seed,
                                                        speed=2.0))
        r.pop("wall_seconds")
        return r

    a, b = run(1), run(1)
    assert a == b
    assert a["policy"] == f"colocated/{router}"
    assert a["completed"] == 200 and not math.isnan(float(str(a["tbt_p90_ms"])))
