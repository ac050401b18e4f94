"""Each request's SLO verdict (``mooncake_gateway_slo_requests_total``; gateway/slo.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.slo import SloCounter, request_tbt

from .scripted import MODEL, engines, model, running_gateway
from .test_gateway_pd_wiring import ROUND_ROBIN, _chat, _completion, _samples


@pytest.mark.parametrize(("intervals", "tbt"), [
    ([], 0.0), ([0.05], 0.05), ([0.01] * 9 + [0.5], 0.5),
    ([0.01] * 10 + [0.3, 0.5], 0.4),  # 12 intervals: the longest 2 (10% rounded up)
])
def test_request_tbt_is_the_mean_of_the_longest_tenth(intervals: list[float],
                                                      tbt: float) -> None:
    assert request_tbt(intervals) == pytest.approx(tbt)


def _counts(m: GatewayMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["slo"], s.labels["result"]): s.value
            for fam in m.registry.collect() if fam.name == "mooncake_gateway_slo_requests"
            for s in fam.samples if s.name.endswith("_total")}


def test_verdicts_in_modelled_seconds() -> None:
    m = GatewayMetrics()
    slo = SloCounter(m.slo_requests, "m", ttft_slo_s=2.0, tbt_slo_s=0.1, time_scale=0.5)
    slo.served(0.9, [0.04, 0.04])   # 1.8 s and 80 ms modelled: both met
    slo.served(1.1, [0.04])         # 2.2 s modelled: TTFT missed
    slo.served(0.5, [0.01, 0.06])   # TBT 120 ms modelled: missed
    slo.served(0.5, None)           # not streamed: TTFT and both only
    slo.missed()                    # rejected
    assert _counts(m) == {
        ("ttft", "met"): 3, ("ttft", "missed"): 2,
        ("tbt", "met"): 2, ("tbt", "missed"): 2,
        ("both", "met"): 2, ("both", "missed"): 3}


def test_the_gateway_counts_served_failed_and_client_errors_apart() -> None:
    async def main() -> None:
        fast = {**ROUND_ROBIN, "conductor": {**ROUND_ROBIN["conductor"],
                                            "slo": {"ttft_s": 30.0, "tbt_s": 0.1}}}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], **fast)]) as gw:
            assert (await gw.post("/v1/completions", _completion(True)))[0] == 200
            assert (await gw.post("/v1/chat/completions", _chat(False)))[0] == 200
            body: dict[str, Any] = {**_completion(False), "n": 2}
            assert (await gw.post("/v1/completions", body))[0] == 400  # not counted
            d0.status = 500  # the decode fails: a 502 misses every SLO
            assert (await gw.post("/v1/completions", _completion(False)))[0] == 502
            m = _samples(await gw.text("/metrics"))

            def val(slo: str, result: str) -> float:
                key = ("mooncake_gateway_slo_requests_total",
                       (("model", MODEL), ("result", result), ("slo", slo)))
                return m.get(key, 0.0)
            assert (val("ttft", "met"), val("ttft", "missed")) == (2, 1)
            assert (val("tbt", "met"), val("tbt", "missed")) == (1, 1)  # one streamed
            assert (val("both", "met"), val("both", "missed")) == (2, 1)

    asyncio.run(main())


def test_a_slow_clock_turns_the_same_answers_into_misses() -> None:
    """The model's time scale divides wall seconds: at 1e-9 every TTFT is years long."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], time_scale=1e-9, **ROUND_ROBIN)]) as gw:
            assert (await gw.post("/v1/completions", _completion(True)))[0] == 200
            m = _samples(await gw.text("/metrics"))
            key = ("mooncake_gateway_slo_requests_total",
                   (("model", MODEL), ("result", "missed"), ("slo", "ttft")))
            assert m[key] == 1

    asyncio.run(main())


def test_every_reject_reason_and_outcome_is_exported_from_zero() -> None:
    """``rate()`` misses a counter's first increment when its series appears with it: each
    reason the Conductor can give, and each outcome, is exported at 0 from the start."""
    import re
    from pathlib import Path

    import mooncake_conductor
    from mooncake_gateway.dispatch import OUTCOME_BY_STATUS
    from mooncake_gateway.metrics import OUTCOMES, REJECT_REASONS, ModelMetrics

    src = Path(mooncake_conductor.__file__).parent
    given = {m for f in src.rglob("*.py")
             for m in re.findall(r'reject_reason\s*=\s*"([a-z-]+)"', f.read_text())}
    assert given and given <= set(REJECT_REASONS), given - set(REJECT_REASONS)
    assert set(OUTCOME_BY_STATUS.values()) <= set(OUTCOMES)
    m = GatewayMetrics()
    ModelMetrics(m, "m")
    text = "\n".join(f"{s.name}{s.labels}" for fam in m.registry.collect()
                     for s in fam.samples)
    for reason in REJECT_REASONS:
        assert f"'reason': '{reason}'" in text
    assert text.count("mooncake_gateway_requests_total") == 2 * len(OUTCOMES)
