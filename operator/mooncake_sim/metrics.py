"""The latency summary every replay reports, simulated or against a live gateway."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (NaN when empty)."""
    if not sorted_xs:
        return math.nan
    n = len(sorted_xs)
    return sorted_xs[min(n - 1, max(0, math.ceil(q * n) - 1))]


def latency_summary(
    served: Sequence[tuple[float, float]], requests: int, ttft_slo_s: float, tbt_slo_s: float
) -> dict[str, float]:
    """TTFT/TBT statistics of the served requests' ``(ttft_s, tbt_s)`` pairs, and the share
    of *all* ``requests`` (rejected and failed ones count as misses) meeting both SLOs.

    ``ttft_mean_charged_s`` is the mean TTFT over *all* requests with each one not served
    charged the TTFT SLO, so a policy cannot improve its mean by turning requests away."""
    ttfts = sorted(t for t, _ in served)
    tbts = sorted(b for _, b in served)
    ok = sum(1 for t, b in served if t <= ttft_slo_s and b <= tbt_slo_s)
    unserved = max(0, requests - len(served))
    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_mean_charged_s": ((sum(ttfts) + unserved * ttft_slo_s) / requests
                                if requests else math.nan),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tbt_mean_ms": 1000.0 * sum(tbts) / len(tbts) if tbts else math.nan,
        "tbt_p90_ms": 1000.0 * percentile(tbts, 0.9),
        "tbt_p99_ms": 1000.0 * percentile(tbts, 0.99),
        "slo_attainment": ok / requests if requests else math.nan,
    }
