"""Work stealing (:mod:`mooncake_conductor.stealing`): the rule on hand-made pools, then
who steals in :class:`Conductor`."""

from typing import Any

import pytest
from mooncake_conductor.cost import CostModel, CostModelConfig
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import ClusterState, RequestInfo
from mooncake_conductor.stealing import StealingConfig, WorkStealing, _common_blocks
from pydantic import ValidationError

from .helpers import BT, COST, cluster, request

NOW = 100.0


def _pool(*requests: tuple[int, RequestInfo, float], busy_s: float = 10.0) -> tuple[
        ClusterState, dict[int, RequestInfo]]:
    """Instance 0 idle; every ``(instance, request, work s)`` queued in that order on an
    instance busy for ``busy_s`` more seconds."""
    c = cluster(3)
    known: dict[int, RequestInfo] = {}
    for iid, req, work in requests:
        inst = c.prefill[iid]
        inst.busy_until = NOW + busy_s
        inst.enqueue(req.rid, req.arrival, work, len(req.keys), req.input_tokens)
        c.index.add_pending(iid, req.keys)
        known[req.rid] = req
    return c, known


def _pick(c: ClusterState, known: dict[int, RequestInfo], movable: Any = None,
          cost: CostModel = COST, **cfg: Any) -> Any:
    rule = WorkStealing(StealingConfig(**cfg), cost)
    return rule.pick(c.prefill[0], c, known.__getitem__, NOW,
                     movable or (lambda rid: True))


def test_an_idle_instance_takes_a_prompt_waiting_behind_a_long_run() -> None:
    req = request(list(range(8)), rid=1)  # 4096 tokens, nothing cached anywhere
    work = COST.prefill_time(req.input_tokens, 0)
    c, known = _pool((1, req, work))
    steal = _pick(c, known)
    assert steal is not None
    assert (steal.rid, steal.victim, steal.placement.prefill) == (1, 1, 0)
    assert steal.placement.prefill_s == pytest.approx(work)
    assert steal.gain_s == pytest.approx(10.0)  # it no longer waits for the running 10 s


def test_no_steal_when_the_saving_is_under_the_thresholds() -> None:
    req = request(list(range(8)), rid=1)
    work = COST.prefill_time(req.input_tokens, 0)
    c, known = _pool((1, req, work), busy_s=0.01)  # starts there in 10 ms
    assert _pick(c, known) is None
    assert _pick(c, known, min_gain_s=0.0, min_gain_share=0.0) is not None
    c, known = _pool((1, req, work), busy_s=1.0)
    assert _pick(c, known, min_gain_s=2.0) is None  # saves 1 s, 2 s asked
    assert _pick(c, known, min_gain_s=0.0, min_gain_share=0.9) is None  # 1 s of ~1.4 s


def test_a_prompt_cached_where_it_waits_moves_only_when_the_wait_exceeds_the_fetch() -> None:
    keys = list(range(64))  # 32k tokens
    req = request(keys, rid=1)
    work = COST.prefill_time(req.input_tokens, 62 * BT)
    fetch = COST.transfer_time(62 * BT)  # the prefix instance 1 holds, over the network
    for busy, moves in ((0.5 * fetch, False), (fetch + 1.0, True)):
        c, known = _pool((1, req, work), busy_s=busy)
        c.index.store(1, keys[:62])
        steal = _pick(c, known)
        assert (steal is not None) is moves
        if moves:  # it is fetched from the instance it waited on, not recomputed
            pl = steal.placement
            assert (pl.source, pl.fetch_blocks, pl.local_blocks) == (1, 62, 0)
            assert steal.gain_s == pytest.approx(busy - fetch)


def test_a_prompt_a_later_one_on_its_queue_will_read_stays() -> None:
    first = request(list(range(8)), rid=1)
    later = request([*range(8), 50, 51], rid=2)  # placed to reuse what 1 writes
    w1 = COST.prefill_time(first.input_tokens, 0)
    w2 = COST.prefill_time(later.input_tokens, first.input_tokens)
    c, known = _pool((1, first, w1), (1, later, w2))
    # the first stays for the later one; the later one would recompute here the 4k tokens
    # it reads there (far more than max_extra_share of its work)
    assert _pick(c, known) is None
    steal = _pick(c, known, max_extra_share=100.0)
    assert steal is not None and steal.rid == 2  # allowed to recompute, only it may go


