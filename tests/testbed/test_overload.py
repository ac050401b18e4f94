"""The live overload judge (``mooncake_testbed.overload``): what counts as admitted and
within SLO, the 429 latencies, and memory growth after warm-up."""

from __future__ import annotations

import math

import pytest
from mooncake_testbed import overload


def _o(status: str, ttft: float = math.nan, tbt: float = math.nan, sent: float = 0.0,
       done: float = 0.0) -> dict[str, object]:
    return {"status": status, "ttft_s": ttft, "tbt_s": tbt, "sent_s": sent, "done_s": done}


def test_admitted_counts_failures_as_misses_and_429s_not_at_all() -> None:
    outs = [
        _o("ok", 1.0, 0.05), _o("ok", 31.0, 0.05), _o("ok", 2.0, 0.2),
        _o("failed"), _o("rejected", sent=1.0, done=1.02), _o("rejected", sent=2.0, done=2.1),
    ]
    r = overload.judge(outs, 30.0, 0.1)
    assert (r["requests"], r["completed"], r["rejected"], r["failed"]) == (6, 3, 2, 1)
    assert r["admitted"] == 4
    assert r["admitted_within_slo"] == pytest.approx(1 / 4)
    assert r["within_ttft"] == pytest.approx(2 / 4)
    assert r["within_tbt"] == pytest.approx(2 / 4)
    assert r["rejected_share"] == pytest.approx(2 / 6)
    assert r["reject_ms_p50"] == pytest.approx(20.0)
    assert r["reject_ms_max"] == pytest.approx(100.0)
    assert r["tbt_p99_ms"] == pytest.approx(200.0)


def test_nothing_admitted_is_not_a_success() -> None:
    r = overload.judge([_o("rejected", sent=0, done=0.01)], 30.0, 0.1)
    assert r["admitted"] == 0 and math.isnan(r["admitted_within_slo"])
    lines = overload.reading({"rows": [{"factor": 4.0, "rule": "prediction", **r}]}, 0.95)
    assert "misses" in lines[0]


def test_memory_growth_is_the_worst_gateways_peak_after_warm_up() -> None:
    samples = {
        "a": [(1.0, 100), (2.0, 110), (5.0, 120), (9.0, 115)],  # warm at 2.0: 110 → 120
        "b": [(1.0, 200), (6.0, 200)],
    }
    g = overload.rss_growth(samples, duration_s=10.0)  # warm-up: the first 2.5 s
    assert g["gateways"]["a"]["warm_bytes"] == 110
    assert g["growth"] == pytest.approx(120 / 110 - 1)
    assert g["gateways"]["b"]["growth"] == 0.0
    lone = overload.rss_growth({"c": [(1.0, 5)]}, duration_s=10.0)
    assert math.isnan(lone["growth"])


def test_the_page_names_met_and_missed_rows() -> None:
    ok = overload.judge([_o("ok", 1.0, 0.05)] * 99 + [_o("ok", 40.0, 0.05)], 30.0, 0.1)
    bad = overload.judge([_o("ok", 1.0, 0.05)] * 9 + [_o("ok", 40.0, 0.05)], 30.0, 0.1)
    mem = {"growth": 0.02}
    section = {"capacity": {"speed": 0.65, "command": "mooncake-operator capacity",
                            "rejected_work_share": 0.48},
               "requests": 100, "ttft_slo_s": 30.0, "tbt_slo_s": 0.1,
               "rows": [{"factor": 2.0, "rule": "prediction", **ok, "memory": mem,
                         "inflight_max": 9},
                        {"factor": 4.0, "rule": "margin", "ttft_miss_risk": 0.01, **bad,
                         "memory": mem, "inflight_max": 12,
                         "prefill_predictions": {"answered": 10, "predicted_mean_s": 20.0,
                                                 "answered_mean_s": 25.0, "ratio_p50": 1.2,
                                                 "ratio_p90": 1.6, "late_share": 0.2}},
                        {"factor": 4.0, "rule": "prediction", "run_error": "boom"}]}
    page = "\n".join(overload.markdown(section, 0.5, 64, 0.95))
    assert "**99.00%**" in page and "**90.00%**" in page
    assert "2×, prediction: meets 95.00%" in page
    assert "4×, margin: **misses** 95.00%" in page and "TTFT 10.00% of the admitted" in page
    assert "run failed: boom" in page
    assert page.count("Admission predicted") == 1
    assert "predicted the admitted prefills' answers 20.0 s" in page and "after 25.0 s" in page
    assert "p50 1.20, p90 1.60; 20.00% more than 1.5× late" in page
    assert "groups of requests sent at one instant" in page
    spread = "\n".join(overload.markdown({**section, "spread_ms": 3000.0, "gateways": 1},
                                         0.5, 64, 0.95))
    assert "spread within the trace's 3 s rounding step" in spread
    assert "1 gateway(s) serve" in spread


