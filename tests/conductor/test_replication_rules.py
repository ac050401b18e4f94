"""Hot-prefix replication, rule by rule (module docstring of ``replication.py``).

Each test builds the smallest state where one clause of the rule decides the answer:
the decay law of the access rate, the hot threshold, the LRU bound of the tracker, the
hot-spot and target tests, and the per-round caps of ``plan`` and ``assign_replicas``.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from mooncake_conductor.replication import (
    HotPrefix,
    HotPrefixTracker,
    InstanceLoad,
    ReplicationConfig,
    assign_replicas,
    is_hot_spot,
    pick_target,
)
from mooncake_conductor.state import ClusterState

from .helpers import cluster, queue

HALF_LIFE = 60.0
UNIT = math.log(2.0) / HALF_LIFE  # what one access adds to a prefix's rate


def _prefix(first: int, n: int = 4) -> list[int]:
    return list(range(first, first + n))


# -- the tracker: rates, decay, hot list, LRU bound -------------------------------------


def test_one_access_adds_ln2_over_half_life_and_halves_each_half_life() -> None:
    tr = HotPrefixTracker(ReplicationConfig(half_life_s=HALF_LIFE, min_rate_per_s=1e-12))
    keys = _prefix(10)
    tr.record(keys, 100.0)
    [(prefix, rate, got)] = tr.hot(100.0)
    assert (prefix, got) == (keys[-1], tuple(keys))
    assert rate == pytest.approx(UNIT, rel=1e-12)  # a new prefix starts from zero
    assert tr.hot(100.0 + HALF_LIFE)[0][1] == pytest.approx(UNIT / 2, rel=1e-12)
    assert tr.hot(100.0 + 3 * HALF_LIFE)[0][1] == pytest.approx(UNIT / 8, rel=1e-12)
    # half a second later: decayed by exactly exp(-ln2 / 120)
    assert tr.hot(100.5)[0][1] == pytest.approx(UNIT * 2 ** (-0.5 / HALF_LIFE), rel=1e-12)
    # a query from before the last access does not grow the rate
    assert tr.hot(99.0)[0][1] == pytest.approx(UNIT, rel=1e-12)


def test_accesses_accumulate_after_decaying_the_old_rate() -> None:
    tr = HotPrefixTracker(ReplicationConfig(half_life_s=HALF_LIFE, min_rate_per_s=1e-12))
    keys = _prefix(10)
    tr.record(keys, 0.0)
    tr.record(keys, 0.0)
    assert tr.hot(0.0)[0][1] == pytest.approx(2 * UNIT, rel=1e-12)
    tr.record(keys, HALF_LIFE)  # 2 units halve to 1, plus the new one
    assert tr.hot(HALF_LIFE)[0][1] == pytest.approx(2 * UNIT, rel=1e-12)


def test_hot_threshold_is_inclusive() -> None:
    # a single access gives exactly UNIT; a threshold of UNIT counts it as hot
    tr = HotPrefixTracker(ReplicationConfig(half_life_s=HALF_LIFE, min_rate_per_s=UNIT))
    tr.record(_prefix(10), 5.0)
    assert [p for p, _, _ in tr.hot(5.0)] == [13]
    assert tr.hot(5.001) == []  # and decays below it at once


def test_hot_list_is_hottest_first() -> None:
    tr = HotPrefixTracker(ReplicationConfig(min_rate_per_s=1e-12))
    # prefix keys ascending (13 < 23 < 33) but accesses 2, 1, 3: neither key nor
    # insertion order is rate order
    for first, n in ((10, 2), (20, 1), (30, 3)):
        for _ in range(n):
            tr.record(_prefix(first), 0.0)
    assert [p for p, _, _ in tr.hot(0.0)] == [33, 13, 23]


def test_tracker_forgets_the_least_recently_accessed_prefix() -> None:
    tr = HotPrefixTracker(ReplicationConfig(max_tracked=2, min_rate_per_s=1e-12))
    a, b, c, d = (_prefix(f) for f in (10, 20, 30, 40))
    tr.record(a, 0.0)
    tr.record(b, 1.0)
    tr.record(c, 2.0)  # a is the oldest: dropped, the new one stays
    assert sorted(p for p, _, _ in tr.hot(2.0)) == [23, 33]
    tr.record(b, 3.0)  # b is recent again, so c goes next
    tr.record(d, 4.0)
    assert sorted(p for p, _, _ in tr.hot(4.0)) == [23, 43]


def test_key_array_is_copied_as_uint64() -> None:
    """Keys given as a uint64 array are kept as an array copy (cheap for the garbage
    collector), and later writes to the caller's array do not change them."""
    tr = HotPrefixTracker(ReplicationConfig(min_rate_per_s=1e-12))
    arr = np.arange(100, 110, dtype=np.uint64)
    keys = [int(k) for k in arr]
    tr.record(keys, 0.0, blocks=5, key_array=arr)
    stored = tr._tracked[104].keys
    assert isinstance(stored, np.ndarray) and stored.dtype == np.uint64
    arr[:] = 0
    assert tr.hot(0.0)[0][2] == (100, 101, 102, 103, 104)


