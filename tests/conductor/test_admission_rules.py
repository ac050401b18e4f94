"""Admission rules (:mod:`mooncake_conductor.admission`): the prediction error margin on
bare numbers, each rule on hand-made placements, and the rule in
:class:`Conductor.schedule`."""

from __future__ import annotations

import ast
import math
import random
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import pytest
from mooncake_conductor import admission as admission_package
from mooncake_conductor.admission import AdmissionConfig, admission_names, create_admission
from mooncake_conductor.admission.prediction import PredictionAdmission
from mooncake_conductor.admission.risk import (
    sum_quantile,
    ttft_margin,
    widest_growth,
    work_ahead,
    z_of,
)
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.policies.base import Placement, SLOConfig
from pydantic import ValidationError

from .helpers import cluster, queue, request

SLO = SLOConfig(ttft_s=30.0, tbt_s=0.1)
Z99 = NormalDist().inv_cdf(0.99)


def test_one_item_quantile_is_the_lognormal_quantile_exactly() -> None:
    for mu, sigma in [(0.0, 0.2), (0.1, 0.5), (-0.05, 0.1)]:
        assert sum_quantile(20.0, 400.0, mu, sigma, Z99) == pytest.approx(
            20.0 * math.exp(mu + Z99 * sigma))


def test_many_short_items_get_a_narrower_margin_than_one_long_one() -> None:
    one = ttft_margin([25.0], 0.0, 0.2, Z99)
    many = ttft_margin([0.5] * 50, 0.0, 0.2, Z99)
    assert one == pytest.approx(25.0 * math.expm1(Z99 * 0.2))
    # 50 equal items: the sum's spread shrinks by about sqrt(50)
    assert 0 < many < one / 5


def test_the_margin_matches_a_monte_carlo_quantile() -> None:
    rng = random.Random(1)
    work = [8.0, 6.0, 3.0, 2.0, 1.0, 1.0, 0.5]
    sums = sorted(sum(w * rng.lognormvariate(0.0, 0.2) for w in work) for _ in range(40_000))
    q = sums[int(0.99 * len(sums))]
    assert sum(work) + ttft_margin(work, 0.0, 0.2, Z99) == pytest.approx(q, rel=0.02)


def test_widest_growth_bounds_every_split_of_the_work() -> None:
    rng = random.Random(7)
    for mu, sigma, z in [(0.0, 0.2, Z99), (0.0, 0.8, 0.3), (0.02, 0.3, 0.0), (0.0, 0.2, 5.0)]:
        bound = widest_growth(mu, sigma, z)
        for _ in range(200):
            work = [rng.expovariate(1.0) for _ in range(rng.randint(1, 12))]
            assert ttft_margin(work, mu, sigma, z) <= bound * sum(work) + 1e-9


def test_the_margin_is_never_negative() -> None:
    assert ttft_margin([10.0, 5.0], -0.5, 0.1, Z99) == 0.0
    assert ttft_margin([], 0.0, 0.2, Z99) == 0.0


def test_work_ahead_counts_the_running_remainder_and_the_queue_it_will_not_pass() -> None:
    c = cluster(1)
    inst = c.prefill[0]
    inst.busy_until = 12.0
    inst.enqueue(1, 1.0, 3.0, 1, 512)
    inst.enqueue(2, 5.0, 4.0, 1, 512)
    assert sorted(work_ahead(inst, 10.0, None)) == [2.0, 3.0, 4.0]
    assert sorted(work_ahead(inst, 10.0, 2.0)) == [2.0, 3.0]  # passes the priority-5 one
    assert work_ahead(inst, 20.0, None)[0] == 0.0


def placed(queue_s: float, prefill_s: float, iid: int = 0) -> Placement:
    return Placement(prefill=iid, queue_s=queue_s, prefill_s=prefill_s)


def test_prediction_without_margin_is_the_paper_rule() -> None:
    rule = create_admission(AdmissionConfig(), SLO)
    c = cluster(1)
    assert not rule.breaks_ttft(placed(25.0, 5.0), c, 0.0, 0.0)
    assert rule.breaks_ttft(placed(25.0, 5.1), c, 0.0, 0.0)
    assert rule.breaks_ttft(placed(20.0, 5.0), c, 0.0, 5.5)  # a held request waited


