"""``llm-d``: llm-d's endpoint picker as its chart deploys it (approximate prefix scorer).

Rule (llm-d inference scheduler, chart defaults): filters, then weighted scorers each in
[0, 1], then the maximum total score with a random tie-break. Scorers: prefix-cache
``matched_blocks / blocks_considered``; queue ``(max_q - q) / (max_q - min_q)`` over the
waiting requests; kv-cache-utilisation ``1 - usage``, where usage is vLLM's
``kv_cache_usage_perc``: the KV of the *running* requests only, not queued prompts.
Default weights: prefix 3, queue 2, kv-cache-utilisation 2. The chart's default prefix
scorer is the *approximate* one: it learns from its own routing decisions (what it sent
where), not from engine KV events; it hashes at most 256 blocks of 64 tokens (16,384
tokens) of a prompt and keeps an LRU of 31,250 such blocks (2M tokens) per server. Our
blocks are larger than 64 tokens, so both bounds are kept in tokens. The precise scorer
(engine KV events) is opt-in upstream: ``llm-d-precise``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..index import PrefixIndex
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PolicyContext, PrefillPolicy, least, register, router_mask


class LLMDParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_cache_weight: float = Field(2.0, ge=0)
    approx_max_tokens: int = Field(
        256 * 64, gt=0, description="prompt tokens the approximate scorer hashes")
    approx_lru_tokens: int = Field(
        31_250 * 64, gt=0, description="tokens the approximate scorer remembers per server")


class LLMDBase(PrefillPolicy):
    """The picker; ``precise`` reads the KV-event index instead of routing history."""

    Params = LLMDParams
    precise = False

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._history: PrefixIndex | None = None

    def _approx(self, block_tokens: int) -> PrefixIndex:
        if self._history is None:
            assert isinstance(self.params, LLMDParams)
            self._history = PrefixIndex(max(1, self.params.approx_lru_tokens // block_tokens))
        return self._history

    def _prefix(self, req: RequestInfo, cluster: ClusterState,
                live: list[PrefillState]) -> tuple[dict[int, int], int]:
        """Matched blocks per instance, and the blocks considered."""
        if self.precise:
            matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                              key_array=req.key_array)
            return matches, len(req.keys)
        assert isinstance(self.params, LLMDParams)
        cap = max(1, self.params.approx_max_tokens // req.block_tokens)
        keys = req.keys[:cap]
        hist = self._approx(req.block_tokens)
        mask = router_mask(hist, (p.iid for p in live))
        return hist.match_all(keys, mask), len(keys)

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, LLMDParams)
        prm = self.params
        matches, considered = self._prefix(req, cluster, live)
        queues = {p.iid: len(p.queue) for p in live}
        qmax, qmin = max(queues.values()), min(queues.values())
        kv_cap = max(1, self.ctx.cost.kv_capacity_tokens)
        total = max(1, considered)
        scored: list[tuple[float, int]] = []
        for p in live:
            prefix = matches.get(p.iid, 0) / total
            queue = 1.0 if qmax == qmin else (qmax - queues[p.iid]) / (qmax - qmin)
            usage = min(1.0, p.running_tokens / kv_cap)
            score = (
                prm.prefix_weight * prefix
                + prm.queue_weight * queue
                + prm.kv_cache_weight * (1.0 - usage)
            )
            scored.append((-score, p.iid))
        iid = least(scored, self.ctx.rng)
        inst = cluster.prefill[iid]
        return self.local_placement(req, inst, cluster.index.match(iid, req.keys), now)

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:
        if self.precise or placement.prefill is None:
            return
        assert isinstance(self.params, LLMDParams)
        cap = max(1, self.params.approx_max_tokens // req.block_tokens)
        self._approx(req.block_tokens).store(placement.prefill, req.keys[:cap])


@register
class LLMDPolicy(LLMDBase):
    name = "llm-d"
