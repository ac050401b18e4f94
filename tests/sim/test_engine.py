import math
from typing import Any

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.engine import ConductorConfig
from mooncake_conductor.stepcost import chunked_prefill_time
from mooncake_sim.engine import SimConfig, Simulation, simulate
from mooncake_sim.synth import generate
from mooncake_sim.trace import TraceRecord, reuse_ceiling

KEYS = (
    "policy", "requests", "completed", "rejected", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
    "ttft_p99_s", "tbt_p90_ms", "slo_attainment", "token_hit_ratio", "prefill_gpu_seconds",
    "wall_seconds",
)


def cfg(policy: str, **kw: Any) -> SimConfig:
    kw.setdefault("prefill", 4)
    return SimConfig(decode=4, conductor=ConductorConfig(policy=policy), **kw)


def test_single_request_timing_is_the_cost_model() -> None:
    rec = [TraceRecord(0.0, 8192, 11, tuple(range(16)))]
    sim = Simulation(rec, cfg("least-load"))
    r = sim.run()
    assert set(KEYS) <= set(r)
    assert r["completed"] == 1 and r["rejected"] == 0
    assert r["ttft_mean_s"] == pytest.approx(sim.cost.prefill_time(8192))
    # 10 decode steps alone on an instance: TBT = the largest interval (top 10% of 10)
    step = sim.cost.decode_step_time(1, 8193)
    assert r["tbt_p90_ms"] >= 1000 * step * 0.99
    assert r["token_hit_ratio"] == 0.0


@pytest.mark.parametrize("handoff", ["layerwise", "after-prefill"])
def test_a_clients_first_token_comes_from_the_decode_instance(handoff: str) -> None:
    """One request alone: TTFT ends with the prefill; the client's first token comes one
    decode step after the KV arrived, the last layer's share of the transfer after the
    prefill with the paper's layer-wise stream, all of it when the decode instance pulls
    the KV once the prefill ends (vLLM's Mooncake connector)."""
    rec = [TraceRecord(0.0, 8192, 11, tuple(range(16)))]
    sim = Simulation(rec, cfg("least-load", kv_handoff=handoff))
    r = sim.run()
    cost = sim.cost
    transfer = cost.transfer_time(8192)
    arrives = transfer / cost.config.model.layers if handoff == "layerwise" else transfer
    want = cost.prefill_time(8192) + arrives + cost.decode_step_time(1, 8193)
    assert r["ttft_mean_s"] == pytest.approx(cost.prefill_time(8192))
    assert r["client_ttft_mean_s"] == pytest.approx(want)


def test_a_serving_stacks_overhead_lengthens_each_prefill_unpredicted() -> None:
    """``prefill_overhead_s``: every prefill runs that much beyond the model, and the
    Conductor does not predict it (it learns of it from completions, as a gateway does);
    the second request, queued behind the first, waits for it too."""
    recs = [TraceRecord(0.0, 8192, 1, tuple(range(16))),
            TraceRecord(0.0, 4096, 1, tuple(range(100, 108)))]
    over = 0.25
    base = Simulation(recs, cfg("round-robin", prefill=1))
    slow = Simulation(recs, cfg("round-robin", prefill=1, prefill_overhead_s=over))
    b, s = base.run(), slow.run()
    assert [r.exec_s - r.predicted_s for r in slow.reqs] == pytest.approx([over, over])
    assert [r.predicted_s for r in slow.reqs] == pytest.approx(
        [r.predicted_s for r in base.reqs])
    # the first finishes `over` later, the second `2 * over` (it waited for the first)
    assert s["ttft_mean_s"] - b["ttft_mean_s"] == pytest.approx(1.5 * over)


@pytest.mark.parametrize("budget", [0, 8192, 2048])
def test_prefill_engines_with_a_step_budget_run_long_prompts_in_passes(budget: int) -> None:
    """``engine_chunk_tokens``: a prompt longer than the budget runs as the chunked
    prefill time (one fixed cost per pass), as a worker steps it; the Conductor still
    predicts one pass, and a prompt within the budget is not affected."""
    recs = [TraceRecord(0.0, 20_000, 1, tuple(range(40))),
            TraceRecord(0.0, 1500, 1, tuple(range(100, 103)))]
    sim = Simulation(recs, cfg("round-robin", prefill=2, engine_chunk_tokens=budget))
    sim.run()
    long, short = sim.reqs
    cost = sim.cost
    assert long.exec_s == pytest.approx(chunked_prefill_time(cost, 20_000, 0, budget))
    assert long.predicted_s == pytest.approx(cost.prefill_time(20_000))
    assert (long.exec_s > long.predicted_s) == bool(budget)
    assert short.exec_s == pytest.approx(chunked_prefill_time(cost, 1500, 0, budget))
    assert (short.exec_s > short.predicted_s * (1 + 1e-9)) == (0 < budget < 1500)


