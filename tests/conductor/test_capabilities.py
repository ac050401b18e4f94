"""Capabilities (:mod:`mooncake_conductor.capabilities`): composed once from the policy's
published defaults and the configuration's switches, with the rule's dependencies."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from mooncake_conductor.capabilities import Capabilities, Overrides, compose
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.policies.registry import policy_class, policy_names

ALL = Capabilities(**{f.name: True for f in fields(Capabilities)})
NAMES = [f.name for f in fields(Capabilities)]


def test_unset_switches_keep_the_policys_own() -> None:
    for own in (Capabilities(), ALL, Capabilities(admission=True, calibration=True)):
        got = compose(own, Overrides(), routing_only=False, decode_counts_placed=True)
        assert got == own


@pytest.mark.parametrize("name", NAMES)
def test_each_switch_overrides_its_own_default(name: str) -> None:
    on = compose(Capabilities(admission=True), Overrides(**{name: True}),
                 routing_only=False, decode_counts_placed=True)
    off = compose(ALL, Overrides(**{name: False}), routing_only=False,
                  decode_counts_placed=True)
    assert getattr(on, name) is True
    assert getattr(off, name) is False
    # the others keep their defaults, except what depends on admission
    dependent = {"shedding", "holding"} if name == "admission" else set()
    assert [n for n in NAMES if getattr(off, n) is False] == [
        n for n in NAMES if n == name or n in dependent]


@pytest.mark.parametrize("name", ["shedding", "holding"])
def test_admission_rules_need_admission(name: str) -> None:
    got = compose(Capabilities(), Overrides(**{name: True}), routing_only=False,
                  decode_counts_placed=True)
    assert getattr(got, name) is False
    got = compose(Capabilities(), Overrides(admission=True, **{name: True}),
                  routing_only=False, decode_counts_placed=True)
    assert getattr(got, name) is True


def test_routing_only_keeps_calibration_and_reestimation() -> None:
    got = compose(ALL, Overrides(admission=True, stealing=True, replication=True),
                  routing_only=True, decode_counts_placed=True)
    assert got.on() == ["calibration", "reestimation"]


def test_holding_by_default_only_with_a_selector_that_counts_placed() -> None:
    assert not compose(ALL, Overrides(), routing_only=False,
                       decode_counts_placed=False).holding
    assert compose(ALL, Overrides(holding=True), routing_only=False,
                   decode_counts_placed=False).holding


@pytest.mark.parametrize("policy", policy_names())
def test_the_conductor_runs_what_its_configuration_composes(policy: str) -> None:
    cfg = ConductorConfig(policy=policy)
    cond = Conductor(cfg)
    caps = cfg.capabilities()
    assert cond.capabilities == caps
    if policy_class(policy).capabilities == Capabilities():
        assert caps.on() == []
    # the objects that carry a capability exist exactly when it is on
    assert (cond.shedding is not None) is caps.shedding
    assert (cond.stealing is not None) is caps.stealing
    assert (cond.overrun is not None) is caps.reestimation


@pytest.mark.parametrize(("settings", "on"), [
    ({}, ["admission", "shedding", "stealing", "holding", "replication", "calibration",
          "reestimation"]),
    ({"shedding": {"enabled": False}, "stealing": {"enabled": False},
      "overrun": {"enabled": False}, "calibrate": False, "replicate": False},
     ["admission", "holding"]),
    ({"decode_selector": "tbt-slo"}, ["admission", "shedding", "stealing", "replication",
                                       "calibration", "reestimation"]),
])
def test_the_configurations_switches_reach_the_conductor(settings: dict[str, Any],
                                                         on: list[str]) -> None:
    assert Conductor(ConductorConfig(policy="conductor", **settings)).capabilities.on() == on


def test_the_paper_baseline_admits_and_nothing_more() -> None:
    assert ConductorConfig(policy="kvcache-centric").capabilities().on() == ["admission"]
