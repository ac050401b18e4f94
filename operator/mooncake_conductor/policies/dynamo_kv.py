"""``dynamo-kv``: NVIDIA Dynamo's KV router cost function.

Rule (Dynamo KV router, ``lib/kv-router/src/scheduling/selector/default.rs`` and
``scheduling/config.rs``, published defaults): for every worker,
``cost = prefill_load_scale * max(prefill_blocks + new_blocks - overlap, 0)
+ (decode_blocks + new_blocks)``, lowest cost wins at temperature 0; with temperature
> 0 a worker is sampled by softmax over normalised costs. ``overlap`` credits the
request's cached blocks on the worker by tier (device 1.0, host 0.75, disk 0.25), the
cache state coming from the engines' KV events. The router's own books on each worker's
in-flight requests give the two load terms: ``prefill_blocks`` sums each request's
*uncached* blocks (its prompt minus the overlap it was routed with) until its first
token; ``decode_blocks`` counts the distinct blocks of the worker's in-flight sequences.
On a prefill worker of a disaggregated pool a sequence ends with its prefill, so both
terms cover the same requests there.
"""

from __future__ import annotations

import math
from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from ..index import DRAM, HBM, STORE
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, least, register


class DynamoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_load_scale: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    device_weight: float = Field(1.0, ge=0)
    host_weight: float = Field(0.75, ge=0)
    disk_weight: float = Field(0.25, ge=0)


class _Books:
    """One worker's in-flight requests as the router counts them."""

    __slots__ = ("blocks", "requests", "uncached")

    def __init__(self) -> None:
        self.uncached = 0
        self.blocks: Counter[int] = Counter()
        self.requests: dict[int, int] = {}  # rid -> its uncached blocks


@register
class DynamoKVPolicy(PrefillPolicy):
    name = "dynamo-kv"
    Params = DynamoParams

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._books: dict[int, _Books] = {}
        self._overlap: dict[int, int] = {}  # rid -> matched blocks when routed

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
        empty = _Books()
        for p in live:
            m = matches.get(p.iid, 0)
            overlap = 0.0
            if m:
                tiers = cluster.index.tier_counts(p.iid, req.keys[:m])
                overlap = sum(weights.get(t, 0.0) * c for t, c in tiers.items())
            books = self._books.get(p.iid, empty)
            prefill = max(books.uncached + new_blocks - overlap, 0.0)
            decode = len(books.blocks) + new_blocks
            costs.append((prm.prefill_load_scale * prefill + decode, p.iid))
        if prm.temperature > 0:
            iid = self._sample(costs, prm.temperature)
        else:
            iid = least(costs, self.ctx.rng)
        self._overlap[req.rid] = matches.get(iid, 0)
        return self.local_placement(req, cluster.prefill[iid], matches.get(iid, 0), now)

    def _sample(self, costs: list[tuple[float, int]], temperature: float) -> int:
        hi = max(c for c, _ in costs)
        lo = min(c for c, _ in costs)
        span = (hi - lo) or 1.0
        logits = [-((c - lo) / span) / temperature for c, _ in costs]
        top = max(logits)
        weights = [math.exp(v - top) for v in logits]
        return self.ctx.rng.choices([i for _, i in costs], weights=weights)[0]

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:
        overlap = self._overlap.pop(req.rid, 0)
        if placement.prefill is None:
            return
        books = self._books.setdefault(placement.prefill, _Books())
        uncached = max(0, len(req.keys) - overlap)
        books.requests[req.rid] = uncached
        books.uncached += uncached
        books.blocks.update(req.keys)

    def on_prefilled(self, req: RequestInfo, placement: Placement) -> None:
        books = self._books.get(placement.prefill) if placement.prefill is not None else None
        if books is None or req.rid not in books.requests:
            return
        books.uncached -= books.requests.pop(req.rid)
        books.blocks.subtract(req.keys)
        for key in req.keys:
            if books.blocks[key] <= 0:
                del books.blocks[key]

    def on_finished(self, req: RequestInfo, placement: Placement) -> None:
        self.on_prefilled(req, placement)  # a request that failed before its first token
