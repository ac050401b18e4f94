"""``kvcache-centric``: the Mooncake paper's Algorithm 1 (FAST'25 §4).

Rule: find the longest prefix any instance (or the store pool) holds,
``best_len``. For every prefill instance with local match ``len``: if
``best_len > len * kvcache_balancing_threshold`` the missing blocks are
fetched from the holder (``T_transfer`` = their bytes over min(B_nic, B_h2d))
and prefill reuses ``best_len``; otherwise it recomputes from ``len``.
``TTFT = T_transfer + T_queue + T_prefill``, with ``T_queue`` the predicted
time until a new prefill could start there: the remainder of the running
prefill plus the predicted prefill times of the queued requests (the paper
sums the queued ones and does not say whether the running one counts; we take
the reading that serves the baseline best). The smallest TTFT wins. When it,
or the decode side's TBT, breaks its SLO the request is rejected at once
(HTTP 429). Fetching copies the
hot blocks to the chosen instance, which is how hot prefixes get replicated
(§4.2) — no explicit replication step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..capabilities import Capabilities
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, longest, register


class KVCacheCentricParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kvcache_balancing_threshold: float = Field(
        1.0, ge=1.0, description="fetch when best_len > local_len * threshold"
    )


@register
class KVCacheCentricPolicy(PrefillPolicy):
    name = "kvcache-centric"
    Params = KVCacheCentricParams
    default_decode = "tbt-slo"
    capabilities = Capabilities(admission=True)

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, KVCacheCentricParams)
        cost = self.ctx.cost
        search = cluster.prefill_mask
        if cluster.store_id is not None:
            search |= 1 << cluster.store_id
        matches = cluster.index.match_all(req.keys, search, key_array=req.key_array)
        best_src, best_len = longest(matches) if self.ctx.fetch else (None, 0)
        n = req.input_tokens
        options: dict[int, Placement] = {}
        for p in live:
            local = matches.get(p.iid, 0)
            queue = p.wait_time(now)
            if best_len > local * self.params.kvcache_balancing_threshold:
                fetched = req.tokens_of(best_len) - req.tokens_of(local)
                options[p.iid] = Placement(
                    prefill=p.iid,
                    local_blocks=local,
                    fetch_blocks=best_len - local,
                    source=best_src,
                    queue_s=queue,
                    transfer_s=cost.transfer_time(fetched),
                    prefill_s=cost.prefill_time(n, req.tokens_of(best_len), 0),
                )
            else:
                options[p.iid] = Placement(
                    prefill=p.iid,
                    local_blocks=local,
                    queue_s=queue,
                    prefill_s=cost.prefill_time(n, req.tokens_of(local)),
                )
        iid = least([(o.ttft_s, i) for i, o in options.items()], self.ctx.rng)
        return options[iid]
