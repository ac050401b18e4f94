"""Topology: places, levels, transfer times, and the decisions that read them."""

from __future__ import annotations

import numpy as np
import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import ChunkPricer, CPPConfig, cpp_makespan, first_stage_s, plan_cpp
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import ClusterState
from mooncake_conductor.topology import (
    LinkLevel,
    Topology,
    TopologyConfig,
    assign_places,
    domain_orders,
)
from pydantic import ValidationError

from .helpers import BT, cluster, queue, request

COST = CostModel()
RACK = LinkLevel(name="rack", gbits_per_s=200, latency_s=10e-6)
ZONE = LinkLevel(name="zone", gbits_per_s=50, latency_s=1e-3)
TWO = TopologyConfig(levels=[RACK, ZONE])
ONE = TopologyConfig(levels=[ZONE])


# -- the model --------------------------------------------------------------------------------
def test_place_ids_are_interned_and_unknown_is_zero() -> None:
    topo = Topology(TWO)
    assert topo.place_id(()) == 0
    assert topo.place_id(("", "")) == 0
    a = topo.place_id(("r0", "z0"))
    b = topo.place_id(("r1", "z0"))
    assert a != b and 0 not in (a, b)
    assert topo.place_id(["r0", "z0"]) == a  # any sequence, same id
    assert topo.labels(b) == ("r1", "z0")
    with pytest.raises(ValueError, match="one label per level"):
        topo.place_id(("r0",))
    assert Topology(TopologyConfig()).place_id(("r0", "z0")) == 0  # flat: nothing to tell


def test_level_is_the_coarsest_differing_label() -> None:
    topo = Topology(TWO)
    r0z0, r1z0, r2z1 = (topo.place_id(p) for p in (("r0", "z0"), ("r1", "z0"), ("r2", "z1")))
    assert topo.level(r0z0, r0z0) == -1
    assert topo.level(r0z0, 0) == -1 and topo.level(0, r2z1) == -1
    assert topo.level(r0z0, r1z0) == 0
    assert topo.level(r0z0, r2z1) == 1
    assert topo.level(r1z0, r2z1) == 1
    assert topo.group_level([r0z0, r0z0]) == -1
    assert topo.group_level([r0z0, r1z0]) == 0
    assert topo.group_level([r0z0, r1z0, r2z1]) == 1


def test_transfer_time_per_level() -> None:
    topo = Topology(TWO)
    a, b, c = (topo.place_id(p) for p in (("r0", "z0"), ("r1", "z0"), ("r2", "z1")))
    tokens = 8192
    nbytes = tokens * COST.kv_bytes_per_token
    eff = COST.config.efficiency.transfer_efficiency
    assert topo.transfer_time(COST, tokens, a, a) == COST.transfer_time(tokens)
    assert topo.transfer_time(COST, tokens, a, 0) == COST.transfer_time(tokens)
    rack = topo.transfer_time(COST, tokens, a, b)
    assert rack == pytest.approx(10e-6 + nbytes / (200e9 / 8 * eff))
    zone = topo.transfer_time(COST, tokens, a, c)
    assert zone == pytest.approx(1e-3 + nbytes / (50e9 / 8 * eff))
    assert COST.transfer_time(tokens) < rack < zone
    assert topo.transfer_time(COST, 0, a, c) == 0.0
    # a level faster than the node's own link is capped at it (plus its latency)
    fast = Topology(TopologyConfig(levels=[LinkLevel(name="x", gbits_per_s=10_000,
                                                     latency_s=0.5)]))
    p, q = fast.place_id(("x0",)), fast.place_id(("x1",))
    assert fast.transfer_time(COST, tokens, p, q) == pytest.approx(
        0.5 + COST.transfer_time(tokens))


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError):
        LinkLevel(name="rack", gbits_per_s=0)
    with pytest.raises(ValidationError):
        LinkLevel(name="rack", gbits_per_s=1, latency_s=-1)
    with pytest.raises(ValidationError):
        TopologyConfig(levels=[], bogus=1)  # type: ignore[call-arg]
    assert ConductorConfig(topology={"levels": [{"name": "zone", "gbits_per_s": 50}]}) \
        .topology.levels[0].latency_s == 0.0


