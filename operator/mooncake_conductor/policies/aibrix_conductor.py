"""``aibrix-conductor``: AIBrix's P/D ``conductor`` policy with its hard-coded estimates.

Rule (AIBrix): per prefill pod,
``TTFT_ms = queued * avg_prefill_ms + (0.005 * matched + 1) + (0.001 *
unmatched^1.5 + 5)``, smallest wins; matched/unmatched are prompt tokens
found / not found in the pod's prefix cache. ``avg_prefill_ms`` is the pod's
observed average prefill time. Decode pods are chosen by AIBrix's TBT
estimate (decode selector ``aibrix``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, least, register


class AIBrixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    matched_ms_per_token: float = Field(0.005, ge=0)
    matched_base_ms: float = Field(1.0, ge=0)
    unmatched_coeff: float = Field(0.001, ge=0)
    unmatched_exp: float = Field(1.5, gt=0)
    unmatched_base_ms: float = Field(5.0, ge=0)


@register
class AIBrixConductorPolicy(PrefillPolicy):
    name = "aibrix-conductor"
    Params = AIBrixParams
    default_decode = "aibrix"

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        assert isinstance(self.params, AIBrixParams)
        prm = self.params
        matches = cluster.index.match_all(req.keys, cluster.prefill_mask,
                                          key_array=req.key_array)
        est: list[tuple[float, int]] = []
        for p in live:
            matched = req.tokens_of(matches.get(p.iid, 0))
            unmatched = req.input_tokens - matched
            ms = (
                p.outstanding * p.avg_prefill_s * 1000.0
                + (prm.matched_ms_per_token * matched + prm.matched_base_ms)
                + (prm.unmatched_coeff * unmatched**prm.unmatched_exp + prm.unmatched_base_ms)
            )
            est.append((ms, p.iid))
        iid = least(est, self.ctx.rng)
        return self.local_placement(req, cluster.prefill[iid], matches.get(iid, 0), now)
