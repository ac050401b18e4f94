"""The chaos suite's arithmetic (``mooncake_testbed.chaos``), without a cluster."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
from mooncake_testbed import chaos


def _o(sent: float, done: float, status: str, ttft: float = math.nan) -> dict[str, Any]:
    return {"sent_s": sent, "done_s": done, "status": status, "ttft_s": ttft, "error": ""}


OUTCOMES = [
    _o(0.0, 2.0, "ok", 1.0),
    _o(8.0, 12.0, "failed"),      # in flight at the injection (10 s), failed at 12 s
    _o(9.5, 11.0, "ok", 3.0),     # in flight, served
    _o(10.5, 10.6, "failed"),     # sent after: refused at once
    _o(14.0, 17.5, "failed"),     # the last failure ends 7.5 s after the injection
    _o(15.0, 15.1, "rejected"),   # a 429 is not a failure
    _o(20.0, 30.0, "ok", 5.0),
]


def test_phases_split_requests_at_the_injection() -> None:
    ph = chaos.phases(OUTCOMES, 10.0)
    assert ph["before"] == {"ok": 1, "rejected": 0, "failed": 0}
    assert ph["in_flight"] == {"ok": 1, "rejected": 0, "failed": 1}
    assert ph["after"] == {"ok": 1, "rejected": 1, "failed": 2}


def test_recovery_ends_with_the_last_failure_not_a_rejection() -> None:
    assert chaos.recovery_s(OUTCOMES, 10.0) == 7.5
    assert chaos.recovery_s([o for o in OUTCOMES if o["status"] != "failed"], 10.0) == 0.0
    # a failure that ended before the injection is not the fault's
    assert chaos.recovery_s([_o(1.0, 2.0, "failed")], 10.0) == 0.0


def test_per_second_bins_by_send_time_relative_to_the_injection() -> None:
    bins = chaos.per_second(OUTCOMES, 10.0)
    assert bins[0]["t"] == -10.0 and bins[-1]["t"] == 10.0
    assert len(bins) == 21
    by_t = {b["t"]: b for b in bins}
    assert by_t[0.0] == {"t": 0.0, "ok": 0, "rejected": 0, "failed": 1}
    assert by_t[5.0]["rejected"] == 1 and by_t[-1.0]["ok"] == 1
    assert sum(b["ok"] + b["rejected"] + b["failed"] for b in bins) == len(OUTCOMES)


def test_ttft_median_of_served_requests_in_a_window() -> None:
    assert chaos.ttft_p50(OUTCOMES, 0.0, 10.0) == 2.0
    assert chaos.ttft_p50(OUTCOMES, 10.0, 40.0) == 5.0
    assert chaos.ttft_p50(OUTCOMES, 40.0, 50.0) is None


def test_ready_summary() -> None:
    stayed = [(float(t), "Ready") for t in range(20)]
    assert not chaos.ready_summary(stayed, 5.0)["left_ready"]
    dip = [(0.0, "Ready"), (5.0, "Ready"), (6.0, "EngineNotReady"), (7.0, "API error (URLError)"),
           (8.0, "Ready"), (9.0, "EngineNotReady"), (11.0, "Ready"), (12.0, "Ready")]
    got = chaos.ready_summary(dip, 5.0)
    assert got["left_ready"] and got["ready_again_s"] == 6.0 and got["not_ready_s"] == 4.0
    assert got["reasons"] == ["API error (URLError)", "EngineNotReady"]
    never = [(0.0, "Ready"), (6.0, "Scaling"), (7.0, "Scaling")]
    assert chaos.ready_summary(never, 5.0)["ready_again_s"] is None


def test_rejections_read_reasons_and_the_time_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "\n".join([
        '# HELP mooncake_gateway_rejections_total Requests answered 429, by reason',
        'mooncake_gateway_rejections_total{model="m",reason="ttft-slo"} 3.0',
        'mooncake_gateway_rejections_total{model="n",reason="ttft-slo"} 2.0',
        'mooncake_gateway_rejection_seconds_bucket{le="0.01",model="m",path="at-once"} 4.0',
        'mooncake_gateway_rejection_seconds_bucket{le="+Inf",model="m",path="at-once"} 5.0',
        'mooncake_gateway_rejection_seconds_count{model="m",path="at-once"} 5.0',
    ]).encode()

    class Resp(io.BytesIO):
        def __enter__(self) -> Resp:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(chaos.urllib.request, "urlopen", lambda url, timeout: Resp(text))
    assert chaos.rejections("http://gw") == {
        "ttft-slo": 5.0, "seconds/at-once/0.01": 4.0, "seconds/at-once/+Inf": 5.0}


def test_a_gateway_leftover_is_a_gone_pod_still_listed_or_a_live_one_not_routed() -> None:
    url = "http://gw"
    seen = {
        "ns/prefill-0": {"listed": False, "routable": False},  # deleted: kept, not listed
        "ns/prefill-1": {"listed": True, "routable": True},
        "ns/prefill-2": {"listed": True, "routable": False},   # replacement not yet routed
        "ns/decode-0": {"listed": True, "routable": True},     # its pod is gone
    }
    wanted = {"ns/prefill-1", "ns/prefill-2", "ns/decode-1"}
    assert chaos.gateway_leftovers(url, seen, wanted) == [
        "gateway http://gw lists gone pod ns/decode-0",
        "gateway http://gw: ns/decode-1 not routable",
        "gateway http://gw: ns/prefill-2 not routable",
    ]
    healed = {k: {"listed": True, "routable": True} for k in wanted}
    assert chaos.gateway_leftovers(url, {**healed, "ns/prefill-0": seen["ns/prefill-0"]},
                                   wanted) == []


def test_the_time_buckets_of_429s_are_not_reasons() -> None:
    grew = {"ttft-slo": 5, "overload": 1, f"{chaos.REJECTION_SECONDS}at-once/0.05": 4,
            f"{chaos.REJECTION_SECONDS}at-once/+Inf": 6}
    by_reason, times = chaos.split_rejections(grew)
    assert by_reason == {"ttft-slo": 5, "overload": 1}
    assert times == {"at-once/0.05": 4, "at-once/+Inf": 6}
