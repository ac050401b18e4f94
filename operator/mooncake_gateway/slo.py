"""Each request's verdict against its model's SLOs, counted for Prometheus.

Rule: a request meets the TTFT SLO when its first token came within ``slo.ttft_s``, and
the TBT SLO when its TBT is within ``slo.tbt_s``; both in modelled seconds (wall seconds /
the model's time scale, 1 for real engines). A request's TBT is the mean of its longest
:data:`TBT_TOP_SHARE` of intervals between streamed chunks: the paper's tail measure (§5),
the simulator's and the replay client's, so Prometheus and a replay report the same thing.

- A rejected (429) or failed (5xx, or an error mid-stream) request misses every SLO, as in
  the simulator's attainment. Client errors (4xx other than 429) and requests the client
  abandoned are not counted.
- A request answered without streaming has no intervals: it counts for TTFT (the whole
  answer's latency) and ``both`` by its TTFT alone, not for TBT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import Counter

#: a request's TBT is the mean of this top share of its intervals (paper §5)
TBT_TOP_SHARE = 0.1
SLOS = ("ttft", "tbt", "both")


def request_tbt(intervals: Sequence[float], top_share: float = TBT_TOP_SHARE) -> float:
    """Mean of the longest ``top_share`` of ``intervals`` (at least one); 0 without any."""
    if not intervals:
        return 0.0
    top = sorted(intervals, reverse=True)[: max(1, math.ceil(top_share * len(intervals)))]
    return sum(top) / len(top)


class SloCounter:
    """One model's ``slo_requests_total`` children, looked up once."""

    def __init__(self, family: Counter, model: str, ttft_slo_s: float, tbt_slo_s: float,
                 time_scale: float) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.time_scale = time_scale
        self._met = {s: family.labels(model, s, "met") for s in SLOS}
        self._missed = {s: family.labels(model, s, "missed") for s in SLOS}

    def _count(self, slo: str, ok: bool) -> None:
        (self._met if ok else self._missed)[slo].inc()

    def served(self, ttft_wall_s: float, intervals_wall_s: Sequence[float] | None) -> None:
        """A request answered: ``intervals_wall_s`` None when it was not streamed."""
        ttft_ok = ttft_wall_s / self.time_scale <= self.ttft_slo_s
        self._count("ttft", ttft_ok)
        if intervals_wall_s is None:
            self._count("both", ttft_ok)
            return
        tbt_ok = request_tbt(intervals_wall_s) / self.time_scale <= self.tbt_slo_s
        self._count("tbt", tbt_ok)
        self._count("both", ttft_ok and tbt_ok)

    def missed(self) -> None:
        """A request rejected or failed: it missed every SLO."""
        for slo in SLOS:
            self._missed[slo].inc()