# -- is_hot_spot and pick_target ---------------------------------------------------------


def test_hot_spot_is_strictly_past_ratio_times_average_plus_floor() -> None:
    cfg = ReplicationConfig(load_ratio=1.5, load_floor_s=0.5)
    assert not is_hot_spot(3.5, 2.0, cfg)  # exactly 1.5 * 2 + 0.5
    assert is_hot_spot(3.5001, 2.0, cfg)
    assert not is_hot_spot(0.5, 0.0, cfg)  # an idle pool: the floor alone


def test_pick_target_takes_loads_up_to_the_average_and_prefers_room() -> None:
    load = {"a": 2.0, "b": 3.0, "c": 1.0}
    assert pick_target(["a", "b"], load, 2.0, lambda _: False) == "a"  # load == average
    assert pick_target(["b"], load, 2.0, lambda _: False) is None
    # c is less loaded but full: a, with room, is preferred
    assert pick_target(["a", "c"], load, 2.0, lambda n: n == "c") == "a"
    assert pick_target(["a", "c"], load, 2.0, lambda _: True) == "c"


# -- HotPrefixTracker.plan ---------------------------------------------------------------


def _tracker(rates: dict[int, int], **cfg: object) -> HotPrefixTracker:
    """A tracker where prefix ``_prefix(first)`` got ``n`` accesses at time 0."""
    tr = HotPrefixTracker(ReplicationConfig(min_rate_per_s=1e-9, **cfg))
    for first, n in rates.items():
        for _ in range(n):
            tr.record(_prefix(first), 0.0)
    return tr


def _loaded(c: ClusterState, loads: dict[int, float]) -> ClusterState:
    for iid, s in loads.items():
        queue(c.prefill[iid], s)
    return c


def _plan(tr: HotPrefixTracker, c: ClusterState) -> list[tuple[int, int, int]]:
    return [(a.prefix, a.source, a.target) for a in tr.plan(c, 0.0)]


def test_plan_does_nothing_when_disabled() -> None:
    c = _loaded(cluster(3), {0: 30.0})
    c.index.store(0, _prefix(10))
    assert _plan(_tracker({10: 3}), c) == [(13, 0, 1)]
    assert _plan(_tracker({10: 3}, enabled=False), c) == []
    assert _plan(_tracker({10: 3}, max_actions=0), c) == []


def test_plan_caps_the_actions_per_round() -> None:
    # three hot prefixes on loaded instance 0; four idle instances could take them
    c = _loaded(cluster(5), {0: 40.0})
    for first in (10, 20, 30):
        c.index.store(0, _prefix(first))
    tr = _tracker({10: 3, 20: 2, 30: 1}, max_actions=1)
    assert _plan(tr, c) == [(13, 0, 1)]  # only the hottest
    tr = _tracker({10: 3, 20: 2, 30: 1}, max_actions=2)
    assert _plan(tr, c) == [(13, 0, 1), (23, 0, 2)]


def test_plan_one_new_copy_per_target_per_round() -> None:
    # 0 is a hot spot (30 > 1.5 * 40/3 + 0.5); 1 (idle) and 2 (10 <= 13.3) can take copies
    c = _loaded(cluster(3), {0: 30.0, 2: 10.0})
    c.index.store(0, _prefix(10))
    c.index.store(0, _prefix(20))
    assert _plan(_tracker({10: 2, 20: 1}), c) == [(13, 0, 1), (23, 0, 2)]


def test_plan_skips_prefixes_with_enough_replicas_and_goes_on() -> None:
    # prefix 10 (hottest) has max_replicas holders, both hot spots; prefix 20 has one
    c = _loaded(cluster(5), {0: 20.0, 1: 20.0, 2: 20.0})  # average 12, hot past 18.5
    c.index.store(0, _prefix(10))
    c.index.store(1, _prefix(10))
    c.index.store(2, _prefix(20))
    assert _plan(_tracker({10: 3, 20: 1}, max_replicas=2), c) == [(23, 2, 3)]
    # one more replica allowed: the hottest gets one too
    assert _plan(_tracker({10: 3, 20: 1}, max_replicas=3), c) == [(13, 0, 3), (23, 2, 4)]


