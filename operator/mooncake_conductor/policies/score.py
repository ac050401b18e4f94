"""``score``: the seed document's weighted score with an overload hard constraint.

Rule: ``score(r, n) = alpha * cached(r, n) / len(r) + beta * (1 - load(n))``
with ``load(n)`` = predicted queue seconds / ``overload_s`` (capped at 1).
Instances at or past ``overload_s`` are skipped (hard constraint); when every
instance is overloaded, the overload path sends the request to the least
loaded one. Highest score wins, ties at random.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class ScoreParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alpha: float = Field(0.7, ge=0, description="weight of the cached share of the prompt")
    beta: float = Field(0.3, ge=0, description="weight of spare capacity")
    overload_s: float = Field(
        10.0, gt=0, description="queue seconds at which an instance counts as overloaded"
    )


@register
class ScorePolicy(PrefillPolicy):
    name = "score"
    Params = ScoreParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, ScoreParams)
        prm = self.params
        waits = {p.iid: p.wait_time(now) for p in live}
        eligible = [p for p in live if waits[p.iid] < prm.overload_s]
        if not eligible:  # overload path
            iid = least([(w, i) for i, w in waits.items()], self.ctx.rng)
            inst = cluster.prefill[iid]
            return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)
        matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                          key_array=req.key_array)
        scored = []
        for p in eligible:
            cached = req.tokens_of(matches.get(p.iid, 0)) / max(1, req.input_tokens)
            load = min(1.0, waits[p.iid] / prm.overload_s)
            scored.append((-(prm.alpha * cached + prm.beta * (1.0 - load)), p.iid))
        iid = least(scored, self.ctx.rng)
        return self.local_placement(req, cluster.prefill[iid], matches.get(iid, 0), now)
