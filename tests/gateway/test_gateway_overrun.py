"""The gateway's queue model with the Conductor's overrun re-estimation
(:mod:`mooncake_conductor.overrun`): a prefill whose predicted work has run out while no
answer came keeps the work it is now expected to take; without it, the instance looks
free. Driven through the runtime directly (no engines: nothing is answered)."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
from mooncake_conductor.overrun import expected_residual
from mooncake_conductor.policies.base import Placement
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.runtime import ModelRuntime
from mooncake_gateway.settings import Endpoint, GatewaySettings, ModelSettings, Role

HOST = "127.0.0.1"
TOKENS = 16_384
Z99 = NormalDist().inv_cdf(0.99)


def _runtime(**overrun: Any) -> ModelRuntime:
    cfg = ModelSettings(name="m", conductor={"overrun": overrun})
    rt = ModelRuntime(cfg, GatewaySettings(), GatewayMetrics())
    rt.members.set_endpoints(Role.PREFILL, [Endpoint(url=f"http://{HOST}:1")])
    rt.members.set_endpoints(Role.DECODE, [Endpoint(url=f"http://{HOST}:100")])
    for inst in [*rt.prefill, *rt.decode]:
        rt.members.mark_health(inst, True)
    return rt


def _place(rt: ModelRuntime, first: int) -> tuple[Any, float]:
    keys = np.arange(first << 20, (first << 20) + TOKENS // 16, dtype=np.uint64)
    req = rt.request_info(TOKENS, keys, 4)
    work = rt.cost.prefill_time(TOKENS, 0)
    pl = Placement(prefill=0, prefill_s=work, priority=req.arrival)
    rt.conductor.policy.on_placed(req, pl, rt.cluster)
    rt.queues.prefill_started(rt.prefill[0], req, work, req.arrival, pl)
    return req, work


def test_an_unanswered_prefill_past_its_prediction_keeps_expected_work() -> None:
    rt = _runtime(prior_sigma=0.2)
    t0 = rt.now()
    rt.queues.drain(t0)  # from here on the test's clock drives the queue model
    _req, work = _place(rt, 1)
    p = rt.cluster.prefill[0]
    rt.queues.drain(t0 + 0.5 * work)  # half done: half the work left, as before
    assert p.queued_work_s == pytest.approx(0.5 * work, rel=1e-6)
    rt.queues.drain(t0 + 1.5 * work)  # half again past its prediction, no answer
    want = expected_residual(work, 1.5 * work, 0.0, 0.2)
    assert p.queued_work_s == pytest.approx(want, rel=1e-3)
    assert 0.0 < p.queued_work_s < 0.5 * work


def test_without_re_estimation_it_looks_free() -> None:
    rt = _runtime(enabled=False)
    t0 = rt.now()
    rt.queues.drain(t0)
    _req, work = _place(rt, 1)
    rt.queues.drain(t0 + 1.5 * work)
    assert rt.cluster.prefill[0].queued_work_s == 0.0


def test_the_answer_retires_it_and_feeds_the_measured_error() -> None:
    rt = _runtime(min_samples=1)
    t0 = rt.now()
    rt.queues.drain(t0)
    req, work = _place(rt, 1)
    rt.queues.drain(t0 + 1.5 * work)
    rt.queues.prefill_done(rt.prefill[0], req, 2.0 * work, work)
    rt.queues.drain(t0 + 2.0 * work)
    assert rt.cluster.prefill[0].queued_work_s == 0.0
    est = rt.conductor.overrun
    assert est is not None and est.samples == 1
    assert est.mu == pytest.approx(np.log(2.0))


def test_time_past_an_overdue_prefill_still_drains_the_queue_behind() -> None:
    # the answer can come after the engine moved on (a worker answers a prefill once its
    # KV is in the store): holding the queue behind until the answer did not measure
    # better (docs/gateway.md)
    rt = _runtime(prior_sigma=0.2)
    t0 = rt.now()
    rt.queues.drain(t0)
    _place(rt, 1)
    _, work = _place(rt, 2)
    rt.queues.drain(t0 + 1.5 * work)
    residual = expected_residual(work, 1.5 * work, 0.0, 0.2)
    assert rt.cluster.prefill[0].queued_work_s == pytest.approx(residual + 0.5 * work,
                                                                rel=1e-3)


def test_an_answer_reaches_the_cores_one_observation_path() -> None:
    """The gateway observes a prefill as the simulator does (Conductor.observe_prefill):
    the cost model's calibration, the overrun estimate and the admission margin's
    measured error all learn from it."""
    cfg = ModelSettings(name="m", conductor={
        "overrun": {"min_samples": 1},
        # a floor under this test's prefill (a 30 s SLO's tenth is longer): every answer counts
        "admission_rule": {"ttft_miss_risk": 0.01, "error_floor_share": 0.01}})
    rt = ModelRuntime(cfg, GatewaySettings(), GatewayMetrics())
    rt.members.set_endpoints(Role.PREFILL, [Endpoint(url=f"http://{HOST}:1")])
    rt.members.set_endpoints(Role.DECODE, [Endpoint(url=f"http://{HOST}:100")])
    for inst in [*rt.prefill, *rt.decode]:
        rt.members.mark_health(inst, True)
    state = rt.reports.state()
    # the gateway times whole placement-to-answer spans: its margin takes that error
    assert state["admission"] == {"on": True, "rule": "prediction", "ttft_miss_risk": 0.01,
                                  "error_of": "ttft", "error": {
                                      "answers": 0, "measured": False, "floor_s": 0.3,
                                      "mu": 0.0, "sigma": 0.2,
                                      "factor": pytest.approx(math.exp(Z99 * 0.2))}}
    assert state["capabilities"] == rt.conductor.capabilities.on()
    assert {"admission", "calibration", "reestimation"} <= set(state["capabilities"])
    before = rt.cost.prefill_time(TOKENS, 0)
    margin = rt.conductor.admission_rule.ttft_error  # type: ignore[attr-defined]
    assert margin is not None and margin.samples == 0
    for i in range(3):
        req, work = _place(rt, i + 1)
        rt.queues.prefill_done(rt.prefill[0], req, 2.0 * work, work)
        assert margin.samples == i + 1
    assert rt.reports.state()["admission"]["error"]["answers"] == 3
    est = rt.conductor.overrun
    assert est is not None and est.samples == 3
    assert est.mu == pytest.approx(np.log(2.0))
    # three steps of the calibration rate towards 2x
    rate = rt.conductor.config.calibration.rate
    cal = rt.reports.state()["calibration"]
    assert (cal["prefill_scale"], cal["observed_prefills"]) == (
        pytest.approx(2.0 ** (3 * rate)), 3)
    assert rt.cost.prefill_time(TOKENS, 0) > before


def test_queued_work_drains_a_modelled_second_per_second() -> None:
    """Queued work is priced by the calibrated model, so it drains at the clock's pace
    whatever the engines' speed: the calibration, not the drain, absorbs a slow engine."""
    rt = _runtime(enabled=False)
    t0 = rt.now()
    rt.queues.drain(t0)
    _req, work = _place(rt, 1)
    rt.queues.drain(t0 + 0.25 * work)
    assert rt.cluster.prefill[0].queued_work_s == pytest.approx(0.75 * work, rel=1e-6)