def test_plan_copies_from_the_least_loaded_holder() -> None:
    # holders 0 (30 s) and 1 (25 s): average 13.75, hot past 21.125, both are hot spots
    c = _loaded(cluster(4), {0: 30.0, 1: 25.0})
    c.index.store(0, _prefix(10))
    c.index.store(1, _prefix(10))
    assert _plan(_tracker({10: 1}), c) == [(13, 1, 2)]


def test_plan_no_hot_spot_when_the_least_loaded_holder_is_cool() -> None:
    # holder 1 (5 s) is below 1.5 * 8.75 + 0.5 although holder 0 (30 s) is far above
    c = _loaded(cluster(4), {0: 30.0, 1: 5.0})
    c.index.store(0, _prefix(10))
    c.index.store(1, _prefix(10))
    assert _plan(_tracker({10: 1}), c) == []


def test_plan_goes_on_past_a_prefix_that_is_not_a_hot_spot() -> None:
    c = _loaded(cluster(4), {0: 30.0})  # average 7.5, hot past 11.75
    c.index.store(1, _prefix(10))  # the hottest, on an idle holder
    c.index.store(0, _prefix(20))
    assert _plan(_tracker({10: 3, 20: 1}), c) == [(23, 0, 1)]


def test_plan_prefers_a_target_whose_cache_has_room() -> None:
    cap = 100  # max_fill 0.95: full at 95 blocks
    c = _loaded(cluster(3, capacity_blocks=cap), {0: 30.0, 2: 1.0})
    c.index.store(0, _prefix(10))
    c.index.store(1, list(range(1000, 1095)))  # idle but exactly at the fill limit
    c.index.store(2, list(range(2000, 2010)))  # a little loaded, 10 blocks: has room
    assert _plan(_tracker({10: 1}), c) == [(13, 0, 2)]
    c.index.store(2, list(range(3000, 3085)))  # now 95 blocks too: least loaded wins
    assert _plan(_tracker({10: 1}), c) == [(13, 0, 1)]


# -- assign_replicas -------------------------------------------------------------------


CFG = ReplicationConfig(load_ratio=1.5, load_floor_s=0.5, max_replicas=2, max_actions=4)


def _assigned(out: dict[str, frozenset[str]]) -> dict[str, set[str]]:
    return {k: set(v) for k, v in out.items() if v}


def test_assign_with_two_live_instances() -> None:
    loads = [InstanceLoad("a", 9.0), InstanceLoad("b", 0.0)]  # average 4.5: hot past 7.25
    hot = [HotPrefix("p", 1.0, 8, frozenset({"a"}))]
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"b": {"p"}}
    # with one live instance there is nowhere to copy to, but kept copies stay
    one = assign_replicas(hot, loads[:1], {"a": frozenset({"p", "cold"})}, CFG)
    assert one == {"a": frozenset({"p"})}


def test_assign_when_disabled_only_keeps_hot_assignments() -> None:
    loads = [InstanceLoad("a", 9.0), InstanceLoad("b", 0.0), InstanceLoad("c", 0.0)]
    hot = [HotPrefix("p", 1.0, 8, frozenset({"a"})), HotPrefix("q", 1.0, 8, frozenset({"a"}))]
    current = {"c": frozenset({"q", "cold"}), "gone": frozenset({"p"})}
    out = assign_replicas(hot, loads, current, CFG.model_copy(update={"enabled": False}))
    assert out == {"a": frozenset(), "b": frozenset(), "c": frozenset({"q"})}


def test_assign_caps_new_copies_per_call_hottest_first() -> None:
    loads = [InstanceLoad(n, s) for n, s in (("a", 40.0), ("b", 0.0), ("c", 0.1),
                                              ("d", 0.2), ("e", 0.3))]
    # listed coldest first: the order must come from the rates
    hot = [HotPrefix(name, rate, 8, frozenset({"a"}))
           for name, rate in (("r", 0.1), ("q", 0.2), ("p", 0.3))]
    one = CFG.model_copy(update={"max_actions": 1})
    assert _assigned(assign_replicas(hot, loads, {}, one)) == {"b": {"p"}}
    two = CFG.model_copy(update={"max_actions": 2})
    assert _assigned(assign_replicas(hot, loads, {}, two)) == {"b": {"p"}, "c": {"q"}}
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {
        "b": {"p"}, "c": {"q"}, "d": {"r"}}


def test_assign_min_blocks_is_inclusive_and_short_prefixes_are_skipped() -> None:
    loads = [InstanceLoad("a", 9.0), InstanceLoad("b", 0.0), InstanceLoad("c", 0.1)]
    cfg = CFG.model_copy(update={"min_blocks": 4})
    hot = [HotPrefix("short", 2.0, 3, frozenset({"a"})),
           HotPrefix("p", 1.0, 4, frozenset({"a"}))]
    assert _assigned(assign_replicas(hot, loads, {}, cfg)) == {"b": {"p"}}


