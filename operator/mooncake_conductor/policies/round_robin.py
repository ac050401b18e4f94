"""``round-robin``: live prefill instances in turn.

Rule: the next instance after the last one used, ignoring cache and load
(vLLM production-stack ``roundrobin`` router).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, register


class RoundRobinParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@register
class RoundRobinPolicy(PrefillPolicy):
    name = "round-robin"
    Params = RoundRobinParams
    default_decode = "round-robin"

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._next = 0

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        inst = live[self._next % len(live)]
        self._next += 1
        local = cluster.index.match(inst.iid, req.keys)
        return self.local_placement(req, inst, local, now)
