"""Online calibration of the decode-step model (mooncake_conductor.calibration,
Conductor.observe_decode): the scale follows the TBT streams got, the selector prices
with it, and an idle instance stays admissible at the bound."""

from __future__ import annotations

import math
import random

import pytest
from mooncake_conductor.calibration import (
    IDLE_CONTEXT_TOKENS,
    DecodeCalibrationConfig,
    LogScale,
    idle_cap,
)
from mooncake_conductor.cost import CostModel
from mooncake_conductor.decode import create_decode_selector
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import DecodeState

from .helpers import request

ON = {"enabled": True}


def test_set_decode_scale_stretches_every_step_alike() -> None:
    cost, base = CostModel(), CostModel()
    cost.set_decode_scale(3.0)
    for batch, ctx in ((1, 0), (8, 40_000), (64, 2_000_000)):
        assert cost.decode_step_time(batch, ctx) == pytest.approx(
            3.0 * base.decode_step_time(batch, ctx))
    assert cost.version == 1 and cost.decode_scale == 3.0
    with pytest.raises(ValueError):
        cost.set_decode_scale(0.0)


def test_the_scale_converges_to_a_slower_engine_through_noise() -> None:
    c = Conductor(ConductorConfig(decode_calibration=ON))
    rng = random.Random(3)
    truth = CostModel()
    for i in range(300):
        batch = 1 + i % 16
        predicted = c.cost.decode_step_time(batch, 4096 * batch)
        observed = 2.5 * truth.decode_step_time(batch, 4096 * batch) * math.exp(
            rng.gauss(0.0, 0.2))
        c.observe_decode(predicted, observed, intervals=63)
    assert c.cost.decode_scale == pytest.approx(2.5, rel=0.08)
    assert c.decode_scale.observed == 300


def test_off_by_default_and_short_streams_are_not_observed() -> None:
    off = Conductor(ConductorConfig())
    off.observe_decode(0.02, 0.2, intervals=63)
    assert off.cost.decode_scale == 1.0 and off.cost.version == 0
    on = Conductor(ConductorConfig(decode_calibration=ON))
    on.observe_decode(0.02, 0.2, intervals=DecodeCalibrationConfig().min_intervals - 1)
    on.observe_decode(0.0, 0.2, intervals=63)  # nothing was predicted
    assert on.cost.decode_scale == 1.0 and on.decode_scale.observed == 0


def test_the_selector_prices_with_the_learnt_scale() -> None:
    """A batch the model puts within the SLO is refused once the engines prove far
    slower; an idle instance still passes at the bound, so decoding (and observing) goes
    on."""
    c = Conductor(ConductorConfig(decode_calibration=ON))
    sel = create_decode_selector("tbt-slo", c.cost, 0.1, random.Random(0))
    req = request(list(range(4)))
    busy = [DecodeState(iid=0, batch=128, context_tokens=128 * 4096,
                        capacity_tokens=c.cost.kv_capacity_tokens)]
    idle = [DecodeState(iid=0, capacity_tokens=c.cost.kv_capacity_tokens)]
    assert sel.choose(req, busy).reject_reason is None
    for _ in range(200):
        c.observe_decode(0.01, 1.0, intervals=63)  # 100x: clamped at the idle cap
    one = CostModel().decode_step_time(1, IDLE_CONTEXT_TOKENS)
    cap = 0.8 * 0.1 / one
    assert 1.0 < cap < DecodeCalibrationConfig().max_scale
    assert c.cost.decode_scale == pytest.approx(cap)
    assert sel.choose(req, busy).reject_reason == "tbt-slo"
    choice = sel.choose(req, idle)
    assert choice.reject_reason is None and choice.predicted_tbt_s <= 0.1


def test_the_idle_cap_is_never_below_one() -> None:
    assert idle_cap(0.2, 0.1, 0.8) == 1.0  # the model already misses: no lower bound
    assert idle_cap(0.01, 0.1, 0.8) == pytest.approx(8.0)
    assert idle_cap(0.0, 0.1, 0.8) == math.inf


def test_log_scale_is_clamped_and_ignores_unusable_pairs() -> None:
    s = LogScale(0.5, 0.5, 2.0)
    assert not s.observe(0.0, 1.0) and not s.observe(1.0, -1.0) and s.observed == 0
    for _ in range(50):
        s.observe(1.0, 100.0)
    assert s.scale == pytest.approx(2.0)
    for _ in range(50):
        s.observe(1.0, 0.001)
    assert s.scale == pytest.approx(0.5)


def test_bounds_must_bracket_one() -> None:
    with pytest.raises(ValueError):
        DecodeCalibrationConfig(min_scale=1.5)
    with pytest.raises(ValueError):
        DecodeCalibrationConfig(max_scale=0.9)
