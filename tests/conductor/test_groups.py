"""Instance groups (engine revisions during a rollout): a request's decode instance is of
its prefill instance's group whenever the instances that are up span more than one
group; with one group nothing changes."""

from __future__ import annotations

import random

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import ClusterState, board_of

from .helpers import cluster, queue, request

POLICIES = ("conductor", "least-load", "random", "round-robin", "kvcache-centric")
SELECTORS = ("tbt-slo", "least-load", "random", "round-robin", "aibrix")


def _loaded(seed: int, n: int = 6, decode: int = 5) -> ClusterState:
    """A cluster with some prefixes stored, queues and decode batches (seeded)."""
    r = random.Random(seed)
    c = cluster(n, decode)
    for i in range(n):
        c.index.store(i, list(range(i * 3, i * 3 + r.randint(1, 12))))
        if r.random() < 0.5:
            queue(c.prefill[i], r.random() * 3, rid=1000 + i)
    for d in c.decode:
        d.batch = r.randint(0, 40)
        d.context_tokens = d.batch * r.randint(100, 3000)
    return c


def _requests(seed: int, count: int = 60) -> list[list[int]]:
    r = random.Random(seed)
    return [list(range(r.randrange(0, 18), r.randrange(0, 18) + r.randint(1, 20)))
            for _ in range(count)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("selector", SELECTORS)
def test_one_group_decides_exactly_as_the_ungrouped_calls(policy: str, selector: str) -> None:
    """With every instance in one group (0, or any other id), ``schedule`` makes the
    same decisions, draw for draw, as the policy and selector called directly."""
    cfg = ConductorConfig(policy=policy, decode_selector=selector, seed=3)
    for group in (0, 7):
        ref_cluster, got_cluster = _loaded(1), _loaded(1)
        for st in [*got_cluster.prefill, *got_cluster.decode]:
            st.group = group
        assert not got_cluster.grouped()
        ref, got = Conductor(cfg), Conductor(cfg)
        for t, keys in enumerate(_requests(2)):
            req = request(keys, arrival=float(t), rid=t)
            want_p = ref.policy.choose(req, ref_cluster, float(t))
            want_d = ref.decode_selector.choose(req, ref_cluster.decode)
            d = got.schedule(request(keys, arrival=float(t), rid=t), got_cluster, float(t))
            assert (d.placement.prefill, d.placement.local_blocks, d.placement.fetch_blocks) \
                == (want_p.prefill, want_p.local_blocks, want_p.fetch_blocks)
            assert d.decode.decode == want_d.decode
            if not d.rejected:  # keep both clusters' queues alike
                ref.policy.on_placed(req, want_p, ref_cluster)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("selector", SELECTORS)
def test_decode_never_crosses_groups(policy: str, selector: str) -> None:
    r = random.Random(f"{policy}/{selector}")
    for seed in range(8):
        c = _loaded(seed)
        for st in [*c.prefill, *c.decode]:
            st.group = r.randint(1, 3)
            st.up = r.random() < 0.85
        cond = Conductor(ConductorConfig(policy=policy, decode_selector=selector, seed=seed))
        ups = [st.up for st in [*c.prefill, *c.decode]]
        groups_with_decode = {d.group for d in c.decode if d.up}
        for t, keys in enumerate(_requests(seed, 30)):
            d = cond.schedule(request(keys, arrival=float(t), rid=t), c, float(t))
            if d.placement.prefill is None:
                assert not any(p.up and p.group in groups_with_decode for p in c.prefill) \
                    or d.placement.reject_reason is not None
                continue
            pg = c.prefill[d.placement.prefill].group
            assert pg in groups_with_decode  # a prefill with no decode of its group: never
            assert d.decode.decode is not None
            assert c.decode[d.decode.decode].group == pg
            # the states and their boards' caches are as before the call
            assert [st.up for st in [*c.prefill, *c.decode]] == ups
            for pool in (c.prefill, c.decode):
                board = board_of(pool)
                assert board.live_mask == sum(1 << s.iid for s in pool if s.up)
                assert board.live_groups == {s.group for s in pool if s.up}
                assert board["up"].tolist() == [s.up for s in pool]


def test_the_decode_of_the_prefill_group_wins_over_a_better_one_elsewhere() -> None:
    c = cluster(2, decode=2)
    c.prefill[0].group, c.prefill[1].group = 1, 2
    c.decode[0].group, c.decode[1].group = 1, 2
    queue(c.prefill[0], 5.0)  # prefill 1 (group 2) is the better prefill
    c.decode[1].batch, c.decode[1].context_tokens = 60, 200_000  # decode 0 the better decode
    assert c.grouped()
    d = Conductor(ConductorConfig(policy="conductor")).schedule(request(list(range(8))), c, 0.0)
    assert (d.placement.prefill, d.decode.decode) == (1, 1)


def test_a_group_without_decode_gets_no_prefill() -> None:
    c = cluster(2, decode=1)
    c.prefill[0].group = 1  # the new revision's prefill is up before any of its decode
    c.prefill[1].group = 0
    c.decode[0].group = 0
    queue(c.prefill[1], 10.0)  # prefill 0 would win on load
    d = Conductor(ConductorConfig(policy="least-load")).schedule(request([1, 2, 3]), c, 0.0)
    assert (d.placement.prefill, d.decode.decode) == (1, 0)
    c.prefill[1].up = False  # only the group without decode is left
    d = Conductor(ConductorConfig(policy="least-load")).schedule(request([1, 2, 3]), c, 0.0)
    assert d.rejected and d.reject_reason == "no-prefill-instance"
    assert c.prefill[0].up


def test_a_pipeline_group_stays_within_one_group() -> None:
    """CPP may join several idle instances: never across engine groups."""
    params = {"cpp": {"enabled": True, "min_new_tokens": 1, "reserve_idle_share": 0.0,
                      "max_group": 4}}
    keys = list(range(200))
    c = cluster(4, decode=2)
    d = Conductor(ConductorConfig(policy="conductor", params=params)).schedule(
        request(keys, tokens=200 * 512), c, 0.0)
    assert len(d.placement.cpp_group) > 2  # the pool as one group: a wide pipeline
    c = cluster(4, decode=2)
    for i, st in enumerate(c.prefill):
        st.group = i % 2
    for i, dst in enumerate(c.decode):
        dst.group = i % 2
    d = Conductor(ConductorConfig(policy="conductor", params=params)).schedule(
        request(keys, tokens=200 * 512), c, 0.0)
    members = d.placement.cpp_group or [d.placement.prefill]
    assert len({c.prefill[i].group for i in members}) == 1
    assert d.decode.decode is not None
    assert c.decode[d.decode.decode].group == c.prefill[members[0]].group


def test_live_groups_follow_up_and_group_writes() -> None:
    c = cluster(3, decode=2)
    board = board_of(c.prefill)
    assert board.live_groups == {0} and not c.grouped()
    c.prefill[2].group = 4
    assert board.live_groups == {0, 4} and c.grouped()
    c.prefill[2].up = False
    assert board.live_groups == {0} and not c.grouped()
    for dst in c.decode:
        dst.group = 4
    assert c.grouped()  # prefill up in group 0 only, decode in group 4 only
    for dst in c.decode:
        dst.up = False
    assert not c.grouped()  # no decode up: the usual rejection, not a pairing question


def test_take_down_hides_rows_for_one_call_and_restores_the_caches() -> None:
    c = cluster(5, decode=1)
    for st in c.prefill:
        st.group = st.iid % 2
    board = board_of(c.prefill)
    mask, groups = board.live_mask, board.live_groups
    rows = board.rows_outside(0)
    assert rows.tolist() == [1, 3]
    undo = board.take_down(rows)
    assert [p.up for p in c.prefill] == [True, False, True, False, True]
    assert board["up"].tolist() == [True, False, True, False, True]
    assert board.live_mask == 0b10101 and board.live_groups == {0}
    undo()
    assert all(p.up for p in c.prefill) and board["up"].all()
    assert board.live_mask == mask and board.live_groups == groups == {0, 1}
    c.prefill[0].up = False  # a real write drops the cached rows
    assert board.rows_outside(1).tolist() == [2, 4]


def test_the_fast_path_counts_states_outside_group_0() -> None:
    from mooncake_conductor.state import DecodeState, PrefillState

    base = PrefillState.nonzero_groups
    a, b = PrefillState(0, group=3), DecodeState(0)
    assert PrefillState.nonzero_groups == base + 1
    b.group = 2
    a.group = 5  # nonzero to nonzero: no change
    assert PrefillState.nonzero_groups == base + 2
    a.group = 0
    b.group = 0
    assert PrefillState.nonzero_groups == base
    c = cluster(2, decode=1)
    assert not c.grouped()
    c.prefill[1].group = 1
    assert c.grouped() and PrefillState.nonzero_groups == base + 1
    c.prefill[1].group = 0
    assert not c.grouped() and PrefillState.nonzero_groups == base