def test_the_gateways_time_to_429_is_read_from_their_buckets() -> None:
    """Cumulative bucket increases per path: the p99 is the bound of the first bucket that
    holds 99% of that path's 429s; a path with none is left out."""
    grew = {"at-once/0.005": 90, "at-once/0.01": 99, "at-once/0.02": 100, "at-once/+Inf": 100,
            "after-hold/1.0": 3, "after-hold/5.0": 4, "after-hold/+Inf": 4,
            "other/+Inf": 0}
    times = overload.gateway_rejection_times(grew)
    assert times == {"at-once": {"rejected": 100, "p99_bound_s": 0.01},
                     "after-hold": {"rejected": 4, "p99_bound_s": 5.0}}
    row = {"factor": 4.0, "rule": "margin", "ttft_miss_risk": 0.01,
           **overload.judge([_o("ok", 1.0, 0.05)], 30.0, 0.1),
           "memory": {"growth": 0.0}, "inflight_max": 1, "gateway_rejection_s": times}
    section = {"capacity": {"speed": 0.65, "command": "c", "rejected_work_share": 0.4},
               "requests": 1, "ttft_slo_s": 30.0, "tbt_slo_s": 0.1, "rows": [row]}
    page = "\n".join(overload.markdown(section, 0.5, 64, 0.95))
    assert ("The gateways' own time to them: after-hold: 4, p99 within 5 s; "
            "at-once: 100, p99 within 10 ms.") in page


def test_prefill_predictions_pair_each_admitted_first_answer_with_its_prediction() -> None:
    def rec(t: float, predicted: float, answered: float, status: int = 200,
            reject: str | None = None, tries: int = 1) -> dict[str, object]:
        attempt = {"prefill": "p0", "status": status, "answered_s": answered,
                   "predicted_s": predicted}
        return {"time": t, "reject_reason": reject, "attempts": [attempt] * tries}

    decisions = [
        rec(5.0, 1.0, 9.0),                  # before the replay: not counted
        rec(10.0, 1.0, 1.2),
        rec(11.0, 2.0, 4.0),                 # late: 2x
        rec(12.0, 2.0, 1.0),
        rec(13.0, 1.0, 1.0, reject="ttft"),  # rejected: not counted
        rec(14.0, 1.0, 1.0, status=503),     # not answered
        rec(15.0, 1.0, 5.0, tries=2),        # retried: not its first placement's answer
    ]
    got = overload.prefill_predictions(decisions, since=10.0)
    assert got["answered"] == 3
    assert got["predicted_mean_s"] == pytest.approx(5.0 / 3)
    assert got["answered_mean_s"] == pytest.approx(6.2 / 3)
    assert got["ratio_p50"] == pytest.approx(1.2)
    assert got["late_share"] == pytest.approx(1 / 3)
    assert overload.prefill_predictions(decisions[:1], since=10.0) == {"answered": 0}


def test_sole_answer_is_the_only_attempt_when_it_answered() -> None:
    ok = {"prefill": "p0", "status": 200, "answered_s": 1.0}
    assert overload.sole_answer({"attempts": [ok]}) is ok
    assert overload.sole_answer({"attempts": []}) is None
    assert overload.sole_answer({"reject_reason": "ttft-slo"}) is None
    assert overload.sole_answer({"attempts": [{"prefill": "p0", "error": "reset"}, ok]}) is None
    assert overload.sole_answer({"attempts": [{**ok, "status": 503}]}) is None
