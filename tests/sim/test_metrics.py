"""latency_summary and percentile on small hand-made inputs, expectations worked by hand."""

import math

import pytest
from mooncake_sim.metrics import latency_summary, percentile

KEYS = {"ttft_mean_s", "ttft_mean_charged_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
        "tbt_mean_ms", "tbt_p90_ms", "tbt_p99_ms", "slo_attainment"}


def test_percentile_is_nearest_rank() -> None:
    # rank = ceil(q * n), 1-based; the element at that rank
    seven = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    assert percentile(seven, 0.5) == 40.0  # ceil(3.5) = 4th
    assert percentile(seven, 0.9) == 70.0  # ceil(6.3) = 7th
    assert percentile(seven, 0.25) == 20.0  # ceil(1.75) = 2nd
    ten = [float(i) for i in range(1, 11)]
    assert percentile(ten, 0.5) == 5.0  # rank exactly 5: no rounding up past it
    assert percentile(ten, 0.9) == 9.0
    assert percentile(ten, 0.99) == 10.0
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 0.99) == 99.0  # not the maximum
    assert percentile(hundred, 0.9) == 90.0
    assert percentile(hundred, 0.01) == 1.0


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 0.5))
    assert percentile([3.0], 0.5) == 3.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0], 0.0) == 1.0  # rank 0 clamps to the first
    assert percentile([1.0, 2.0], 1.0) == 2.0
    assert percentile([1.0, 2.0], 1.5) == 2.0  # clamps to the last


def test_summary_statistics_by_hand() -> None:
    # 20 served requests, given out of order: TTFT 1..20 s, TBT 1..20 ms (reversed pairing)
    served = [(float(t), (21 - t) / 1000.0) for t in (7, 3, 20, 1, 15, 9, 12, 2, 18, 5, 11,
                                                        4, 19, 6, 14, 8, 17, 10, 16, 13)]
    s = latency_summary(served, 20, ttft_slo_s=100.0, tbt_slo_s=1.0)
    assert set(s) == KEYS
    assert s["ttft_mean_s"] == pytest.approx(10.5)  # (1 + ... + 20) / 20
    assert s["ttft_mean_charged_s"] == pytest.approx(10.5)  # nothing rejected: the same
    assert s["ttft_p50_s"] == 10.0  # rank 10
    assert s["ttft_p90_s"] == 18.0  # rank 18
    assert s["ttft_p99_s"] == 20.0  # rank ceil(19.8) = 20
    assert s["tbt_mean_ms"] == pytest.approx(10.5)
    assert s["tbt_p90_ms"] == pytest.approx(18.0)
    assert s["tbt_p99_ms"] == pytest.approx(20.0)
    assert s["slo_attainment"] == 1.0


def test_p99_of_a_hundred_is_not_the_maximum() -> None:
    served = [(float(i), i / 1000.0) for i in range(100, 0, -1)]  # 1..100 s and ms
    s = latency_summary(served, 100, ttft_slo_s=50.0, tbt_slo_s=1.0)
    assert (s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"]) == (50.0, 90.0, 99.0)
    assert s["tbt_p90_ms"] == pytest.approx(90.0)
    assert s["tbt_p99_ms"] == pytest.approx(99.0)
    assert s["slo_attainment"] == pytest.approx(0.5)  # TTFT 1..50 s meet 50 s


def test_ttft_and_tbt_statistics_are_separate() -> None:
    # TTFTs and TBTs on different scales: a mix-up of the two columns shows
    served = [(1.0, 0.3), (2.0, 0.1), (6.0, 0.2)]
    s = latency_summary(served, 3, ttft_slo_s=100.0, tbt_slo_s=100.0)
    assert s["ttft_mean_s"] == pytest.approx(3.0)
    assert s["ttft_p50_s"] == 2.0  # rank ceil(1.5) = 2
    assert s["ttft_p90_s"] == 6.0
    assert s["tbt_mean_ms"] == pytest.approx(200.0)
    assert s["tbt_p90_ms"] == pytest.approx(300.0)
    assert s["tbt_p99_ms"] == pytest.approx(300.0)


def test_slo_attainment_needs_both_ttft_and_tbt() -> None:
    # TTFT SLO 2 s, TBT SLO 100 ms
    served = [
        (1.0, 0.05),  # meets both
        (2.0, 0.1),  # exactly at both thresholds: meets them
        (3.0, 0.05),  # TTFT miss
        (1.0, 0.2),  # TBT miss only
        (5.0, 0.5),  # both miss
    ]
    s = latency_summary(served, 5, ttft_slo_s=2.0, tbt_slo_s=0.1)
    assert s["slo_attainment"] == pytest.approx(2 / 5)


def test_a_tbt_miss_alone_is_a_miss() -> None:
    s = latency_summary([(0.1, 0.101)], 1, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert s["slo_attainment"] == 0.0


def test_a_ttft_miss_alone_is_a_miss() -> None:
    s = latency_summary([(30.001, 0.0)], 1, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert s["slo_attainment"] == 0.0


def test_slo_attainment_is_over_all_requests_rejected_count_as_misses() -> None:
    # 2 served, both within the SLOs; 3 more were rejected
    s = latency_summary([(1.0, 0.01), (2.0, 0.02)], 5, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    # latency statistics are over the served requests only
    assert s["ttft_mean_s"] == pytest.approx(1.5)
    assert s["tbt_mean_ms"] == pytest.approx(15.0)
    # the charged mean is over all five, the three rejected at the 30 s SLO
    assert s["ttft_mean_charged_s"] == pytest.approx((1.0 + 2.0 + 3 * 30.0) / 5)


def test_all_rejected() -> None:
    s = latency_summary([], 4, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert set(s) == KEYS
    assert s["slo_attainment"] == 0.0
    assert s["ttft_mean_charged_s"] == pytest.approx(30.0)  # each charged the TTFT SLO
    for k in KEYS - {"slo_attainment", "ttft_mean_charged_s"}:
        assert math.isnan(s[k]), k


def test_no_requests_at_all() -> None:
    s = latency_summary([], 0, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert set(s) == KEYS
    for k in KEYS:
        assert math.isnan(s[k]), k


def test_single_request() -> None:
    s = latency_summary([(0.25, 0.04)], 1, ttft_slo_s=30.0, tbt_slo_s=0.1)
    assert s == {"ttft_mean_s": 0.25, "ttft_mean_charged_s": 0.25, "ttft_p50_s": 0.25,
                 "ttft_p90_s": 0.25, "ttft_p99_s": 0.25, "tbt_mean_ms": 40.0, "tbt_p90_ms": 40.0,
                 "tbt_p99_ms": 40.0, "slo_attainment": 1.0}