def test_stream_join_flat_is_the_last_layer_share() -> None:
    flat = Topology(TopologyConfig())
    layers = COST.config.model.layers
    assert flat.stream_join(COST, 8192, 0, 0, 1.0, 3.0) == \
        3.0 + COST.transfer_time(8192) / layers
    topo = Topology(ONE)
    a, b = topo.place_id(("z0",)), topo.place_id(("z1",))
    eff = COST.config.efficiency.transfer_efficiency
    total = 100_000 * COST.kv_bytes_per_token / (50e9 / 8 * eff)
    # a slow link holds the stream back past the prefill's end
    assert topo.stream_join(COST, 100_000, a, b, 0.0, 2.0) == pytest.approx(total + 1e-3)
    # a fast one overlaps: the last layer's share after the end
    assert topo.stream_join(COST, 100_000, a, b, 0.0, 60.0) == pytest.approx(
        60.0 + total / layers + 1e-3)


def test_assign_places_blocked_and_round_robin() -> None:
    blocked = assign_places(8, [4, 2], ["rack", "zone"])
    assert blocked[0] == ("rack-0", "zone-0") and blocked[1] == ("rack-0", "zone-0")
    assert blocked[2] == ("rack-1", "zone-0") and blocked[7] == ("rack-3", "zone-1")
    rr = assign_places(8, [4, 2], ["rack", "zone"], blocked=False)
    assert [r[0] for r in rr[:5]] == ["rack-0", "rack-1", "rack-2", "rack-3", "rack-0"]
    assert rr[3] == ("rack-3", "zone-1")
    with pytest.raises(ValueError):
        assign_places(4, [2, 4], ["rack", "zone"])


def test_cpp_link_changes_the_hand_off_consistently() -> None:
    n, cached = 65_536, 0
    slow = (50e9 / 8 * 0.9, 1e-3)
    for chunk in (1024, 4096):
        flat = plan_cpp(COST, n, cached, 4, chunk)
        assert plan_cpp(COST, n, cached, 4, chunk, None) == flat
        far = plan_cpp(COST, n, cached, 4, chunk, slow)
        assert far.makespan_s > flat.makespan_s
        assert cpp_makespan(COST, n, cached, 4, chunk, slow) == pytest.approx(far.makespan_s)
        assert first_stage_s(COST, n, cached, 4, chunk, slow) == pytest.approx(far.stage_s[0])
    size, span = ChunkPricer(COST, n, cached, CPPConfig()).choose(4, slow)
    assert span == pytest.approx(plan_cpp(COST, n, cached, 4, size, slow).makespan_s)
    # a group of one hands nothing off
    assert plan_cpp(COST, n, 0, 1, 4096, slow) == plan_cpp(COST, n, 0, 1, 4096)


# -- decisions --------------------------------------------------------------------------------
def _zoned(conductor: Conductor, zones: list[str], decode_zones: list[str],
           blocks: int = 0) -> ClusterState:
    c = cluster(len(zones), len(decode_zones))
    topo = conductor.topology
    for st, z in zip(c.prefill, zones, strict=True):
        st.place = topo.place_id((z,))
    for st, z in zip(c.decode, decode_zones, strict=True):
        st.place = topo.place_id((z,))
    return c


def _conductor(aware: bool, seed: int = 0, **params: object) -> Conductor:
    return Conductor(ConductorConfig(
        policy="conductor", seed=seed, params=dict(params),
        topology=TopologyConfig(levels=[ZONE], aware=aware)))


@pytest.mark.parametrize("explain", [False, True])  # the compiled ranking and the Python one
def test_fetch_comes_from_the_nearest_holder(explain: bool) -> None:
    keys = list(range(1, 33))  # 16k tokens
    for aware in (True, False):
        cond = _conductor(aware, explain=explain)
        c = _zoned(cond, ["a", "a", "b", "b"], ["b"])
        for holder in (0, 2):  # both hold the prefix, both are busy
            c.index.store(holder, keys[:24])
            queue(c.prefill[holder], 200.0, rid=100 + holder)
        queue(c.prefill[1], 200.0, rid=200)  # only instance 3 (zone b) is free
        pl = cond.schedule(request(keys), c, 0.0).placement
        assert pl.prefill == 3 and pl.fetch_blocks == 24 - 0
        tokens = 24 * BT
        if aware:
            assert pl.source == 2  # same zone, not the lowest id
            assert pl.transfer_s == pytest.approx(COST.transfer_time(tokens))
        else:
            assert pl.source == 0  # the index's answer: the lowest id
            assert pl.transfer_s == pytest.approx(COST.transfer_time(tokens))  # flat view


