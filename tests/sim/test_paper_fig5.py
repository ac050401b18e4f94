"""What issue #2 must show, on the bundled Mooncake conversation trace with the preset
(its realism included: prediction error, event lag, NIC contention; mean TTFT with
rejections charged the TTFT SLO).

This replays all 12,031 requests once per policy (about 2-4 s each)."""

import pytest
from mooncake_sim.cli import DEFAULT_COMPARE
from mooncake_sim.engine import simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.trace import bundled_trace, load_trace, reuse_ceiling


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    records = load_trace(bundled_trace())
    preset = PRESETS["paper-fig5"]
    speed = speed_for_utilization(records, preset.prefill, preset.target_utilization)
    out = {}
    for policy in DEFAULT_COMPARE.split(","):
        cfg = preset.sim_config(policy, speed)
        out[policy] = simulate(records, cfg)
    out["_ceiling"] = {"tokens": reuse_ceiling(records)[0]}
    return out


def ttft(results: dict[str, dict], policy: str) -> float:
    return float(results[policy]["ttft_mean_s"])


def test_figure5_ranking_and_ratios(results: dict[str, dict]) -> None:
    assert ttft(results, "random") > ttft(results, "least-load") > ttft(
        results, "local-cache-aware") > ttft(results, "kvcache-centric")
    assert ttft(results, "random") / ttft(results, "kvcache-centric") >= 3.0
    assert ttft(results, "least-load") / ttft(results, "kvcache-centric") >= 1.3


def test_conductor_beats_every_other_policy(results: dict[str, dict]) -> None:
    # Measured with planned CPP chunks for both designs that run CPP: level with the
    # paper's whole system (mooncake-paper: 1.00x on the charged mean, the same SLO
    # attainment) and at least 13% below every other design (docs/paper-fig5.md). This
    # guards both: never more than 2% behind mooncake-paper, at least 10% ahead of the
    # rest, and SLO attainment at or above every other (mooncake-paper within 0.05 points).
    ours = results["conductor"]
    for name, r in results.items():
        if name in ("conductor", "_ceiling"):
            continue
        if name == "mooncake-paper":
            assert ours["ttft_mean_charged_s"] <= 1.02 * r["ttft_mean_charged_s"]
            assert ours["slo_attainment"] >= r["slo_attainment"] - 0.0005
            continue
        assert r["ttft_mean_charged_s"] >= 1.10 * ours["ttft_mean_charged_s"], name
        assert ours["slo_attainment"] >= r["slo_attainment"], name


def test_conductor_reaches_the_reuse_ceiling(results: dict[str, dict]) -> None:
    assert results["conductor"]["token_hit_ratio"] >= 0.75 * results["_ceiling"]["tokens"]
