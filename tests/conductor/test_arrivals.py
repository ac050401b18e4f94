"""The arrival rate and the wait of the arrivals a choice shuts out (``arrivals``), and
how the conductor prices a CPP group with them."""

import math

import pytest
from mooncake_conductor.arrivals import ArrivalRate, shut_out_wait
from mooncake_conductor.cpp import CPPConfig, choose_chunk
from mooncake_conductor.policies.base import PrefillPolicy

from .helpers import COST, cluster, policy, queue, request


def test_no_rate_or_an_idle_instance_shuts_nobody_out() -> None:
    assert shut_out_wait([30.0, 30.0], 0.0) == 0.0
    assert shut_out_wait([10.0, 0.0, 10.0], 100.0) == 0.0
    assert shut_out_wait([], 5.0) == 0.0


def test_the_arrivals_before_the_first_instance_frees_wait_for_it() -> None:
    # every instance busy, the first free in 4 s, two arrivals a second: 8 arrivals
    # waiting 2 s on average
    assert shut_out_wait([6.0, 4.0, 9.0], 2.0) == pytest.approx(16.0)
    assert shut_out_wait([0.5], 1.0) == pytest.approx(0.125)


def test_holding_the_last_idle_instances_longer_shuts_out_more() -> None:
    assert (shut_out_wait([1.0, 0.0], 3.0) < shut_out_wait([1.0, 2.0], 3.0)
            < shut_out_wait([3.0, 2.0], 3.0) < shut_out_wait([3.0, 2.0], 6.0))


def test_rate_is_the_mean_gap_then_a_weighted_one() -> None:
    r = ArrivalRate(window=2)
    assert r.per_s == 0.0
    r.observe(1, 0.0)
    assert r.per_s == 0.0  # one arrival: no gap yet
    r.observe(2, 1.0)
    r.observe(3, 2.0)
    assert r.per_s == pytest.approx(1.0)
    r.observe(4, 5.0)  # gap 3 s, weight 1/2: mean gap 1 + (3 - 1) / 2 = 2 s
    assert r.per_s == pytest.approx(0.5)


def test_a_burst_counts_its_zero_gaps() -> None:
    r = ArrivalRate(window=32)
    for rid, at in enumerate([0.0, 0.0, 0.0, 3.0], start=1):
        r.observe(rid, at)
    assert r.per_s == pytest.approx(1.0)  # gaps 0, 0, 3


def test_a_request_seen_before_is_not_a_new_arrival() -> None:
    r = ArrivalRate(window=32)
    assert r.observe(1, 0.0) and r.observe(2, 1.0)
    assert not r.observe(2, 1.0)  # scheduled again while held
    assert not r.observe(1, 0.0)  # an older one (a steal prices it again)
    assert r.observe(3, 2.0)
    assert r.per_s == pytest.approx(1.0)


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ArrivalRate(window=0)


def _after_arrivals(gap: float, **params: object) -> tuple[PrefillPolicy, float]:
    """A conductor that has seen 20 short requests ``gap`` seconds apart (ids 1..20);
    returns it and the time the next arrives."""
    pol = policy("conductor", **params)
    for i in range(1, 21):
        pol.choose(request([10_000 + i], rid=i, arrival=i * gap), cluster(4), i * gap)
    return pol, 21 * gap


def test_a_group_that_shuts_out_a_stream_of_arrivals_loses_to_one_instance() -> None:
    """4 instances, 2 busy for 1 s (kappa (2 busy + 2 waiting) / 4 = 1), a 40k-token
    prompt, ten arrivals a second. The idle pair: 4.39 s + 1 x 8.78 GPU s + the arrivals
    it shuts out (no instance free for 1 s: 10 x 1**2 / 2 = 5 s) = 18.17; one idle
    instance leaves the other idle: 7.20 + 7.20 = 14.40. Without the price the pair wins
    (13.17 against 14.40)."""
    prompt = list(range(40_000 // 512))
    pair = choose_chunk(COST, 40_000, 0, 2, CPPConfig())[1]
    single = COST.prefill_time(40_000)
    chosen = {}
    for priced in (True, False):
        pol, now = _after_arrivals(0.1, shut_out_price=priced)
        c = cluster(4)
        queue(c.prefill[2], 1.0)
        queue(c.prefill[3], 1.0)
        chosen[priced] = pol.choose(request(prompt, tokens=40_000, rid=21, arrival=now), c, now)
    assert chosen[True].cpp_group == [] and math.isclose(chosen[True].ttft_s, single)
    assert len(chosen[False].cpp_group) == 2 and math.isclose(chosen[False].ttft_s, pair)


def test_with_arrivals_far_apart_the_group_still_forms() -> None:
    # the same pool and prompt, one arrival every 50 s: nobody is shut out
    pol, now = _after_arrivals(50.0)
    c = cluster(4)
    queue(c.prefill[2], 1.0)
    queue(c.prefill[3], 1.0)
    pl = pol.choose(request(list(range(78)), tokens=40_000, rid=21, arrival=now), c, now)
    assert len(pl.cpp_group) == 2


def _busy_pool_choice(tokens: int, **params: object) -> int:
    """4 instances all busy (free in 0.2, 1.5, 3 and 3 s), ten arrivals a second, no CPP:
    the instance ``tokens`` of new prompt goes to."""
    params.setdefault("arrival_window", 16)  # the 20 gaps seen settle the rate
    pol, now = _after_arrivals(0.1, cpp={"enabled": False}, **params)
    c = cluster(4)
    for inst, seconds in zip(c.prefill, (0.2, 1.5, 3.0, 3.0), strict=True):
        queue(inst, seconds)
    prompt = list(range(-(-tokens // 512)))
    pl = pol.choose(request(prompt, tokens=tokens, rid=21, arrival=now), c, now)
    assert pl.prefill is not None
    return pl.prefill


@pytest.mark.parametrize("explain", [False, True])  # the compiled ranking and the Python one
def test_a_long_prompt_leaves_the_first_free_instance_to_the_arrivals(explain: bool) -> None:
    """A 40k-token prompt on the instance free in 0.2 s keeps every instance busy for
    1.5 s: 10 x 1.5**2 / 2 = 11.25 s of waiting for the arrivals, against 10 x 0.2**2 / 2
    = 0.2 s when it waits 1.3 s longer for the next instance. Without the price it takes
    the first."""
    assert _busy_pool_choice(40_000, explain=explain) == 1
    assert _busy_pool_choice(40_000, explain=explain, placement_shut_out=False) == 0


@pytest.mark.parametrize("explain", [False, True])
def test_a_short_prompt_still_takes_the_first_free_instance(explain: bool) -> None:
    """A short prompt frees its instance soon after: it shuts out little and takes the
    instance free first."""
    assert COST.prefill_time(512) < 0.2
    assert _busy_pool_choice(512, explain=explain) == 0


def test_a_rate_from_fewer_gaps_than_the_window_prices_no_placement() -> None:
    """The 20 arrivals before and the prompt itself are 20 gaps: a window of 21 (the
    default is 32) is not filled yet, and the long prompt takes the instance free first."""
    assert _busy_pool_choice(40_000, arrival_window=20) == 1
    assert _busy_pool_choice(40_000, arrival_window=21) == 0


def test_the_rate_settles_after_a_window_of_gaps() -> None:
    rate = ArrivalRate(window=3)
    for i in range(4):
        assert not rate.settled
        rate.observe(i, i * 0.5)
    assert rate.settled and math.isclose(rate.per_s, 2.0)