def test_an_instance_whose_prefill_ended_early_is_idle_at_once() -> None:
    """A prefill that ends before its predicted end with nothing queued behind it leaves
    its instance idle from its answer on, as the gateway counts it (it drops the
    prefill's work when the engine answers), not busy until the predicted end: the next
    request placed there is told it waits nothing."""
    predicted = CostModel().prefill_time(8192)  # the simulator's model: the default
    first = TraceRecord(0.0, 8192, 1, tuple(range(16)))
    # the second arrives after the first ran (half its prediction), before its predicted end
    later = TraceRecord(1000 * 0.75 * predicted, 4096, 1, tuple(range(100, 108)))
    sim = Simulation([first, later], cfg("least-load", prefill=1, model_bias=-0.5))
    assert sim.cost.prefill_time(8192) == predicted
    sim.run()
    a, b = sim.reqs
    assert a.exec_s == pytest.approx(0.5 * predicted)
    assert b.decision is not None and b.decision.placement.queue_s == 0.0
    assert b.ttft == pytest.approx(b.exec_s)


def test_a_single_token_answer_is_the_prefills() -> None:
    rec = [TraceRecord(0.0, 4096, 1, tuple(range(8)))]
    r = simulate(rec, cfg("least-load", kv_handoff="after-prefill"))
    assert r["client_ttft_mean_s"] == r["ttft_mean_s"]


def test_second_turn_reuses_the_first_on_the_same_instance() -> None:
    recs = [TraceRecord(0.0, 4096, 2, tuple(range(8))),
            TraceRecord(60_000.0, 6000, 2, tuple(range(12)))]
    for policy in ("local-cache-aware", "kvcache-centric", "conductor"):
        r = simulate(recs, cfg(policy))
        assert r["token_hit_ratio"] == pytest.approx(4096 / (4096 + 6000)), policy


def test_queueing_appears_under_load_and_counts_conserve() -> None:
    recs = [TraceRecord(0.0, 16_384, 5, tuple(range(i * 100, i * 100 + 32))) for i in range(12)]
    r = simulate(recs, cfg("round-robin"))
    assert r["completed"] + r["rejected"] == 12
    one = simulate(recs[:1], cfg("round-robin"))["ttft_mean_s"]
    assert r["ttft_mean_s"] > 1.5 * one  # three prompts queue on each of 4 instances


def test_deterministic_for_a_seed() -> None:
    recs = generate("toolagent", 300, seed=3)
    a = simulate(recs, cfg("random", speed=3.0))
    b = simulate(recs, cfg("random", speed=3.0))
    a.pop("wall_seconds"), b.pop("wall_seconds")
    assert a == b


def test_hit_ratio_never_beats_the_ceiling() -> None:
    recs = generate("conversation", 800, seed=5)
    ceiling, _ = reuse_ceiling(recs)
    for policy in ("sglang-cache-aware", "conductor"):
        r = simulate(recs, SimConfig(prefill=16, decode=16,
                                     conductor=ConductorConfig(policy=policy)))
        assert r["rejected"] == 0
        assert r["token_hit_ratio"] <= ceiling + 1e-9


def test_store_pool_serves_fetches() -> None:
    recs = [TraceRecord(0.0, 8192, 2, tuple(range(16))),
            TraceRecord(1.0, 8192, 2, tuple(range(16)))]
    r = simulate(recs, SimConfig(prefill=2, decode=1, store_tokens=100_000,
                                 conductor=ConductorConfig(policy="kvcache-centric")))
    assert r["completed"] == 2


def test_cpp_gangs_complete_without_deadlock() -> None:
    # many SLO-breaking prompts at once force overlapping CPP groups
    recs = [TraceRecord(float(i), 100_000, 3, tuple(range(i * 1000, i * 1000 + 196)))
            for i in range(10)]
    sim = Simulation(recs, cfg("conductor", speed=1.0))
    r = sim.run()
    assert r["completed"] + r["rejected"] == 10
    assert r["completed"] >= 1
    assert all(math.isfinite(q.ttft) for q in sim.reqs if not q.decision.rejected)
    assert any(q.decision.placement.cpp_group for q in sim.reqs)


def test_decode_capacity_makes_requests_wait() -> None:
    recs = [TraceRecord(0.0, 4096, 50, tuple(range(i * 10, i * 10 + 8))) for i in range(4)]
    small = simulate(recs, SimConfig(prefill=4, decode=1, decode_capacity_tokens=9000,
                                     conductor=ConductorConfig(policy="least-load")))
    big = simulate(recs, SimConfig(prefill=4, decode=1,
                                   conductor=ConductorConfig(policy="least-load")))
    assert small["completed"] == 4
    assert small["tbt_p99_ms"] > big["tbt_p99_ms"]
