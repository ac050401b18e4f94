"""Prefills that run past their prediction: how much longer they will run.

Rule: an instance whose running prefill is still not done at its predicted end is not
free. Its busy-until time becomes ``now + E[T - t | T > t]``: the expected remaining
time of a prefill predicted to take ``P`` that has run ``t``, with the execution time
``T = P x F`` and ``ln F ~ N(mu, sigma^2)`` (log-normal prediction error). ``mu`` and
``sigma`` are measured online from the prefills that finished (the log of observed over
predicted, exponentially weighted over ``window`` prefills); until ``min_samples`` have
finished, ``prior_sigma`` and ``mu = 0`` stand in. When the new time passes with the
prefill still running, the estimate is made again from the longer elapsed time.

Why: a predicted end is a median, not a bound. Without this rule the scheduler takes an
instance past its predicted end for idle: it queues a request there (which then waits for
the whole overrun) or counts it as a free member for a chunked-pipeline group (which then
waits for it). The paper's T_queue (Algorithm 1) sums predictions only; where a gateway
learns that a prefill finished is where it could learn that one has not.

Source: the residual-life formula of the log-normal distribution (standard); the error
model is the one the simulator's ``--prediction-error`` draws from, but the estimator
learns its parameters from what it observes, so it is not told them.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

_SQRT2 = math.sqrt(2.0)


class OverrunConfig(BaseModel):
    """Re-estimating prefills that outrun their prediction (:mod:`.overrun`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = Field(None, description="default: the policy's own")
    prior_sigma: float = Field(
        0.2, gt=0, description="spread (sigma of the log) of the prediction error assumed "
        "before min_samples prefills have been observed")
    window: int = Field(200, ge=1, description="prefills the measured error averages over")
    min_samples: int = Field(20, ge=1, description="prefills observed before the measured "
                             "error replaces the prior")
    min_step_share: float = Field(
        0.05, gt=0, le=1, description="an estimate adds at least this share of the "
        "prediction (so a long overrun is re-estimated a bounded number of times)")


def _phi(x: float) -> float:
    """Standard normal distribution function."""
    return 0.5 * math.erfc(-x / _SQRT2)


def expected_residual(predicted_s: float, elapsed_s: float, mu: float, sigma: float) -> float:
    """``E[T - t | T > t]`` for ``T = predicted_s * F``, ``ln F ~ N(mu, sigma^2)`` and
    ``t = elapsed_s``: the expected remaining seconds of a prefill still running."""
    if predicted_s <= 0.0:
        return 0.0
    f = max(elapsed_s, 0.0) / predicted_s
    if f <= 0.0:
        return predicted_s * math.exp(mu + sigma * sigma / 2.0)
    z = (mu - math.log(f)) / sigma
    tail = _phi(z)
    if tail < 1e-12:
        # far in the tail: the log-normal's mean residual life tends to f sigma^2 / ln f
        return predicted_s * f * sigma * sigma / max(math.log(f) - mu, sigma)
    above = math.exp(mu + sigma * sigma / 2.0) * _phi(z + sigma)  # E[F; F > f]
    return predicted_s * max(above / tail - f, 0.0)


class OverrunEstimator:
    """The prediction error's ``mu`` and ``sigma`` measured online, and the busy-until
    time of a prefill found still running past its predicted end."""

    def __init__(self, config: OverrunConfig | None = None) -> None:
        self.config = config or OverrunConfig()
        self._alpha = 2.0 / (self.config.window + 1.0)
        self._mean = 0.0
        self._square = 0.0
        self.samples = 0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        """A prefill predicted to take ``predicted_s`` took ``observed_s``."""
        if predicted_s <= 0.0 or observed_s <= 0.0:
            return
        r = math.log(observed_s / predicted_s)
        self.samples += 1
        # a plain mean until the window fills, then exponentially weighted
        a = max(self._alpha, 1.0 / self.samples)
        self._mean += a * (r - self._mean)
        self._square += a * (r * r - self._square)

    @property
    def mu(self) -> float:
        return self._mean if self.samples >= self.config.min_samples else 0.0

    @property
    def sigma(self) -> float:
        if self.samples < self.config.min_samples:
            return self.config.prior_sigma
        var = self._square - self._mean * self._mean
        # a model that is never wrong still gets a small spread: the rule stays defined
        return math.sqrt(max(var, 1e-6))

    def busy_until(self, now: float, started: float, predicted_s: float) -> float:
        """When a prefill that started at ``started``, predicted to take ``predicted_s``
        and still running at ``now``, is expected to end (at least ``min_step_share`` of
        the prediction from ``now``)."""
        rest = expected_residual(predicted_s, now - started, self.mu, self.sigma)
        return now + max(rest, self.config.min_step_share * predicted_s)
