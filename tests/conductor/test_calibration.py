"""Online calibration of the prefill-time model (Conductor.observe_prefill)."""

from __future__ import annotations

import math
import random

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.engine import Conductor, ConductorConfig

from .helpers import BT, cluster, request


def test_the_scale_converges_to_a_systematic_bias_through_noise() -> None:
    c = Conductor(ConductorConfig(policy="conductor"))
    assert c.capabilities.calibration and c.cost.prefill_scale == 1.0
    rng = random.Random(1)
    truth = CostModel()
    for i in range(400):
        n = 2048 + 512 * (i % 20)
        predicted = c.cost.prefill_time(n)
        observed = 1.25 * truth.prefill_time(n) * math.exp(rng.gauss(0.0, 0.2))
        c.observe_prefill(predicted, observed)
    assert c.cost.prefill_scale == pytest.approx(1.25, rel=0.06)
    # predictions now carry the bias (the h2d-bound part of prefill_time is not scaled)
    assert c.cost.prefill_compute_time(8192) == pytest.approx(
        1.25 * truth.prefill_compute_time(8192), rel=0.06)


def test_calibration_is_off_for_the_baselines_and_when_disabled() -> None:
    for cfg in (ConductorConfig(policy="kvcache-centric"),
                ConductorConfig(policy="conductor", calibrate=False)):
        c = Conductor(cfg)
        c.observe_prefill(1.0, 2.0)
        assert c.cost.prefill_scale == 1.0 and c.cost.version == 0
    forced = Conductor(ConductorConfig(policy="least-load", calibrate=True))
    forced.observe_prefill(1.0, 2.0)
    assert forced.cost.prefill_scale > 1.0


def test_the_scale_is_clamped_and_bad_observations_ignored() -> None:
    c = Conductor(ConductorConfig(calibration={"rate": 1.0, "max_scale": 2.0}))
    c.observe_prefill(1.0, 100.0)
    assert c.cost.prefill_scale == pytest.approx(2.0)
    c.observe_prefill(0.0, 1.0)
    c.observe_prefill(1.0, 0.0)
    assert c.cost.prefill_scale == pytest.approx(2.0)
    with pytest.raises(ValueError):
        c.cost.set_prefill_scale(0.0)


def test_the_conductor_policy_prices_with_the_calibrated_model() -> None:
    # one instance's prefill (no CPP group on the idle pair)
    c = Conductor(ConductorConfig(policy="conductor", params={"cpp": {"enabled": False}}))
    keys = list(range(100, 120))
    before = c.schedule(request(keys, rid=1), cluster(2), 0.0).placement.prefill_s
    c.cost.set_prefill_scale(2.0)  # what calibration does
    after = c.schedule(request(keys, rid=2), cluster(2), 0.0).placement.prefill_s
    assert after == pytest.approx(2.0 * before, rel=0.02)
    assert before == pytest.approx(CostModel().prefill_time(len(keys) * BT))


def test_an_initial_scale_starts_the_model_there_and_calibration_moves_on_from_it() -> None:
    truth = CostModel()
    fixed = Conductor(ConductorConfig(policy="conductor", calibrate=False,
                                      calibration={"initial_scale": 1.25}))
    assert fixed.cost.prefill_scale == 1.25
    assert fixed.cost.prefill_compute_time(8192) == pytest.approx(
        1.25 * truth.prefill_compute_time(8192))
    fixed.observe_prefill(1.0, 2.0)  # calibration off: it stays
    assert fixed.cost.prefill_scale == 1.25
    learning = Conductor(ConductorConfig(policy="conductor",
                                         calibration={"initial_scale": 1.25, "rate": 0.5}))
    learning.observe_prefill(1.0, 1.0)  # observed = predicted: the scale stays
    assert learning.cost.prefill_scale == pytest.approx(1.25)
    learning.observe_prefill(1.0, 2.0)  # log scale += 0.5 * log 2 from log 1.25
    assert learning.cost.prefill_scale == pytest.approx(1.25 * math.sqrt(2.0))
    assert Conductor(ConductorConfig(policy="conductor")).cost.version == 0


def test_an_initial_scale_outside_the_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="initial_scale must lie within"):
        ConductorConfig(calibration={"initial_scale": 5.0})
    with pytest.raises(ValueError, match="initial_scale must lie within"):
        ConductorConfig(calibration={"initial_scale": 0.5, "min_scale": 0.6})
