"""Overload shedding: under saturation, admit a request only if it is worth the requests
its work would push out (goodput admission).

Rule: the paper's early rejection (§4, §6) turns away a request whose predicted TTFT
misses the SLO, whatever it costs. Under sustained overload that lets the queue sit at
the SLO horizon and rejects whoever arrives next, cheap or not: every second of prefill
work admitted then pushes about ``1 / mean`` later requests (``mean``: GPU seconds of
the average offered request) past the SLO. The paper's capacity metric counts requests
within SLO, so a request is worth one, and one that costs ``g`` GPU seconds displaces
about ``g / mean`` others once the pool is saturated. Saturation is read from the
chosen placement's predicted queue wait ``w``: 0 up to ``from_share`` of the TTFT SLO,
rising linearly to 1 at the SLO. A request is shed when

    saturation(w) * g > mean

so below ``from_share`` x SLO nothing changes (the light-load results are the paper's
rule exactly), and at the horizon only requests cheaper than the average get in.
``mean`` is an exponentially weighted mean over the requests that reach this check
(``cost_rate`` per request), not over the admitted ones only, which would shrink as
the rule sheds and tighten it in a loop.

Source: ours, after the paper's §6 (overload-oriented scheduling: decide admission by
predicted load, not per request in isolation). Measured in
``docs/results/scheduling.md`` (effective capacity).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SheddingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = Field(
        None, description="shed costly requests under overload (default: the policy's own; "
        "applies only where admission is on)")
    from_share: float = Field(
        0.5, ge=0, lt=1, description="predicted queue wait, as a share of the TTFT SLO, "
        "from which the pool counts as saturating")
    cost_rate: float = Field(
        0.01, gt=0, le=1, description="weight of each request in the running mean of "
        "GPU seconds per request")


class OverloadShedding:
    """The rule above, with its running mean; one per Conductor."""

    def __init__(self, config: SheddingConfig, ttft_slo_s: float) -> None:
        self.config = config
        self.ttft_slo_s = ttft_slo_s
        self.mean_gpu_s: float | None = None  # no request seen yet

    def saturation(self, queue_s: float) -> float:
        """0 below ``from_share`` x SLO, 1 at the SLO and beyond, linear in between."""
        start = self.config.from_share * self.ttft_slo_s
        if queue_s <= start:
            return 0.0
        return min(1.0, (queue_s - start) / (self.ttft_slo_s - start))

    def admit(self, queue_s: float, gpu_seconds: float) -> bool:
        """False when the request is to be shed; either way its cost joins the mean
        (after the decision, which uses the mean of the requests before it)."""
        mean = gpu_seconds if self.mean_gpu_s is None else self.mean_gpu_s
        self.mean_gpu_s = mean + (gpu_seconds - mean) * self.config.cost_rate
        return self.saturation(queue_s) * gpu_seconds <= mean
