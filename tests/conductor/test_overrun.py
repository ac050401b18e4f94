"""Prefills that outrun their prediction (``overrun``): the expected remaining time,
the error measured online, and which policies re-estimate."""

import math

import numpy as np
import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.overrun import OverrunConfig, OverrunEstimator, expected_residual


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def test_residual_at_the_predicted_end_by_hand() -> None:
    # ln F ~ N(0, 0.2^2), still running at the prediction (f = 1):
    # E[F | F > 1] = e^{0.02} * Phi(0.2) / Phi(0) = 1.18193...; 10 s predicted: 1.82 s more
    want = 10.0 * (math.exp(0.02) * _phi(0.2) / 0.5 - 1.0)
    assert want == pytest.approx(1.819, abs=1e-3)
    assert expected_residual(10.0, 10.0, 0.0, 0.2) == pytest.approx(want, rel=1e-12)


def test_residual_agrees_with_sampling() -> None:
    rng = np.random.default_rng(7)
    mu, sigma, predicted = 0.05, 0.3, 4.0
    t = predicted * rng.lognormal(mu, sigma, 2_000_000)
    for elapsed in (2.0, 4.0, 5.0, 7.0):
        still = t[t > elapsed]
        sampled = float((still - elapsed).mean())
        assert expected_residual(predicted, elapsed, mu, sigma) == pytest.approx(
            sampled, rel=0.02)


def test_residual_far_in_the_tail_stays_finite_and_positive() -> None:
    rest = expected_residual(1.0, 50.0, 0.0, 0.2)  # 50x the prediction: tail ~ 0
    assert 0.0 < rest < 50.0
    assert expected_residual(0.0, 1.0, 0.0, 0.2) == 0.0


def test_the_prior_stands_until_enough_prefills_finished() -> None:
    est = OverrunEstimator(OverrunConfig(prior_sigma=0.3, min_samples=5))
    for _ in range(4):
        est.observe(1.0, 2.0)
    assert (est.mu, est.sigma) == (0.0, 0.3)
    est.observe(1.0, 2.0)
    assert est.mu == pytest.approx(math.log(2.0))
    assert est.sigma == pytest.approx(1e-3)  # never wrong by a varying amount: the floor


def test_the_measured_spread_converges() -> None:
    rng = np.random.default_rng(3)
    est = OverrunEstimator(OverrunConfig(window=400, min_samples=20))
    for f in rng.lognormal(0.0, 0.25, 3000):
        est.observe(2.0, 2.0 * float(f))
    assert est.sigma == pytest.approx(0.25, rel=0.15)
    assert abs(est.mu) < 0.05


def test_a_new_end_is_at_least_the_minimum_step_away() -> None:
    est = OverrunEstimator(OverrunConfig(prior_sigma=0.01, min_step_share=0.1))
    # sigma 0.01 and 1.5x the prediction: the residual is tiny, the step is not
    assert est.busy_until(15.0, 0.0, 10.0) == pytest.approx(16.0)
    est = OverrunEstimator(OverrunConfig(prior_sigma=0.2, min_step_share=0.01))
    assert est.busy_until(10.0, 0.0, 10.0) == pytest.approx(
        10.0 + expected_residual(10.0, 10.0, 0.0, 0.2))


def test_only_the_conductor_re_estimates_by_default() -> None:
    assert Conductor(ConductorConfig(policy="conductor")).overdue_until(12.0, 0.0, 10.0) > 12.0
    for name in ("mooncake-paper", "kvcache-centric", "dynamo-kv"):
        assert Conductor(ConductorConfig(policy=name)).overdue_until(12.0, 0.0, 10.0) is None
    off = ConductorConfig(policy="conductor", overrun={"enabled": False})
    assert Conductor(off).overdue_until(12.0, 0.0, 10.0) is None
    on = ConductorConfig(policy="kvcache-centric", overrun={"enabled": True})
    assert Conductor(on).overdue_until(12.0, 0.0, 10.0) is not None


def test_observed_prefills_feed_the_estimator_with_calibration_off() -> None:
    c = Conductor(ConductorConfig(policy="conductor", calibrate=False,
                                  overrun={"min_samples": 1}))
    assert c.overrun is not None
    c.observe_prefill(1.0, 1.5)
    assert c.overrun.samples == 1
    assert c.overrun.mu == pytest.approx(math.log(1.5))
