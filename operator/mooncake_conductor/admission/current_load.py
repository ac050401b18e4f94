"""``current-load``: reject on the chosen instance's current queue alone (a naive baseline).

Rule: the chosen placement's predicted wait before its prefill starts (the queue there
now: the running prefill's remainder and the queued prefills), plus the time a held
request already waited, above the TTFT SLO: rejected (``ttft-slo``). The request's own
prefill and transfer time are not counted, nor anything about the load it will meet; a
request admitted with a queue just under the SLO then misses it by its own prefill time.

Source: the baseline of the Mooncake paper's Table 3 (FAST'25 §7.4: rejection on the
current load, against early rejection based on prediction), read for a prefill-bound
pool: the load is the queue that is there now. Not meant for production: it exists to
measure what prediction-based admission saves (``benchmarks/overload.py``).
"""

from __future__ import annotations

from ..policies.base import Placement
from ..state import ClusterState
from .base import AdmissionRule, register


@register
class CurrentLoadAdmission(AdmissionRule):
    name = "current-load"

    def breaks_ttft(self, placement: Placement, cluster: ClusterState, now: float,
                    waited: float) -> bool:
        return waited + placement.queue_s > self.slo.ttft_s
