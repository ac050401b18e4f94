"""Online calibration of the decode-step model from observed TBT.

Rule: each finished stream reports the TBT it was predicted (the decode selector's step
for the batch it joined, by the model of the moment) and the TBT it got (the mean of the
longest tenth of its token intervals, the paper's §5 reading, measured where it is
relayed). The log of their ratio is tracked with an exponentially weighted mean
(``rate`` per stream), and every decode step is predicted that many times slower
(:meth:`~mooncake_conductor.cost.CostModel.set_decode_scale`), within
``[min_scale, max_scale]``. So engines slower than the model (another GPU, a starved
host, a relay that adds its own delay) make the decode selector refuse or hold requests
whose TBT would miss, instead of admitting them on the model's word.

The bound matters: a scale so large that an idle instance's predicted step misses the
SLO would refuse every request, and with nothing decoding nothing more is observed. So
the scale is also kept at or below ``idle_share`` of the TBT SLO over the model's step
for one short sequence (:func:`idle_cap`: 0.8 × 100 ms / 15.4 ms = 5.2 for the bundled
LLaMA3-70B on 8 A800s), and an idle instance always admits a short request.

Off by default in the core: the simulator's engines are the model. The operator turns
it on for the gateway of every cluster (``spec.conductor.decodeCalibration``).

Source: ours (issue 32: admission that holds when the engines are slower than the
model), after the prefill calibration (``CalibrationConfig``, docs/conductor.md).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DecodeCalibrationConfig(BaseModel):
    """Whether and how fast the decode-step model follows the TBT streams get."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="learn the decode-step scale from observed TBT")
    rate: float = Field(0.05, gt=0, le=1, description="weight of each finished stream")
    min_scale: float = Field(0.5, gt=0, description="the scale is kept at or above this")
    max_scale: float = Field(8.0, gt=0, description="the scale is kept at or below this")
    #: streams with fewer token intervals are not observed (their TBT is one interval)
    min_intervals: int = Field(8, ge=1, description="fewest token intervals observed")
    idle_share: float = Field(
        0.8, gt=0, le=1, description="the scale never predicts an idle instance's step "
        "for a short sequence above this share of the TBT SLO")

    @model_validator(mode="after")
    def _bounds(self) -> DecodeCalibrationConfig:
        if not self.min_scale <= 1.0 <= self.max_scale:
            raise ValueError("min_scale must be at most 1 and max_scale at least 1")
        return self


#: the context of the "short sequence" an idle instance must stay admissible for
IDLE_CONTEXT_TOKENS = 1024


def idle_cap(step_of_one: float, tbt_slo_s: float, idle_share: float) -> float:
    """The largest scale at which a single short sequence's predicted step
    (``step_of_one`` by the unscaled model) stays within ``idle_share`` of the SLO; at
    least 1 (the model's own word is never overruled downwards by this bound)."""
    if step_of_one <= 0:
        return math.inf
    return max(1.0, idle_share * tbt_slo_s / step_of_one)


class LogScale:
    """An exponentially weighted mean of ``log(observed / predicted)``, clamped; its
    exponential is the scale (the prefill calibration's and the decode calibration's)."""

    def __init__(self, rate: float, min_scale: float, max_scale: float,
                 initial_scale: float = 1.0) -> None:
        self.rate = rate
        self._lo, self._hi = math.log(min_scale), math.log(max_scale)
        self.log = math.log(initial_scale)
        self.observed = 0

    @property
    def scale(self) -> float:
        return math.exp(self.log)

    def observe(self, predicted: float, observed: float) -> bool:
        """Move towards ``observed / predicted``; whether the pair was usable."""
        if not (predicted > 0 and observed > 0):
            return False
        self.observed += 1
        step = self.rate * (math.log(observed) - math.log(predicted))
        self.log = min(self._hi, max(self._lo, self.log + step))
        return True
