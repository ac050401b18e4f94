"""``sglang-cache-aware``: SGLang router's ``cache_aware`` policy.

Rule (SGLang router, published defaults): the router keeps, per worker, an
approximate prefix tree of what *it* sent there (not the engine's real cache),
LRU-bounded to ``max_tree_size``. Load = outstanding requests. The system is
imbalanced when ``max_load - min_load > balance_abs_threshold`` and
``max_load > min_load * balance_rel_threshold``: then the shortest queue wins.
Otherwise ``match_rate = matched / len``; above ``cache_threshold`` go to the
best match, else to the least loaded worker. Either way the request is added
to the chosen worker's tree. SGLang's tree is over characters; we count
tokens (``max_tree_size`` given in characters, ``chars_per_token`` converts).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..index import PrefixIndex
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, least, register


class SGLangParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(2**26, gt=0, description="characters per worker tree")
    chars_per_token: float = Field(4.0, gt=0)


@register
class SGLangCacheAwarePolicy(PrefillPolicy):
    name = "sglang-cache-aware"
    Params = SGLangParams

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._tree: PrefixIndex | None = None

    def _trees(self, block_tokens: int) -> PrefixIndex:
        if self._tree is None:
            assert isinstance(self.params, SGLangParams)
            tokens = self.params.max_tree_size / self.params.chars_per_token
            self._tree = PrefixIndex(max(1, int(tokens // block_tokens)))
        return self._tree

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, SGLangParams)
        prm = self.params
        loads = {p.iid: p.outstanding for p in live}
        hi, lo = max(loads.values()), min(loads.values())
        rng = self.ctx.rng
        if hi - lo > prm.balance_abs_threshold and hi > lo * prm.balance_rel_threshold:
            iid = least([(v, i) for i, v in loads.items()], rng)
        else:
            tree = self._trees(req.block_tokens)
            mask = 0
            for p in live:
                mask |= 1 << p.iid
                if not tree.live_mask >> p.iid & 1:
                    tree.add_instance(p.iid)
            approx = tree.match_all(req.keys, mask)
            best = max(approx.values(), default=0)
            rate = req.tokens_of(best) / max(1, req.input_tokens)
            if rate > prm.cache_threshold:
                iid = least([(loads[i], i) for i, m in approx.items() if m == best], rng)
            else:
                iid = least([(v, i) for i, v in loads.items()], rng)
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:
        if placement.prefill is not None:
            self._trees(req.block_tokens).store(placement.prefill, req.keys)
