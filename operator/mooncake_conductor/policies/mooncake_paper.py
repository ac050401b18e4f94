"""``mooncake-paper``: the Mooncake paper's whole system: Algorithm 1, CPP, early rejection.

The paper's prefill side — Algorithm 1, chunked pipeline prefill for long prompts,
early rejection.

Rule (FAST'25 §3.2, §4 and the overload section of arXiv 2407.00079): first
``kvcache-centric`` (Algorithm 1: for each instance, fetch the longest prefix held
anywhere when it beats the local one, ``TTFT = T_transfer + T_queue + T_prefill`` with
the running prefill counted, smallest wins). A prompt with at least
``cpp.min_new_tokens`` to compute is also priced on groups of 2..``cpp.max_group`` idle
instances running chunked pipeline prefill (the longest prefix fetched to the group's
leader, :mod:`mooncake_conductor.cpp`), and the group is taken when its predicted TTFT is
smaller — the paper uses CPP for long contexts without stating a rule, and the
smallest-TTFT rule is Algorithm 1's own objective. Nor does it state a chunk size: the
strongest reading plans it with the paper's own cost model (the shortest makespan of
1k-8k-token chunks, as ``conductor`` does); a fixed 4096 left this design 7% slower.
Early rejection (HTTP 429) when the chosen TTFT or the decode side's predicted TBT
breaks its SLO; decode selector ``tbt-slo``. So full systems compare with full systems:
this is the paper's design with its published knobs, against which ``conductor``'s
additions are measured.
"""

from __future__ import annotations

from pydantic import Field

from ..cpp import ChunkPricer, CPPConfig
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, register
from .kvcache_centric import KVCacheCentricParams, KVCacheCentricPolicy


class PaperCPPConfig(CPPConfig):
    """CPP as this design gets it: the paper states no threshold; of 2048, 4096 and 8192
    new tokens, 8192 serves it best on the benchmark's workloads (``docs/policies.md``)."""

    min_new_tokens: int = Field(
        8192, ge=0, description="consider CPP only when this many tokens must be computed")


class MooncakePaperParams(KVCacheCentricParams):
    """Algorithm 1's knob plus chunked pipeline prefill's."""

    cpp: PaperCPPConfig = PaperCPPConfig()


@register
class MooncakePaperPolicy(KVCacheCentricPolicy):
    name = "mooncake-paper"
    Params = MooncakePaperParams

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        single = super().pick(req, cluster, live, now)
        assert isinstance(self.params, MooncakePaperParams)
        cfg = self.params.cpp
        n = req.input_tokens
        if (not cfg.enabled or not self.ctx.cpp or cfg.max_group < 2
                or n - req.tokens_of(single.reused_blocks) < cfg.min_new_tokens):
            return single
        idle = [p for p in live if p.wait_time(now) <= 0.0]
        if len(idle) < 2:
            return single
        reuse = single.reused_blocks
        # the holder of that prefix: where the single placement fetches it from, or the
        # single placement's own instance (which may be busy, so not in the group)
        source = single.source if single.source is not None else single.prefill
        # the leader holds the most of the prompt locally; the rest is fetched to it
        idle.sort(key=lambda p: -cluster.index.match(p.iid, req.keys))
        best = single
        pricer = ChunkPricer(self.ctx.cost, n, req.tokens_of(reuse), cfg)
        for size in range(2, min(cfg.max_group, len(idle)) + 1):
            members = idle[:size]
            leader = members[0]
            local = min(cluster.index.match(leader.iid, req.keys), reuse)
            fetch = reuse - local  # 0 when the leader is the holder
            transfer = self.ctx.cost.transfer_time(req.tokens_of(reuse) - req.tokens_of(local))
            chunk, makespan = pricer.choose(size)
            if transfer + makespan < best.ttft_s:
                best = Placement(
                    prefill=leader.iid, local_blocks=local, fetch_blocks=fetch,
                    source=source if fetch else None, transfer_s=transfer,
                    prefill_s=makespan, cpp_group=[p.iid for p in members],
                    cpp_chunk_tokens=chunk,
                )
        return best
