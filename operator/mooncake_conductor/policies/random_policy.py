"""``random``: a uniformly random live prefill instance.

Rule: ignore cache and load. The paper's weakest baseline (Figure 5: 19.65 s
average TTFT). The engine's own prefix cache still serves whatever it holds.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, register


class RandomParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@register
class RandomPolicy(PrefillPolicy):
    name = "random"
    Params = RandomParams
    default_decode = "random"

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        inst = self.ctx.rng.choice(live)
        local = cluster.index.match(inst.iid, req.keys)
        return self.local_placement(req, inst, local, now)