def test_the_margin_refuses_one_long_item_and_admits_the_same_work_in_many() -> None:
    rule = create_admission(AdmissionConfig(ttft_miss_risk=0.01), SLO)
    assert isinstance(rule, PredictionAdmission)
    long_queue, short_queue = cluster(1), cluster(1)
    queue(long_queue.prefill[0], 24.0)  # one 24 s prompt ahead: ~18% chance of +20%
    queue(short_queue.prefill[0], 24.0, requests=96)  # 96 prompts of 0.25 s
    assert rule.breaks_ttft(placed(24.0, 0.5), long_queue, 0.0, 0.0)
    assert not rule.breaks_ttft(placed(24.0, 0.5), short_queue, 0.0, 0.0)
    # a short wait is admitted on the fast path, whatever the queue is made of
    assert not rule.breaks_ttft(placed(0.0, 15.0), cluster(1), 0.0, 0.0)


def test_the_margin_follows_the_measured_error() -> None:
    rule = create_admission(AdmissionConfig(ttft_miss_risk=0.01), SLO)
    c = cluster(1)
    queue(c.prefill[0], 24.0, requests=8)
    assert rule.breaks_ttft(placed(24.0, 3.0), c, 0.0, 0.0)  # prior sigma 0.2
    for _ in range(50):  # a predictor that is never wrong
        rule.observe(1.0, 1.0)
    assert not rule.breaks_ttft(placed(24.0, 3.0), c, 0.0, 0.0)


def test_a_ttft_error_is_spread_over_the_whole_ttft_not_over_the_items() -> None:
    """``error_of="ttft"``: the measured error is of whole placement-to-answer times, so
    its quantile applies to the whole predicted TTFT, however many items the queue holds
    (per prefill, 96 short items would average their errors out and pass)."""
    per_ttft = create_admission(AdmissionConfig(ttft_miss_risk=0.01, error_of="ttft"), SLO)
    per_item = create_admission(AdmissionConfig(ttft_miss_risk=0.01), SLO)
    short_queue = cluster(1)
    queue(short_queue.prefill[0], 24.0, requests=96)
    assert not per_item.breaks_ttft(placed(24.0, 0.5), short_queue, 0.0, 0.0)
    assert per_ttft.breaks_ttft(placed(24.0, 0.5), short_queue, 0.0, 0.0)
    # the bound is the lognormal quantile of the prior error on the TTFT: 30 / e^(z 0.2)
    bound = SLO.ttft_s / math.exp(Z99 * 0.2)
    assert not per_ttft.breaks_ttft(placed(bound - 0.51, 0.5), short_queue, 0.0, 0.0)
    assert per_ttft.breaks_ttft(placed(bound - 0.49, 0.5), short_queue, 0.0, 0.0)
    for _ in range(50):  # never wrong: the margin all but goes
        per_ttft.observe(10.0, 10.0)
    assert not per_ttft.breaks_ttft(placed(28.0, 0.5), short_queue, 0.0, 0.0)
    late = create_admission(AdmissionConfig(ttft_miss_risk=0.01, error_of="ttft"), SLO)
    for _ in range(200):  # always 25% late: nothing predicted over 24 s is admitted
        late.observe(10.0, 12.5)
    assert late.breaks_ttft(placed(23.6, 0.5), short_queue, 0.0, 0.0)
    assert not late.breaks_ttft(placed(22.0, 0.5), short_queue, 0.0, 0.0)


def test_the_ttft_margin_ignores_short_predictions_below_its_floor() -> None:
    """Short predictions answered late by a fixed overhead (0.3 s predicted, 1.0 s
    answered) do not count below a tenth of the SLO: a 28 s prediction whose peers were
    answered on time is admitted. Counted, they would turn it away."""
    c = cluster(1)
    rules = {share: create_admission(AdmissionConfig(
        ttft_miss_risk=0.01, error_of="ttft", error_floor_share=share), SLO)
        for share in (0.1, 0.001)}
    for rule in rules.values():
        for _ in range(100):
            rule.observe(0.3, 1.0)
        for _ in range(30):
            rule.observe(10.0, 10.0)
    assert not rules[0.1].breaks_ttft(placed(27.5, 0.5), c, 0.0, 0.0)
    assert rules[0.001].breaks_ttft(placed(27.5, 0.5), c, 0.0, 0.0)


def test_current_load_ignores_the_requests_own_prefill() -> None:
    rule = create_admission(AdmissionConfig(rule="current-load"), SLO)
    c = cluster(1)
    assert not rule.breaks_ttft(placed(29.0, 20.0), c, 0.0, 0.0)  # predicted 49 s: admitted
    assert rule.breaks_ttft(placed(30.5, 0.1), c, 0.0, 0.0)
    assert rule.breaks_ttft(placed(25.0, 0.1), c, 0.0, 6.0)