def test_assign_counts_holders_and_assignments_against_max_replicas() -> None:
    loads = [InstanceLoad("a", 20.0), InstanceLoad("b", 20.0), InstanceLoad("c", 0.0),
             InstanceLoad("d", 0.0)]  # average 10: hot past 15.5
    hot = [HotPrefix("p", 2.0, 8, frozenset({"a"})),  # a holds, b is assigned: 2 copies
           HotPrefix("q", 1.0, 8, frozenset({"a"}))]
    current = {"b": frozenset({"p"})}
    out = assign_replicas(hot, loads, current, CFG)
    assert _assigned(out) == {"b": {"p"}, "c": {"q"}}
    # with room for a third copy p gets one as well
    three = CFG.model_copy(update={"max_replicas": 3})
    assert _assigned(assign_replicas(hot, loads, current, three)) == {
        "b": {"p"}, "c": {"p"}, "d": {"q"}}


def test_assign_skips_a_prefix_without_live_copies() -> None:
    loads = [InstanceLoad("a", 20.0), InstanceLoad("b", 0.0), InstanceLoad("c", 0.0)]
    hot = [HotPrefix("orphan", 2.0, 8, frozenset({"gone"})),
           HotPrefix("p", 1.0, 8, frozenset({"a"}))]
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"b": {"p"}}


def test_assign_goes_on_past_a_prefix_that_is_not_a_hot_spot() -> None:
    loads = [InstanceLoad("a", 20.0), InstanceLoad("b", 0.0), InstanceLoad("c", 0.0)]
    hot = [HotPrefix("cool", 2.0, 8, frozenset({"b"})),
           HotPrefix("p", 1.0, 8, frozenset({"a"}))]
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"b": {"p"}}


def test_assign_one_new_copy_per_instance_per_call() -> None:
    loads = [InstanceLoad("a", 30.0), InstanceLoad("b", 0.0), InstanceLoad("c", 10.0)]
    hot = [HotPrefix("p", 2.0, 8, frozenset({"a"})), HotPrefix("q", 1.0, 8, frozenset({"a"}))]
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"b": {"p"}, "c": {"q"}}


def test_assign_prefers_an_instance_whose_cache_has_room() -> None:
    hot = [HotPrefix("p", 1.0, 8, frozenset({"a"}))]
    loads = [InstanceLoad("a", 30.0), InstanceLoad("b", 0.0, fill=0.95),
             InstanceLoad("c", 0.1, fill=0.5)]
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"c": {"p"}}
    loads[2] = InstanceLoad("c", 0.1, fill=0.96)
    assert _assigned(assign_replicas(hot, loads, {}, CFG)) == {"b": {"p"}}


def test_hot_prefixes_match_the_decay_law_at_every_time() -> None:
    """``hot`` skips prefixes by the time their rate falls below the threshold; over
    random accesses and read times it returns exactly the prefixes whose decayed rate
    is at or above it, with that rate."""
    cfg = ReplicationConfig(half_life_s=10.0, min_rate_per_s=0.05)
    tr = HotPrefixTracker(cfg)
    rng = random.Random(3)
    decay = math.log(2.0) / cfg.half_life_s
    truth: dict[int, tuple[float, float]] = {}  # prefix -> (rate, at)
    now = 0.0
    for _ in range(400):
        now += rng.expovariate(2.0)
        p = rng.randrange(12)
        keys = (1000 + p, 2000 + p, 3000 + p)
        tr.record(keys, now)
        rate, at = truth.get(keys[-1], (0.0, now))
        truth[keys[-1]] = (rate * math.exp(-decay * (now - at)) + decay, now)
        if rng.random() < 0.3:
            later = now + rng.uniform(0.0, 80.0)
            want = {k: r * math.exp(-decay * (later - a)) for k, (r, a) in truth.items()}
            want = {k: r for k, r in want.items() if r >= cfg.min_rate_per_s}
            got = {p: r for p, r, _ in tr.hot(later)}
            assert got.keys() == want.keys()
            for k, r in want.items():
                assert got[k] == pytest.approx(r)


def test_an_access_recorded_out_of_time_order_does_not_hide_a_hot_prefix() -> None:
    """``hot`` stops at the first prefix accessed too long ago to be hot, which is right
    only while the last-access order is the time order; once an access arrives late
    (a request decided after a later one), every prefix is examined."""
    cfg = ReplicationConfig(half_life_s=10.0, min_rate_per_s=0.05)
    tr = HotPrefixTracker(cfg)
    for _ in range(5):
        tr.record((1, 2), 100.0)  # hot for a while: five accesses at t = 100
    tr.record((3, 4), 0.0)  # recorded late, but it is the most recent in LRU order
    hot = {p for p, _r, _k in tr.hot(120.0)}
    assert hot == {2}
