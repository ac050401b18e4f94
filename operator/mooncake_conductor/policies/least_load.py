"""``least-load``: the instance with the least predicted queued work.

Rule: minimise the instance's load, measured as the paper measures queue
time: the predicted prefill time of the requests queued there; ignore cache.
The paper's "load balancing" baseline (Figure 5: 5.27 s average TTFT). Ties
broken at random.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class LeastLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@register
class LeastLoadPolicy(PrefillPolicy):
    name = "least-load"
    Params = LeastLoadParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        loads = [(p.paper_queue_time(), p.iid) for p in live]
        iid = least(loads, self.ctx.rng)
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)
