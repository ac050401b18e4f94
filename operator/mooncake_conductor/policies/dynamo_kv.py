"""``dynamo-kv``: NVIDIA Dynamo's KV router cost function.

Rule (Dynamo KV router, published defaults): for every worker,
``cost = prefill_load_scale * max(active_prefill_blocks + new_blocks -
overlap, 0) + (active_decode_blocks + new_blocks)``, where ``overlap`` credits
cached blocks by tier (device 1.0, host 0.75, disk 0.25) and the cache state
comes from the engines' KV events. Lowest cost wins at temperature 0; with
temperature > 0 a worker is sampled by softmax over normalised costs.
Prefill workers in a disaggregated pool run no decode, so their
``active_decode_blocks`` is zero.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from ..index import DRAM, HBM, STORE
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class DynamoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_load_scale: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    device_weight: float = Field(1.0, ge=0)
    host_weight: float = Field(0.75, ge=0)
    disk_weight: float = Field(0.25, ge=0)


@register
class DynamoKVPolicy(PrefillPolicy):
    name = "dynamo-kv"
    Params = DynamoParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, DynamoParams)
        prm = self.params
        weights = {HBM: prm.device_weight, DRAM: prm.host_weight, STORE: prm.disk_weight}
        matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                          key_array=req.key_array)
        new_blocks = len(req.keys)
        costs: list[tuple[float, int]] = []
        for p in live:
            m = matches.get(p.iid, 0)
            overlap = 0.0
            if m:
                tiers = cluster.index.tier_counts(p.iid, req.keys[:m])
                overlap = sum(weights.get(t, 0.0) * c for t, c in tiers.items())
            prefill = max(p.active_blocks + new_blocks - overlap, 0.0)
            costs.append((prm.prefill_load_scale * prefill + new_blocks, p.iid))
        if prm.temperature > 0:
            iid = self._sample(costs, prm.temperature)
        else:
            iid = least(costs, self.ctx.rng)
        return self.local_placement(req, cluster.prefill[iid], matches.get(iid, 0), now)

    def _sample(self, costs: list[tuple[float, int]], temperature: float) -> int:
        hi = max(c for c, _ in costs)
        lo = min(c for c, _ in costs)
        span = (hi - lo) or 1.0
        logits = [-((c - lo) / span) / temperature for c, _ in costs]
        top = max(logits)
        weights = [math.exp(v - top) for v in logits]
        return self.ctx.rng.choices([i for _, i in costs], weights=weights)[0]