def test_aware_ranking_prefers_the_holders_domain() -> None:
    keys = list(range(1, 33))
    picks: dict[bool, set[int]] = {True: set(), False: set()}
    for aware in (True, False):
        for seed in range(12):
            cond = _conductor(aware, seed)
            c = _zoned(cond, ["a", "a", "b", "b"], ["a", "b"])
            c.index.store(0, keys[:30])
            queue(c.prefill[0], 200.0)  # the holder is busy; 1 (its zone) and 2, 3 are idle
            pl = cond.schedule(request(keys), c, 0.0).placement
            picks[aware].add(pl.prefill if pl.prefill is not None else -1)
    assert picks[True] == {1}
    assert picks[False] == {1, 2, 3}  # flat: every idle instance ties


def test_decode_prefers_the_prefill_instances_domain() -> None:
    chosen: dict[bool, set[int]] = {True: set(), False: set()}
    for aware in (True, False):
        for seed in range(12):
            cond = _conductor(aware, seed)
            c = _zoned(cond, ["a"], ["b", "a", "b", "a"])
            d = cond.schedule(request(list(range(1, 9))), c, 0.0).decode
            assert d.decode is not None
            chosen[aware].add(d.decode)
    assert chosen[True] <= {1, 3} and chosen[True]
    assert chosen[False] & {0, 2}


def test_decode_nearness_never_takes_a_clearly_slower_instance() -> None:
    cond = _conductor(True)
    c = _zoned(cond, ["a"], ["a", "b"])
    c.decode[0].batch = 60  # the near one is loaded far past the near-equal band
    c.decode[0].context_tokens = 900_000
    d = cond.schedule(request(list(range(1, 9))), c, 0.0).decode
    assert d.decode == 1


def test_cpp_groups_form_inside_one_domain() -> None:
    n_blocks = 200  # 102k tokens: a long prompt, CPP groups of idle instances
    mixed = 0
    for aware in (True, False):
        for seed in range(6):
            cond = _conductor(aware, seed)
            c = _zoned(cond, ["a", "b"] * 4, ["a", "b"])
            pl = cond.schedule(request(list(range(1, n_blocks + 1))), c, 0.0).placement
            assert len(pl.cpp_group) > 1
            places = {c.prefill[i].place for i in pl.cpp_group}
            if aware:
                assert len(places) == 1, pl.cpp_group
            else:
                mixed += len(places) > 1
    assert mixed  # the flat view mixes domains: the test can tell the two apart


def test_domain_orders_seed_a_group_per_place() -> None:
    topo = Topology(ONE)
    c = cluster(6, 1)
    for st, z in zip(c.prefill, "abcabc", strict=True):
        st.place = topo.place_id((z,))
    orders = domain_orders(topo, c.prefill)
    assert len(orders) == 4 and orders[0] is c.prefill
    assert [p.iid for p in orders[1][:2]] == [0, 3]
    assert [p.iid for p in orders[3][:2]] == [2, 5]
    assert len(domain_orders(topo, cluster(3, 1).prefill)) == 1  # one (unknown) place


def test_one_domain_decides_as_the_flat_fleet() -> None:
    """Levels configured, every instance in one place: nothing to prefer, so the choices
    (and the random draws behind them) are those of a fleet without topology."""
    def run(topology: TopologyConfig, place: bool) -> list[tuple[object, ...]]:
        cond = Conductor(ConductorConfig(policy="conductor", seed=3, topology=topology))
        c = cluster(8, 4)
        if place:
            for st in [*c.prefill, *c.decode]:
                st.place = cond.topology.place_id(("z0",))
        rng = np.random.default_rng(5)
        out = []
        for rid in range(40):
            blocks = int(rng.integers(2, 160))
            base = int(rng.integers(0, 4)) * 1000
            keys = [base + k for k in range(1, blocks + 1)]
            d = cond.schedule(request(keys, rid=rid, arrival=rid * 0.3), c, rid * 0.3)
            pl = d.placement
            if not d.rejected:
                assert pl.prefill is not None
                c.index.store(pl.prefill, keys)
                c.prefill[pl.prefill].busy_until = rid * 0.3 + pl.ttft_s
            out.append((pl.prefill, tuple(pl.cpp_group), pl.source, pl.fetch_blocks,
                        pl.ttft_s, d.decode.decode, d.reject_reason))
        return out

    flat = run(TopologyConfig(), False)
    assert run(ONE, True) == flat
    assert run(TopologyConfig(levels=[ZONE], aware=False), True) == flat
    assert any(len(row[1]) > 1 for row in flat) and any(row[3] for row in flat)