def test_the_prompt_with_the_most_queue_behind_it_goes_first() -> None:
    a = request([1, 2, 3, 4], rid=1)
    b = request([11, 12, 13, 14], rid=2)
    c_ = request([21, 22, 23, 24], rid=3)
    w = COST.prefill_time(a.input_tokens, 0)
    c, known = _pool((1, a, w), (1, b, w), (2, c_, w))
    steal = _pick(c, known)
    # a and c each save the same 10 s; a also moves b forward by its work
    assert steal is not None and (steal.rid, steal.victim) == (1, 1)


def test_unmovable_prompts_and_idle_or_down_victims_are_left_alone() -> None:
    req = request(list(range(8)), rid=1)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)))
    assert _pick(c, known, movable=lambda rid: False) is None
    c.prefill[1].up = False
    assert _pick(c, known) is None


def test_a_fetch_is_priced_when_a_holder_has_the_prefix() -> None:
    keys = list(range(64))
    req = request(keys, rid=1)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)), busy_s=30.0)
    c.index.store(2, keys[:60])  # instance 2 (busy too) holds most of it
    steal = _pick(c, known)
    assert steal is not None
    pl = steal.placement
    assert (pl.prefill, pl.source, pl.local_blocks, pl.fetch_blocks) == (0, 2, 0, 60)
    assert pl.transfer_s == pytest.approx(COST.transfer_time(60 * BT))
    assert pl.prefill_s == pytest.approx(COST.prefill_time(req.input_tokens, 60 * BT))


def test_a_move_may_not_recompute_much_more_than_the_work_it_leaves() -> None:
    req = request(list(range(8)), rid=1)
    work = COST.prefill_time(req.input_tokens, 0)
    # queued with a predicted work 20% under a cold prefill (it expected some reuse)
    c, known = _pool((1, req, work / 1.2))
    assert _pick(c, known) is None
    assert _pick(c, known, max_extra_share=0.25) is not None


def test_common_blocks_counts_the_shared_leading_blocks() -> None:
    assert _common_blocks([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _common_blocks([1, 2], [1, 2, 3]) == 2
    assert _common_blocks([5], [6]) == 0
    assert _common_blocks([], [1]) == 0


@pytest.mark.parametrize(("shared", "moves"), [(4, True), (6, False)])
def test_a_later_prompt_sharing_only_what_is_stored_does_not_hold_a_prompt_back(
        shared: int, moves: bool) -> None:
    """The queue's instance stores the first 4 blocks (a system prompt): a later prompt
    sharing just those reads nothing the first one writes; one sharing 6 does."""
    first = request(list(range(8)), rid=1)
    later = request([*range(shared), *range(100, 100 + 8 - shared)], rid=2)
    w1 = COST.prefill_time(first.input_tokens, 4 * BT)
    c, known = _pool((1, first, w1), (1, later, 10.0))
    c.index.store(1, first.keys[:4])
    steal = _pick(c, known, movable=lambda rid: rid == 1)
    assert (steal is not None) is moves


def test_unmovable_or_expensive_prompts_are_skipped_not_the_rest_of_the_queue() -> None:
    a = request([1, 2, 3, 4], rid=1)
    b = request([11, 12, 13, 14], rid=2)
    w = COST.prefill_time(a.input_tokens, 0)
    c, known = _pool((1, a, w), (1, b, w))
    steal = _pick(c, known, movable=lambda rid: rid != 1)
    assert steal is not None and steal.rid == 2
    c, known = _pool((1, a, w / 2), (1, b, w))  # a expected reuse it would lose here
    steal = _pick(c, known)
    assert steal is not None and steal.rid == 2


def test_a_moved_prompt_reuses_the_idle_instance_s_own_prefix_and_keeps_its_priority() -> None:
    keys = list(range(32))
    req = request(keys, rid=1, arrival=7.0)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)))
    c.index.store(0, keys[:20])  # the idle instance holds most of it
    steal = _pick(c, known)
    assert steal is not None
    pl = steal.placement
    assert (pl.local_blocks, pl.fetch_blocks, pl.source, pl.priority) == (20, 0, None, 7.0)
    assert pl.prefill_s == pytest.approx(COST.prefill_time(req.input_tokens, 20 * BT))


def test_a_fetch_tops_up_the_idle_instance_s_prefix_from_the_longest_holder() -> None:
    keys = list(range(64))
    req = request(keys, rid=1, arrival=3.0)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)), busy_s=30.0)
    c.index.store(0, keys[:10])
    c.index.store(2, keys[:50])
    steal = _pick(c, known)
    assert steal is not None
    pl = steal.placement
    assert (pl.local_blocks, pl.fetch_blocks, pl.source) == (10, 40, 2)
    assert pl.migrate and pl.priority == 3.0
    assert pl.transfer_s == pytest.approx(COST.transfer_time(40 * BT))


