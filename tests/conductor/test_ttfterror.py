"""The error of whole predicted TTFTs (:mod:`mooncake_conductor.admission.ttfterror`):
learnt from predictions of at least the floor, on its late side, and its quantile of an
answer."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import pytest
from mooncake_conductor.admission.ttfterror import TTFTError
from mooncake_conductor.overrun import OverrunConfig

Z99 = NormalDist().inv_cdf(0.99)
FLOOR = 3.0


def test_before_min_samples_the_prior_stands() -> None:
    err = TTFTError(FLOOR, OverrunConfig(min_samples=20, prior_sigma=0.2))
    for _ in range(19):
        err.observe(10.0, 20.0)
    assert (err.mu, err.sigma) == (0.0, 0.2)
    assert err.quantile(10.0, Z99) == pytest.approx(10.0 * math.exp(Z99 * 0.2))
    err.observe(10.0, 20.0)
    assert err.mu == pytest.approx(math.log(2.0))
    assert err.sigma == pytest.approx(1e-3)  # never late beyond its median


def test_short_predictions_do_not_count() -> None:
    """A fixed 0.7 s on every answer reads as 8x on a 0.1 s prediction: below the floor,
    it neither counts as a sample nor widens the margin on a 20 s prediction."""
    err = TTFTError(FLOOR)
    for _ in range(100):
        err.observe(0.1, 0.8)
        err.observe(0.3, 1.0)
    assert err.samples == 0
    for _ in range(100):
        err.observe(10.0, 10.7)
        err.observe(20.0, 20.7)
    assert err.samples == 200
    assert err.quantile(20.0, Z99) < 20.0 * 1.2


def test_early_answers_do_not_widen_the_margin() -> None:
    """Seven answers in ten on time, three in a fifth of the time: the late side has no
    spread, where a mean and a two-sided spread would read a wide error."""
    err = TTFTError(FLOOR)
    for i in range(200):
        err.observe(10.0, 10.0 if i % 10 < 7 else 2.0)
    assert err.mu == 0.0
    assert err.quantile(20.0, Z99) <= 20.0 * 1.01
    logs = [0.0] * 7 + [math.log(0.2)] * 3
    mean = sum(logs) / len(logs)
    two_sided = math.sqrt(sum((r - mean) ** 2 for r in logs) / len(logs))
    assert 20.0 * math.exp(mean + Z99 * two_sided) > 30.0  # what it would refuse


def test_late_answers_set_the_margin() -> None:
    """Every answer 25% late: a 24 s prediction is expected at 30 s."""
    err = TTFTError(FLOOR)
    for _ in range(200):
        err.observe(10.0, 12.5)
    assert err.quantile(24.0, Z99) == pytest.approx(30.0, rel=0.01)


def test_the_quantile_covers_a_lognormal_error_as_asked() -> None:
    """Answers ``P e^N(0.05, 0.15)``: the learnt 99% bound holds for 99% of fresh answers,
    within sampling error."""
    rng = random.Random(7)
    err = TTFTError(FLOOR, OverrunConfig(window=4000))
    for _ in range(4000):
        err.observe(10.0, 10.0 * math.exp(rng.gauss(0.05, 0.15)))
    bound = err.quantile(15.0, Z99)
    covered = sum(15.0 * math.exp(rng.gauss(0.05, 0.15)) <= bound
                  for _ in range(20000)) / 20000
    assert 0.985 <= covered <= 0.995


def test_only_the_last_window_of_answers_counts() -> None:
    err = TTFTError(FLOOR, OverrunConfig(window=50, min_samples=20))
    for _ in range(50):
        err.observe(10.0, 20.0)
    assert err.mu == pytest.approx(math.log(2.0))
    for _ in range(50):  # the predictor caught up
        err.observe(10.0, 10.0)
    assert err.mu == 0.0
    assert err.quantile(20.0, Z99) == pytest.approx(20.0, rel=0.01)


def test_the_floor_itself_counts_and_an_unanswered_time_does_not() -> None:
    err = TTFTError(FLOOR)
    err.observe(FLOOR, FLOOR)
    assert err.samples == 1
    err.observe(FLOOR * 0.999, FLOOR)
    err.observe(10.0, 0.0)  # no time measured: nothing to learn, and no log of zero
    assert err.samples == 1
    with pytest.raises(ValueError, match="positive"):
        TTFTError(0.0)
