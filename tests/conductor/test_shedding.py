"""Overload shedding (:mod:`mooncake_conductor.shedding`): the rule on bare numbers, then
in :class:`Conductor.schedule` on hand-made pools."""

from typing import Any

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.shedding import OverloadShedding, SheddingConfig
from mooncake_conductor.state import ClusterState
from pydantic import ValidationError

from .helpers import COST, cluster, queue, request

SLO = 30.0


def rule(**cfg: Any) -> OverloadShedding:
    return OverloadShedding(SheddingConfig(**cfg), SLO)


def test_saturation_is_zero_until_the_start_then_linear_to_one_at_the_slo() -> None:
    r = rule(from_share=0.5)
    assert r.saturation(0.0) == 0.0
    assert r.saturation(15.0) == 0.0
    assert r.saturation(22.5) == pytest.approx(0.5)
    assert r.saturation(30.0) == 1.0
    assert r.saturation(90.0) == 1.0
    assert rule(from_share=0.0).saturation(6.0) == pytest.approx(0.2)


def test_below_the_start_nothing_is_shed_however_costly() -> None:
    r = rule(cost_rate=1.0)
    assert r.admit(0.0, 0.1)
    assert r.admit(14.9, 1000.0)


def test_at_the_horizon_only_requests_at_most_the_mean_get_in() -> None:
    r = rule(cost_rate=1.0)  # the mean is the previous request's cost
    assert r.admit(30.0, 2.0)  # the first request is its own mean
    assert not r.admit(30.0, 2.5)
    assert r.admit(30.0, 2.5)  # the shed request's cost joined the mean


def test_half_saturated_a_request_is_worth_twice_the_mean() -> None:
    r = rule(cost_rate=1.0)
    assert r.admit(0.0, 1.0)
    assert r.admit(22.5, 2.0)  # 0.5 x 2 = 1: at the mean, admitted
    r.admit(0.0, 1.0)
    assert not r.admit(22.5, 2.0 + 1e-9)


def test_the_mean_is_exponentially_weighted_over_every_request_checked() -> None:
    r = rule(cost_rate=0.25)
    r.admit(0.0, 4.0)
    assert r.mean_gpu_s == 4.0
    r.admit(0.0, 8.0)
    assert r.mean_gpu_s == pytest.approx(5.0)
    assert not r.admit(30.0, 100.0)  # shed, and still counted
    assert r.mean_gpu_s == pytest.approx(5.0 + 95.0 * 0.25)


@pytest.mark.parametrize("cfg", [{"from_share": 1.0}, {"from_share": -0.1},
                                 {"cost_rate": 0.0}, {"cost_rate": 1.5}, {"unknown": 1}])
def test_bad_settings_are_refused(cfg: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SheddingConfig(**cfg)


# -- in the Conductor -----------------------------------------------------------------------
NO_CPP = {"cpp": {"enabled": False}}
LONG, SHORT = list(range(20)), list(range(100, 102))  # 10240 and 1024 tokens


def _queued(seconds: float) -> ClusterState:
    c = cluster(2)
    for p in c.prefill:
        queue(p, seconds)
    return c


def _conductor(**cfg: Any) -> Conductor:
    cfg.setdefault("params", NO_CPP)
    shedding = {"cost_rate": 1.0, **cfg.pop("shedding", {})}
    return Conductor(ConductorConfig(policy="conductor", shedding=shedding, **cfg))


def test_a_costly_request_at_a_saturated_queue_is_rejected_as_overload() -> None:
    c = _queued(24.0)  # saturation (24 - 15) / 15 = 0.6
    cond = _conductor()
    assert not cond.schedule(request(SHORT, rid=1), c, 0.0).rejected
    d = cond.schedule(request(LONG, rid=2), c, 0.0)
    assert d.placement.ttft_s < SLO  # the paper's rule would serve it
    assert COST.prefill_time(10240) * 0.6 > COST.prefill_time(1024)
    assert d.reject_reason == "overload"
    assert d.placement.prefill is not None  # where it would have gone is still reported


def test_the_same_request_at_a_short_queue_is_served() -> None:
    c = _queued(10.0)
    cond = _conductor()
    cond.schedule(request(SHORT, rid=1), c, 0.0)
    assert not cond.schedule(request(LONG, rid=2), c, 0.0).rejected


def test_a_predicted_miss_stays_a_ttft_slo_rejection() -> None:
    d = _conductor().schedule(request(LONG), _queued(40.0), 0.0)
    assert d.reject_reason == "ttft-slo"


def test_a_shed_request_is_not_recorded_as_an_access() -> None:
    def hot_after(**cfg: Any) -> list[tuple[int, ...]]:
        c = _queued(24.0)
        c.index.store(0, LONG[:2])  # a short prefix of it is held: an access when placed
        cond = _conductor(replication={"min_rate_per_s": 1e-3}, **cfg)  # one access is hot
        cond.schedule(request(SHORT, rid=1), c, 0.0)
        cond.schedule(request(LONG, rid=2), c, 0.0)
        return [keys for _, _, keys in cond.hot.hot(0.0)]

    assert hot_after() == []
    assert hot_after(shedding={"enabled": False}) == [tuple(LONG[:2])]


@pytest.mark.parametrize("cfg", [{"shedding": {"enabled": False}}, {"admission": False},
                                 {"routing_only": True}])
def test_off_when_disabled_or_without_admission(cfg: dict[str, Any]) -> None:
    c = _queued(24.0)
    cond = _conductor(**cfg)
    assert cond.shedding is None
    cond.schedule(request(SHORT, rid=1), c, 0.0)
    assert cond.schedule(request(LONG, rid=2), c, 0.0).reject_reason is None


def test_policy_defaults() -> None:
    assert Conductor(ConductorConfig(policy="conductor")).shedding is not None
    for policy in ("kvcache-centric", "mooncake-paper", "least-load"):
        assert Conductor(ConductorConfig(policy=policy)).shedding is None, policy
    forced = Conductor(ConductorConfig(policy="mooncake-paper", shedding={"enabled": True}))
    assert forced.shedding is not None
    # no admission, nothing to shed with
    assert Conductor(ConductorConfig(policy="least-load",
                                     shedding={"enabled": True})).shedding is None
