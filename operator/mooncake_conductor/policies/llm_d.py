"""``llm-d``: llm-d's endpoint picker with its chart's default scorer weights.

Rule (llm-d inference scheduler): filters, then weighted scorers each in
[0, 1], then the maximum total score with a random tie-break. Scorers:
prefix-cache ``matched_blocks / total_blocks`` (precise, from KV events),
queue ``(max_q - q) / (max_q - min_q)`` and kv-cache-utilisation ``1 -
usage``. Default weights: prefix 3, queue 2, kv-cache-utilisation 2. Queue is
the number of waiting requests; usage is the share of the instance's KV
memory taken by prompts queued or running there.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class LLMDParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_cache_weight: float = Field(2.0, ge=0)


@register
class LLMDPolicy(PrefillPolicy):
    name = "llm-d"
    Params = LLMDParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, LLMDParams)
        prm = self.params
        matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                          key_array=req.key_array)
        queues = {p.iid: len(p.queue) for p in live}
        qmax, qmin = max(queues.values()), min(queues.values())
        kv_cap = max(1, self.ctx.cost.kv_capacity_tokens)
        total = max(1, len(req.keys))
        scored: list[tuple[float, int]] = []
        for p in live:
            prefix = matches.get(p.iid, 0) / total
            queue = 1.0 if qmax == qmin else (qmax - queues[p.iid]) / (qmax - qmin)
            usage = min(1.0, (p.queued_tokens + p.running_tokens) / kv_cap)
            score = (
                prm.prefix_weight * prefix
                + prm.queue_weight * queue
                + prm.kv_cache_weight * (1.0 - usage)
            )
            scored.append((-score, p.iid))
        iid = least(scored, self.ctx.rng)
        return self.local_placement(req, cluster.prefill[iid], matches.get(iid, 0), now)