def test_the_store_pool_is_a_holder_to_fetch_from() -> None:
    keys = list(range(64))
    req = request(keys, rid=1)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)), busy_s=30.0)
    c.store_id = 3
    c.index.add_instance(3)
    c.index.store(3, keys[:60])
    c.index.store(0, keys[:10])  # the idle instance's own part still counts
    steal = _pick(c, known)
    assert steal is not None
    pl = steal.placement
    assert (pl.source, pl.local_blocks, pl.fetch_blocks) == (3, 10, 50)


def test_recompute_wins_over_a_fetch_on_a_slow_network() -> None:
    slow = CostModel(CostModelConfig(hardware={"nic_gbits_per_s": 0.01}))
    keys = list(range(64))
    req = request(keys, rid=1)
    c, known = _pool((1, req, slow.prefill_time(req.input_tokens, 0)), busy_s=30.0)
    c.index.store(2, keys[:60])
    steal = _pick(c, known, cost=slow)
    assert steal is not None
    pl = steal.placement
    assert (pl.fetch_blocks, pl.source, pl.transfer_s) == (0, None, 0.0)
    assert pl.prefill_s == pytest.approx(slow.prefill_time(req.input_tokens, 0))


def test_fetch_only_when_transfer_plus_prefill_beats_recompute() -> None:
    """A network where moving a 15k-token prefix takes as long as computing the whole
    16k-token prompt: fetch plus the rest is slower than recompute, so it recomputes."""
    keys = list(range(32))
    n = len(keys) * BT
    fast_transfer = COST.transfer_time(30 * BT)
    gbits = 800.0 * fast_transfer / COST.prefill_time(n, 0)  # transfer == recompute
    net = CostModel(CostModelConfig(hardware={"nic_gbits_per_s": gbits}))
    req = request(keys, rid=1)
    c, known = _pool((1, req, net.prefill_time(n, 0)), busy_s=30.0)
    c.index.store(2, keys[:30])
    steal = _pick(c, known, cost=net)
    assert steal is not None and steal.placement.fetch_blocks == 0


def test_a_prompt_saving_too_little_is_skipped_and_the_one_behind_it_taken() -> None:
    a = request([1, 2, 3, 4], rid=1)
    b = request([11, 12, 13, 14], rid=2)
    w = COST.prefill_time(a.input_tokens, 0)
    c, known = _pool((1, a, w), (1, b, w), busy_s=0.01)  # a would gain 10 ms only
    steal = _pick(c, known)
    assert steal is not None and steal.rid == 2


def test_the_work_behind_a_prompt_weighs_by_its_seconds() -> None:
    """a: 1 s less saving than c, but a 2 s prompt waits behind it."""
    big = 32  # blocks: 16k tokens, about 2 s
    a = request(list(range(big)), rid=1)
    behind = request(list(range(100, 100 + big)), rid=2)
    cc = request(list(range(200, 200 + big)), rid=3)
    w = COST.prefill_time(a.input_tokens, 0)
    assert w > 1.5
    c, known = _pool((1, a, w), (1, behind, w), busy_s=10.0)
    c.prefill[2].busy_until = NOW + 11.0
    c.prefill[2].enqueue(3, 0.0, w, big, cc.input_tokens)
    known[3] = cc
    steal = _pick(c, known, movable=lambda rid: rid != 2)
    assert steal is not None and steal.rid == 1


@pytest.mark.parametrize("cfg", [{"min_gain_s": -1.0}, {"min_gain_share": 1.5},
                                 {"max_extra_share": -0.1},
                                 {"unknown": 1}])
def test_bad_settings_are_refused(cfg: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        StealingConfig(**cfg)


# -- in the Conductor -----------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "cfg", "steals"), [
    ("conductor", {}, True),
    ("mooncake-paper", {}, False),
    ("conductor", {"stealing": {"enabled": False}}, False),
    ("mooncake-paper", {"stealing": {"enabled": True}}, True),
    ("conductor", {"routing_only": True}, False),
])
def test_who_steals(policy: str, cfg: dict[str, Any], steals: bool) -> None:
    cond = Conductor(ConductorConfig(policy=policy, **cfg))
    req = request(list(range(8)), rid=1)
    c, known = _pool((1, req, COST.prefill_time(req.input_tokens, 0)))
    got = cond.steal(c.prefill[0], c, known.__getitem__, NOW, lambda rid: True)
    assert (cond.stealing is not None) is steals
    assert (got is not None) is steals


