"""``sglang-cache-aware``: SGLang router's ``cache_aware`` policy, as upstream runs it.

Rule (SGLang router, ``sgl-router/src/policies/cache_aware.rs`` and ``tree.rs``, published
defaults): the router keeps, per worker, an approximate prefix tree of what *it* sent
there (not the engine's real cache), bounded to ``max_tree_size``. Load = the router's
count of requests it dispatched to a worker and that have not finished; in P/D mode a
request counts on its prefill worker for the whole dual dispatch, decode included. The
system is imbalanced when ``max_load - min_load > balance_abs_threshold`` and
``max_load > min_load * balance_rel_threshold``: then the shortest queue wins.
Otherwise ``match_rate = matched / len``; above ``cache_threshold`` the request goes to
the best match — among several workers sharing it, the first tenant stored on that tree
node, with no load tie-break — and below it to the worker whose approximate tree is
smallest (``get_smallest_tenant``), not the least loaded one. Either way the request is
added to the chosen worker's tree. SGLang's tree is over characters; we count tokens
(``max_tree_size`` given in characters, ``chars_per_token`` converts).

Our stronger variant, ``sglang-cache-aware+``, lives in its own module.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..index import PrefixIndex
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, least, register, router_mask


class SGLangParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(2**26, gt=0, description="characters per worker tree")
    chars_per_token: float = Field(4.0, gt=0)


class SGLangBase(PrefillPolicy):
    """The router's state and rule; ``by_load`` switches the two choices the "+" variant
    makes by load."""

    Params = SGLangParams
    #: low match -> least loaded, best-match ties -> least loaded (the "+" variant)
    by_load = False

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._tree: PrefixIndex | None = None
        #: tree node (block key) -> workers in the order they were stored there
        self._tenants: dict[int, list[int]] = {}
        #: requests dispatched to a prefill worker and not finished (the router's load)
        self._load: dict[int, int] = {}

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
        loads = {p.iid: self._load.get(p.iid, 0) for p in live}
        hi, lo = max(loads.values()), min(loads.values())
        rng = self.ctx.rng
        if hi - lo > prm.balance_abs_threshold and hi > lo * prm.balance_rel_threshold:
            iid = least([(v, i) for i, v in loads.items()], rng)
        else:
            tree = self._trees(req.block_tokens)
            approx = tree.match_all(req.keys, router_mask(tree, (p.iid for p in live)))
            best = max(approx.values(), default=0)
            rate = req.tokens_of(best) / max(1, req.input_tokens)
            if rate > prm.cache_threshold:
                ties = [i for i, m in approx.items() if m == best]
                iid = self._tie(ties, req.keys[best - 1], loads)
            elif self.by_load:
                iid = least([(v, i) for i, v in loads.items()], rng)
            else:
                iid = least([(tree.size(i), i) for i in loads], rng)
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)

    def _tie(self, ties: list[int], node: int, loads: dict[int, int]) -> int:
        if len(ties) == 1:
            return ties[0]
        if self.by_load:
            return least([(loads[i], i) for i in ties], self.ctx.rng)
        for iid in self._tenants.get(node, ()):
            if iid in ties:
                return iid
        return ties[0]

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:
        iid = placement.prefill
        if iid is None:
            return
        self._load[iid] = self._load.get(iid, 0) + 1
        self._trees(req.block_tokens).store(iid, req.keys)
        for key in req.keys:
            tenants = self._tenants.setdefault(key, [])
            if iid not in tenants:
                tenants.append(iid)

    def on_finished(self, req: RequestInfo, placement: Placement) -> None:
        iid = placement.prefill
        if iid is not None and self._load.get(iid, 0) > 0:
            self._load[iid] -= 1


@register
class SGLangCacheAwarePolicy(SGLangBase):
    name = "sglang-cache-aware"
