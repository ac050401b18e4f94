"""``aibrix-prefix-cache``: AIBrix's default router (``prefix-cache``).

Rule (vllm-project/aibrix ``pkg/plugins/gateway/algorithms``, its README and defaults):
load = a pod's running requests (here: queued or running on the prefill instance).
First the load gates: when ``max - min >= imbalance_abs`` (8), pods whose load is over
``overload_factor * (mean + 1)`` (2x) are filtered out; if the rest is still imbalanced
(``max - min > imbalance_abs``, ``getTargetPodOnLoadImbalance``) the least loaded pod
wins outright. Then the prompt's blocks are
matched against the router's own prefix table (filled from its routing decisions, not
from engine events; 200,000 blocks of 128 characters in all). Pods that match are sorted
by match percentage, highest first, then by load; the first whose load is at most
``mean + load_factor * std`` (2 standard deviations) wins. No match, or none under that
bound: the least loaded pod. The table counts characters; we keep its bound in tokens
(``chars_per_token`` converts).
"""

from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict, Field

from ..index import PrefixIndex
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, least, register, router_mask


class AIBrixPrefixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    imbalance_abs: int = Field(8, ge=0, description="max - min load that opens the gate")
    overload_factor: float = Field(2.0, gt=0, description="filtered when load > f x (mean + 1)")
    load_factor: float = Field(2.0, ge=0, description="standard deviations above the mean")
    table_blocks: int = Field(200_000, gt=0, description="prefix table size, blocks")
    table_block_chars: int = Field(128, gt=0, description="characters per table block")
    chars_per_token: float = Field(4.0, gt=0)


@register
class AIBrixPrefixCachePolicy(PrefillPolicy):
    name = "aibrix-prefix-cache"
    Params = AIBrixPrefixParams

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._table: PrefixIndex | None = None

    def _prefix_table(self, block_tokens: int, instances: int) -> PrefixIndex:
        if self._table is None:
            assert isinstance(self.params, AIBrixPrefixParams)
            prm = self.params
            tokens = prm.table_blocks * prm.table_block_chars / prm.chars_per_token
            per_instance = tokens / max(1, instances) / block_tokens
            self._table = PrefixIndex(max(1, int(per_instance)))
        return self._table

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, AIBrixPrefixParams)
        prm = self.params
        loads = {p.iid: p.outstanding for p in live}
        mean = statistics.fmean(loads.values())
        if max(loads.values()) - min(loads.values()) >= prm.imbalance_abs:
            kept = {i: v for i, v in loads.items() if v <= prm.overload_factor * (mean + 1)}
            loads = kept or loads
            if max(loads.values()) - min(loads.values()) > prm.imbalance_abs:
                return self._on(req, cluster, least([(v, i) for i, v in loads.items()],
                                                    self.ctx.rng), now)
        table = self._prefix_table(req.block_tokens, len(cluster.prefill))
        matches = table.match_all(req.keys, router_mask(table, loads))
        total = max(1, len(req.keys))
        mean = statistics.fmean(loads.values())
        bound = mean + prm.load_factor * statistics.pstdev(loads.values())
        ranked = sorted((i for i, m in matches.items() if m > 0),
                        key=lambda i: (-matches[i] / total, loads[i]))
        chosen = next((i for i in ranked if loads[i] <= bound), None)
        if chosen is None:
            chosen = least([(v, i) for i, v in loads.items()], self.ctx.rng)
        return self._on(req, cluster, chosen, now)

    def _on(self, req: RequestInfo, cluster: ClusterState, iid: int, now: float) -> Placement:
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:
        if placement.prefill is not None:
            table = self._prefix_table(req.block_tokens, len(cluster.prefill))
            router_mask(table, (placement.prefill,))
            table.store(placement.prefill, req.keys)