def test_take_moves_the_queue_entry_and_the_pending_blocks_keeping_the_priority() -> None:
    cond = Conductor(ConductorConfig(policy="conductor"))
    req = request(list(range(8)), rid=1)
    work = COST.prefill_time(req.input_tokens, 0)
    c, known = _pool((1, req, work))
    steal = cond.steal(c.prefill[0], c, known.__getitem__, NOW, lambda rid: True)
    assert steal is not None and steal.victim == 1
    old = type(steal.placement)(prefill=1, prefill_s=work, priority=req.arrival)
    cond.take(steal, req, old, c)
    assert c.prefill[1].queue == [] and c.prefill[1].queued_work_s == 0.0
    (item,) = c.prefill[0].queue
    assert (item.rid, item.priority, item.blocks, item.tokens) == (
        1, req.arrival, len(req.keys), req.input_tokens)
    assert item.work_s == steal.placement.prefill_s + steal.placement.transfer_s
    assert c.index.match(0, req.keys, include_pending=True) == len(req.keys)
    assert c.index.match(1, req.keys, include_pending=True) == 0


def test_a_move_moves_the_policy_s_own_in_flight_books() -> None:
    """dynamo-kv counts its in-flight blocks per worker: after a move they are counted
    where the prompt went, so the next prompt goes where it left."""
    cond = Conductor(ConductorConfig(policy="dynamo-kv"))
    c = cluster(2)
    first = request(list(range(16)), rid=1)
    old = cond.schedule(first, c, 0.0).placement
    assert old.prefill is not None
    other = 1 - old.prefill
    new = type(old)(prefill=other, priority=old.priority)
    cond.moved(first, old, new, c)
    nxt = cond.schedule(request(list(range(100, 116)), rid=2), c, 0.0).placement
    assert nxt.prefill == old.prefill


# -- with a topology: the moved prompt's fetch comes from the nearest holder ----------------
def _zones(c: ClusterState, zones: tuple[str, ...], aware: bool = True) -> Any:
    from mooncake_conductor.topology import LinkLevel, Topology, TopologyConfig

    topo = Topology(TopologyConfig(levels=[LinkLevel(name="zone", gbits_per_s=50.0,
                                                     latency_s=0.001)], aware=aware))
    for inst, zone in zip(c.prefill, zones, strict=True):
        inst.place = topo.place_id((zone,))
    return topo


def _pick_in(c: ClusterState, known: dict[int, RequestInfo], topo: Any) -> Any:
    rule = WorkStealing(StealingConfig(), COST, topology=topo)
    return rule.pick(c.prefill[0], c, known.__getitem__, NOW, lambda rid: True)


def test_a_moved_prompt_fetches_from_the_holder_in_its_own_zone() -> None:
    keys = list(range(64))
    req = request(keys, rid=1)
    work = COST.prefill_time(req.input_tokens, 62 * BT)
    c, known = _pool((1, req, work), busy_s=30.0)
    c.index.store(1, keys[:62])  # where it waits, across the zone
    c.index.store(2, keys[:62])  # and beside the idle instance
    topo = _zones(c, ("a", "b", "a"))
    steal = _pick_in(c, known, topo)
    assert steal is not None
    pl = steal.placement
    assert (pl.prefill, pl.source, pl.fetch_blocks) == (0, 2, 62)
    assert pl.transfer_s == pytest.approx(COST.transfer_time(62 * BT))  # one zone: the NIC
    # blind to the topology, it fetches from the instance it waited on, across the zone
    blind = _pick_in(c, known, _zones(c, ("a", "b", "a"), aware=False))
    assert blind is not None and blind.placement.source == 1


def test_a_fetch_across_zones_is_charged_the_zone_link() -> None:
    keys = list(range(64))
    req = request(keys, rid=1)
    work = COST.prefill_time(req.input_tokens, 62 * BT)
    near, far = COST.transfer_time(62 * BT), 0.0
    c, known = _pool((1, req, work), busy_s=60.0)
    c.index.store(1, keys[:62])
    topo = _zones(c, ("a", "b", "a"))
    far = topo.transfer_time(COST, 62 * BT, c.prefill[1].place, c.prefill[0].place)
    assert far > near + 0.001
    steal = _pick_in(c, known, topo)
    assert steal is not None and steal.placement.source == 1
    assert steal.placement.transfer_s == pytest.approx(far)
    assert steal.gain_s == pytest.approx(60.0 - far)
    # a wait between the two fetch times: worth moving on a flat fleet, not across zones
    c, known = _pool((1, req, work), busy_s=(near + far) / 2)
    c.index.store(1, keys[:62])
    assert _pick_in(c, known, None) is not None
    assert _pick_in(c, known, _zones(c, ("a", "b", "a"))) is None
