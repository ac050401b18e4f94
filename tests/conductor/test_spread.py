"""The spread of prefill times (``spread``) and how it scales the conductor's price of
work: ``kappa x min(1, (1 + cv^2) / 2)`` (Allen-Cunneen)."""

import pytest
from mooncake_conductor.policies.base import PrefillPolicy
from mooncake_conductor.spread import ServiceSpread

from .helpers import COST, cluster, policy, queue, request

MID = 60_000  # tokens: one instance meets the SLO (13.31 s), a pair takes 7.85 s


def test_no_spread_before_enough_samples() -> None:
    s = ServiceSpread(window=8, min_samples=3)
    assert s.factor == 1.0 and s.cv2 == 0.0
    s.observe(2.0)
    s.observe(2.0)
    assert s.factor == 1.0  # two samples: not yet
    s.observe(2.0)
    assert s.cv2 == 0.0 and s.factor == 0.5  # regular service halves the price


def test_cv2_of_the_plain_mean_then_the_weighted_one() -> None:
    s = ServiceSpread(window=2)
    s.observe(1.0)
    s.observe(3.0)  # m1 2, m2 5: cv2 = 5 / 4 - 1
    assert s.cv2 == pytest.approx(0.25)
    assert s.factor == pytest.approx(0.625)
    s.observe(3.0)  # weight 1/2: m1 2.5, m2 7
    assert s.cv2 == pytest.approx(7 / 6.25 - 1)


def test_heavy_tails_leave_the_price_as_it_is() -> None:
    s = ServiceSpread(window=64)
    for t in [0.1] * 9 + [10.0]:
        s.observe(t)
    assert s.cv2 > 1.0
    assert s.factor == 1.0  # capped: kappa already counts the queues heavy tails build


def test_a_request_seen_again_is_counted_once() -> None:
    """The conductor observes a request's prefill time when the arrival rate counts it as
    new: one scheduled again while held, or an older one, is not counted again."""
    p = policy("conductor")
    for rid, n in ((1, 1024), (2, 3 * 1024), (2, 3 * 1024), (2, 3 * 1024), (1, 1024)):
        p.choose(request(list(range(n // 512)), tokens=n, rid=rid), cluster(2), 0.0)
    spread = p._spread  # type: ignore[attr-defined]
    t1, t2 = COST.prefill_time(1024), COST.prefill_time(3 * 1024)
    m1, m2 = (t1 + t2) / 2, (t1 * t1 + t2 * t2) / 2
    assert spread.cv2 == pytest.approx(m2 / (m1 * m1) - 1)


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError):
        ServiceSpread(window=0)
    with pytest.raises(ValueError):
        ServiceSpread(window=4, min_samples=0)


def warmed(p: PrefillPolicy, tokens: list[int]) -> None:
    """Place one request of each size on an idle pool (the policy sees its prefill time)."""
    for rid, n in enumerate(tokens, start=1):
        p.choose(request(list(range(n // 512)), tokens=n, rid=rid), cluster(5), 0.0)


def mid_on_loaded(p: PrefillPolicy) -> list[int]:
    """The 60k-token prompt on 5 instances, the last busy with 20 queued: kappa 4.2 (1
    busy + 20 waiting over 5). At full price one instance scores best (13.31 + 4.2 x 13.31
    = 69.2 s against 7.85 + 4.2 x 15.7 = 73.8 for the pair); at half price the pair does
    (40.8 against 41.3)."""
    c = cluster(5)
    queue(c.prefill[-1], 100.0, requests=20)
    return p.choose(request(list(range(118)), tokens=MID, rid=10_000), c, 0.0).cpp_group


def test_regular_prompts_make_work_cheaper_and_a_group_pays_off() -> None:
    regular = policy("conductor", spread_min_samples=16)
    warmed(regular, [MID] * 16)
    assert len(mid_on_loaded(regular)) >= 2
    off = policy("conductor", spread_price=False, spread_min_samples=16)
    warmed(off, [MID] * 16)
    assert mid_on_loaded(off) == []


def test_spread_prompts_keep_the_full_price() -> None:
    spread = policy("conductor", spread_min_samples=16)
    warmed(spread, [2048] * 15 + [120_000])  # cv^2 > 1
    assert mid_on_loaded(spread) == []


def test_until_min_samples_the_price_is_unchanged() -> None:
    p = policy("conductor", spread_min_samples=18)  # 16 + the 60k prompt itself: 17
    warmed(p, [MID] * 16)
    assert mid_on_loaded(p) == []
    assert COST.prefill_time(MID) > 13.0  # the docstring's premise
