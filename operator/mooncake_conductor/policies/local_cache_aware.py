"""``local-cache-aware``: longest local prefix, with load as a limit and tie-break.

Rule: an instance is eligible when its queue (the predicted time until a new
prefill could start there: the running prefill's remainder plus the predicted
prefill time of the requests queued, the strongest reading of the paper's
``T_queue``) is no longer than the
shortest queue plus ``slack`` x (the time to prefill this prompt from scratch)
— waiting longer than a recompute would take is never worth a cache hit.
Among eligible instances take the longest prefix held *locally* (no transfer
between instances), then the shortest queue, then random. The paper's "local
cache-aware" baseline (Figure 5: 3.58 s average TTFT).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class LocalCacheAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slack: float = Field(1.0, ge=0, description="queue slack in units of a cold prefill")


@register
class LocalCacheAwarePolicy(PrefillPolicy):
    name = "local-cache-aware"
    Params = LocalCacheAwareParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, LocalCacheAwareParams)
        waits = {p.iid: p.wait_time(now) for p in live}
        limit = min(waits.values()) + self.params.slack * self.ctx.cost.prefill_time(
            req.input_tokens
        )
        matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                          key_array=req.key_array)
        eligible = [p.iid for p in live if waits[p.iid] <= limit]
        best = max(matches.get(i, 0) for i in eligible)
        ties = [(waits[i], i) for i in eligible if matches.get(i, 0) == best]
        iid = least(ties, self.ctx.rng)
        return self.local_placement(req, cluster.prefill[iid], best, now)