def test_config_names_the_rule_and_checks_the_option() -> None:
    assert admission_names() == ["current-load", "prediction"]
    with pytest.raises(ValidationError, match="unknown admission rule"):
        AdmissionConfig(rule="nope")
    with pytest.raises(ValidationError, match="prediction rule only"):
        AdmissionConfig(rule="current-load", ttft_miss_risk=0.01)
    with pytest.raises(ValidationError):
        AdmissionConfig(ttft_miss_risk=0.6)
    assert z_of(0.01) == pytest.approx(Z99)


#: modules of the admission package that define no rule (``risk``: the prediction rule's
#: margin arithmetic; ``ttfterror``: its measured error on whole TTFTs)
NOT_RULES = {"__init__", "base", "_all", "registry", "risk", "ttfterror"}


def test_all_imports_every_rule_module_and_each_registers_a_rule() -> None:
    folder = Path(admission_package.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - NOT_RULES
    tree = ast.parse((folder / "_all.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module
                for alias in node.names}
    assert imported == modules  # a rule module _all forgets is never registered
    registered_by = {type(create_admission(AdmissionConfig(rule=n), SLO)).__module__
                     for n in admission_names()}
    assert registered_by == {f"{admission_package.__name__}.{m}" for m in modules}


def test_a_config_made_with_the_base_module_alone_knows_every_rule() -> None:
    # AdmissionConfig checks its rule against the registry .base keeps: importing .base runs
    # the package's __init__ first, whose .registry import registers every rule module
    code = ("from mooncake_conductor.admission.base import AdmissionConfig\n"
            "print(AdmissionConfig(rule='current-load').rule)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "current-load"


KEYS = list(range(40))  # 20,480 tokens: a few seconds of prefill


def busy_pool() -> object:
    """One prefill instance with 28 s of one prompt queued: the request's own prefill
    takes it past the 30 s SLO, its wait alone does not."""
    c = cluster(1, decode=1)
    queue(c.prefill[0], 28.0)
    return c


@pytest.mark.parametrize(("rule", "rejected"), [("prediction", True), ("current-load", False)])
def test_conductor_schedules_with_the_configured_rule(rule: str, rejected: bool) -> None:
    cfg = ConductorConfig(policy="kvcache-centric", admission_rule={"rule": rule})
    d = Conductor(cfg).schedule(request(KEYS), busy_pool(), 0.0)  # type: ignore[arg-type]
    assert d.placement.ttft_s > 30.0
    assert d.rejected is rejected
    assert d.reject_reason == ("ttft-slo" if rejected else None)


def test_without_admission_the_rule_refuses_nothing() -> None:
    cfg = ConductorConfig(policy="kvcache-centric", admission=False,
                          admission_rule={"ttft_miss_risk": 0.01})
    d = Conductor(cfg).schedule(request(KEYS), busy_pool(), 0.0)  # type: ignore[arg-type]
    assert not d.rejected


def test_the_conductor_feeds_observed_prefills_to_the_rule() -> None:
    con = Conductor(ConductorConfig(admission_rule={"ttft_miss_risk": 0.01}))
    rule = con.admission_rule
    assert isinstance(rule, PredictionAdmission) and rule.error is not None
    for _ in range(30):
        con.observe_prefill(1.0, 2.0)
    assert rule.error.mu == pytest.approx(math.log(2.0))


def test_each_rule_reports_what_it_learnt_of_the_error() -> None:
    assert create_admission(AdmissionConfig(), SLO).measured_error() == {}
    assert create_admission(AdmissionConfig(rule="current-load"), SLO).measured_error() == {}
    per_prefill = create_admission(AdmissionConfig(ttft_miss_risk=0.01), SLO)
    per_prefill.observe(1.0, 2.0)
    assert per_prefill.measured_error() == {"prefills": 1, "mu": 0.0, "sigma": 0.2}
    per_ttft = create_admission(AdmissionConfig(ttft_miss_risk=0.01, error_of="ttft"), SLO)
    for _ in range(30):
        per_ttft.observe(10.0, 12.5)
    got = per_ttft.measured_error()
    assert (got["answers"], got["measured"], got["floor_s"]) == (30, True, 3.0)
    assert got["mu"] == pytest.approx(math.log(1.25))
    assert got["factor"] == pytest.approx(1.25 * math.exp(Z99 * 1e-3))
