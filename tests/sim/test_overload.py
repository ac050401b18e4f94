"""Admission under overload in the simulator (:mod:`mooncake_conductor.admission`): the
naive rule on the current queue, the paper's rule on prediction, and the error margin,
on one overloaded replay (``benchmarks/overload.py`` measures them at scale)."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_sim.engine import Simulation
from mooncake_sim.presets import PRESETS
from mooncake_sim.trace import bundled_trace, load_trace

RULES = {"current-load": {"rule": "current-load"}, "prediction": {"rule": "prediction"},
         "margin": {"rule": "prediction", "ttft_miss_risk": 0.01}}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """The first 3,000 requests of the conversation trace on 4 + 4 instances at 4x
    replay speed (about twice what they serve), each rule, the preset's realism."""
    records = load_trace(bundled_trace())[:3000]
    preset = PRESETS["paper-fig5"]
    out = {}
    for name, rule in RULES.items():
        cfg = preset.sim_config("conductor", 4.0, prefill=4, decode=4,
                                conductor={"seed": 0, "admission_rule": rule})
        sim = Simulation(records, cfg)
        res = sim.run()
        slo = cfg.conductor.slo
        served = [r for r in sim.reqs if r.decision is not None and not r.decision.rejected]
        ok = sum(r.ttft <= slo.ttft_s and r.tbt <= slo.tbt_s for r in served)
        out[name] = {"rejected": res["rejected"], "ok": ok, "admitted_ok": ok / len(served)}
    return out


def test_the_margin_keeps_99_percent_of_the_admitted_within_slo(
        runs: dict[str, dict[str, Any]]) -> None:
    assert runs["prediction"]["admitted_ok"] < 0.99  # the overload this is about
    assert runs["margin"]["admitted_ok"] >= 0.99


def test_the_margin_serves_no_fewer_within_slo(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["margin"]["ok"] >= runs["prediction"]["ok"]


def test_rejecting_on_the_current_queue_rejects_more_and_serves_fewer_within_slo(
        runs: dict[str, dict[str, Any]]) -> None:
    naive, paper = runs["current-load"], runs["prediction"]
    assert naive["rejected"] > paper["rejected"]
    assert naive["ok"] < paper["ok"]
    assert naive["admitted_ok"] < paper["admitted_ok"]
