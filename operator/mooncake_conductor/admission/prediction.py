"""``prediction``: reject a request whose predicted TTFT breaks the SLO (the default).

Rule: the chosen placement's predicted TTFT (queue + transfer past the queue + prefill,
as the policy priced it), plus the time a held request already waited, above the TTFT
SLO: rejected (``ttft-slo``). This is the paper's early rejection on prediction (FAST'25
§4: "reject at once"; §6: the prediction of the request's own cost and of the load it
will meet, not the load now).

With ``ttft_miss_risk`` set (off by default): the predicted TTFT must fit the SLO with a
margin for the prediction error, so that the request misses with at most that chance
(:mod:`.risk`; the error's ``mu`` and ``sigma`` measured online from finished prefills by
:class:`~mooncake_conductor.overrun.OverrunEstimator`, its ``prior_sigma`` until then).
The margin spreads the error as it was measured (``error_of``): per prefill, each item of
the work ahead has its own independent error (the simulator observes each prefill's
execution); per TTFT, the error is of the whole placement-to-answer time, queue included
(a gateway observes only that), so the margin is its quantile on the whole predicted TTFT:
errors that hit a queue together (work the other gateway replicas placed a sync period
ago, a calibration still catching up) do not average out. That error is learnt from
predictions near enough to the SLO to matter, on its late side only
(:class:`.ttfterror.TTFTError`): a short prediction's fixed overheads and an early answer
do not widen the margin on a long prediction.

Source: paper §4 and §6; the margin is ours (issue 32: admitted requests keep both SLOs
under overload), measured in ``docs/results/overload.md``.
"""

from __future__ import annotations

from ..overrun import OverrunEstimator
from ..policies.base import Placement, SLOConfig
from ..state import ClusterState
from .base import AdmissionConfig, AdmissionRule, register
from .risk import instance, ttft_margin, widest_growth, work_ahead, z_of
from .ttfterror import TTFTError


@register
class PredictionAdmission(AdmissionRule):
    name = "prediction"

    def __init__(self, config: AdmissionConfig, slo: SLOConfig) -> None:
        super().__init__(config, slo)
        risk = config.ttft_miss_risk
        on = risk is not None
        #: the measured prediction error, kept only when the margin is on: of each
        #: prefill, or of whole TTFTs (``error_of``)
        self.error = OverrunEstimator() if on and config.error_of == "prefill" else None
        self.ttft_error = (TTFTError(config.error_floor_share * slo.ttft_s)
                           if on and config.error_of == "ttft" else None)
        self.z = z_of(risk) if risk is not None else 0.0

    def breaks_ttft(self, placement: Placement, cluster: ClusterState, now: float,
                    waited: float) -> bool:
        budget = self.slo.ttft_s - waited
        ttft = placement.ttft_s
        if ttft > budget:
            return True
        if placement.prefill is None:
            return False
        if self.ttft_error is not None:  # the measured error is of the whole TTFT
            return self.ttft_error.quantile(ttft, self.z) > budget
        if self.error is None:
            return False
        mu, sigma = self.error.mu, self.error.sigma
        inst = instance(cluster, placement.prefill)
        if inst is None:
            return False
        # the widest margin (all the work in one item) first: most requests pass on it
        ahead = max(0.0, inst.busy_until - now) + inst.queued_work_s + placement.prefill_s
        if ttft + widest_growth(mu, sigma, self.z) * ahead <= budget:
            return False
        work = work_ahead(inst, now, placement.priority)
        work.append(placement.prefill_s)
        return ttft + ttft_margin(work, mu, sigma, self.z) > budget

    def measured_error(self) -> dict[str, float | int | bool]:
        if self.ttft_error is not None:
            e = self.ttft_error
            return {"answers": e.samples, "measured": e.measured, "floor_s": e.floor_s,
                    "mu": e.mu, "sigma": e.sigma,
                    "factor": e.quantile(1.0, self.z)}  # the margin on a prediction
        if self.error is not None:
            return {"prefills": self.error.samples, "mu": self.error.mu,
                    "sigma": self.error.sigma}
        return {}

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if self.error is not None:
            self.error.observe(predicted_s, observed_s)
        if self.ttft_error is not None:
            self.ttft_error.observe(predicted_s, observed_s)
