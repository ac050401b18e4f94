"""``least-load``: the instance with the shortest predicted queue (running prefill counted).

Rule: minimise the instance's load: the predicted time until a new prefill
could start there (the remainder of the running prefill plus the predicted
prefill time of the requests queued); ignore cache. The paper's "load
balancing" baseline (FAST'25 Figure 5: 5.27 s average TTFT), in the strongest
reading of its ``T_queue`` (the paper does not say whether the running prefill
counts; counting it never hurts the baseline). Ties broken at random.
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
        loads = [(p.wait_time(now), p.iid) for p in live]
        iid = least(loads, self.ctx.rng)
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)
