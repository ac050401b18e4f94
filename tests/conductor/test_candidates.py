"""Candidates on large pools: the load orders find exactly the instances a full pass
would, stay current under every kind of write, and the conductor prices a candidate as
the full ranking does."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from mooncake_conductor.candidates import (
    CandidatesConfig,
    DecodeOrder,
    LoadOrder,
    _Orders,
    order_of,
)
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.scoring_kernel import POOL_FIELDS, rank_fifo, rank_rows
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo, board_of

from .helpers import COST


def _wait(p: PrefillState, now: float) -> float:
    return (p.busy_until - now if p.busy_until > now else 0.0) + p.queued_work_s


def _shuffle_loads(pool: list[PrefillState], r: random.Random, now: float) -> None:
    """Random writes of every kind the states make (each one touches the order)."""
    for p in r.sample(pool, max(1, len(pool) // 3)):
        kind = r.random()
        if kind < 0.3:
            p.enqueue(r.randrange(10**6), 0.0, r.random() * 3, 1, 16)
        elif kind < 0.5 and p.queue:
            p.pop()
        elif kind < 0.8:
            p.busy_until = r.choice([0.0, now, now + r.random() * 4, now - r.random()])
        else:
            p.up = r.random() < 0.7


def test_load_order_finds_the_candidates_and_the_pool_aggregates() -> None:
    """The instances that free first, the holders of the longest prefixes and
    the pool's aggregates, against a pass over every instance."""
    r = random.Random(3)
    for trial in range(60):
        n = r.choice([2, 5, 40, 200])
        pool = [PrefillState(iid=i) for i in range(n)]
        board = board_of(pool)
        order: LoadOrder = order_of(board, LoadOrder)
        now = 10.0
        for _ in range(8):
            now += r.random()
            _shuffle_loads(pool, r, now)
            if trial % 3 == 0:  # the heaps see many stale entries, and rebuild
                for p in pool:
                    p.busy_until = p.busy_until
            k = r.choice([1, 2, 8])
            holders = r.choice([1, 3, 8])
            local = np.zeros(max(64, n + 3), dtype=np.int64)  # ids past the pool hold too
            for i in r.sample(range(len(local)), min(len(local), 12)):
                local[i] = r.randint(0, 5)
            live = [p for p in pool if p.up]
            want = sorted((_wait(p, now), p.iid) for p in live)
            least, rows, agg, j1 = order.candidates(now, k, local, holders)
            got = [(_wait(pool[row], now), row) for row in least.tolist()]
            assert [w for w, _ in got] == [w for w, _ in want[:k]]
            # the holders: the longest prefixes, ties to the lower id, then those up
            top = sorted((-int(v), i) for i, v in enumerate(local.tolist()) if v)[:holders]
            held = {i for _, i in top if i < n and pool[i].up}
            assert rows.tolist() == sorted(set(least.tolist()) | held)
            if k < 2:
                continue
            full = np.empty(POOL_FIELDS)
            from mooncake_conductor import scoring_kernel as kernels
            if kernels._stats is None:
                kernels._stats, kernels._rank = kernels._compile_rank()
            up, cols = board["up"], board.columns
            j_full = kernels._stats(now, up, cols["busy_until"], cols["queued_work_s"],
                                    cols["queue_len"], full)
            assert agg.tolist() == full.tolist()
            if live:
                assert _wait(pool[j1], now) == _wait(pool[j_full], now)


def test_take_down_masks_the_pool_and_a_rollouts_decision_takes_the_full_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances taken down for one decision (a rollout's other group) are not told to
    the order (no work per row); while any are, decisions take the full pass, so a
    grouped decision on a large pool comes from the instances up, draw for draw."""
    pool = [PrefillState(iid=i, busy_until=float(i)) for i in range(6)]
    board = board_of(pool)
    order: LoadOrder = order_of(board, LoadOrder)
    undo = board.take_down(np.array([0, 1]))
    assert board.masked == 1
    undo()
    assert board.masked == 0
    nothing = np.zeros(64, dtype=np.int64)
    assert order.candidates(0.0, 3, nothing, 1)[0].tolist() == [0, 1, 2]
    assert order.live == 6
    from mooncake_conductor.policies.conductor import ConductorPolicy
    real_rank, real_cands = ConductorPolicy._rank_candidates, DecodeOrder.candidates
    current: list[ClusterState] = []

    def rank(self: ConductorPolicy, req: RequestInfo, pool: list[PrefillState],
             *args: object) -> object:
        assert not board_of(pool).masked, "prefill candidates with instances down"
        return real_rank(self, req, pool, *args)  # type: ignore[arg-type]

    def cands(self: DecodeOrder, *args: int) -> object:
        assert not board_of(current[-1].decode).masked, "decode candidates, some down"
        return real_cands(self, *args)

    monkeypatch.setattr(ConductorPolicy, "_rank_candidates", rank)
    monkeypatch.setattr(DecodeOrder, "candidates", cands)
    r = random.Random(2)
    for _ in range(20):
        cluster, req, now = _cluster(r, 40)
        current.append(cluster)
        for st in [*cluster.prefill, *cluster.decode]:
            st.group = st.iid % 2  # two revisions: a rollout
        if r.random() < 0.5:  # group 1 has no decode instance up: its prefill is left out
            for d in cluster.decode[1::2]:
                d.up = False
        for cand in (CandidatesConfig(enabled=False),
                     CandidatesConfig(min_pool=2, least_loaded=2, holders=1)):
            cond = Conductor(ConductorConfig(params={"cpp": {"enabled": False}},
                                             candidates=cand))
            d = cond.schedule(req, cluster, now)
            assert d.placement.prefill is not None and d.decode.decode is not None
            # the decode instance is of the prefill instance's group
            assert (cluster.prefill[d.placement.prefill].group
                    == cluster.decode[d.decode.decode].group)
        assert not board_of(cluster.prefill).masked and not board_of(cluster.decode).masked
        for st in [*cluster.prefill, *cluster.decode]:
            st.group = 0
            st.up = True


def test_decode_order_finds_the_fastest_with_room() -> None:
    r = random.Random(7)
    consts = COST.decode_constants()
    for _ in range(60):
        n = r.choice([3, 30, 150])
        pool = [DecodeState(iid=i, capacity_tokens=r.choice([0, 50_000, 60_000]))
                for i in range(n)]
        board = board_of(pool)
        order: DecodeOrder = DecodeOrder(board, consts)
        board.order = order
        for _ in range(5):
            for d in r.sample(pool, max(1, n // 2)):
                d.batch = r.randint(0, 40)
                d.context_tokens = d.batch * r.randint(100, 2000)
                # room independent of the step: the fastest rows often have none
                d.reserved_tokens = r.choice([0, 3000, 45_000])
                d.up = r.random() < 0.9
            for row in r.sample(range(n), max(1, n // 4)):
                order.ahead(row, r.randint(1, 3), r.randint(10, 30_000))
            tokens, need, k = r.randint(1, 8000), r.randint(1, 9000), r.choice([1, 2, 5])

            def step(row: int, tokens: int = tokens, pool: list[DecodeState] = pool,
                     order: DecodeOrder = order) -> float:
                b = pool[row].batch + int(order.ahead_n[row])
                c = pool[row].context_tokens + int(order.ahead_tokens[row])
                return COST.decode_step_time(b + 1, c + tokens)

            def room(row: int, need: int = need, pool: list[DecodeState] = pool,
                     order: DecodeOrder = order) -> bool:
                d = pool[row]
                ctx = d.context_tokens + int(order.ahead_tokens[row]) + d.reserved_tokens
                return d.capacity_tokens <= 0 or ctx + need <= d.capacity_tokens

            live = [i for i, d in enumerate(pool) if d.up]
            fit = sorted((step(i), i) for i in live if room(i))
            got = order.candidates(k, tokens, need)
            if not live:
                assert got is None
                continue
            assert got is not None
            if fit:  # the k fastest with room (by step; ties may be any of the tied)
                want = [s for s, _ in fit[:k]]
                assert sorted(step(i) for i in got.tolist()) == pytest.approx(want)
                assert all(room(i) for i in got.tolist())
            else:  # none has room: the fastest of all, the answer then
                assert [step(i) for i in got.tolist()] == pytest.approx(
                    [min(step(i) for i in live)])


def _cluster(r: random.Random, n: int) -> tuple[ClusterState, RequestInfo, float]:
    index = PrefixIndex(10_000, instances=n)
    pool = [PrefillState(iid=i) for i in range(n)]
    decode = [DecodeState(iid=i, capacity_tokens=200_000) for i in range(n)]
    now = 100.0
    for p in pool:
        p.busy_until = r.choice([0.0, now + r.random() * 3])
        for j in range(r.choice([0, 0, 2])):
            p.enqueue(j, 0.0, r.random(), 10, 160)
    for d in decode:
        d.batch = r.randint(0, 30)
        d.context_tokens = d.batch * r.randint(100, 3000)
    keys = [r.getrandbits(63) for _ in range(64)]
    for holder in r.sample(range(n), min(n, 6)):
        index.store(holder, keys[: r.randint(1, 64)])
    req = RequestInfo(rid=1, arrival=now, input_tokens=1024, output_tokens=64, keys=keys,
                      block_tokens=16)
    return ClusterState(prefill=pool, decode=decode, index=index), req, now


def test_a_candidate_is_priced_as_the_full_ranking_prices_it() -> None:
    """rank_rows over any candidate rows, with the pool's aggregates from the load order,
    gives each of them the score rank_fifo gives it (bit for bit), and over every row
    the same ties."""
    r = random.Random(11)
    consts = np.array(COST.prefill_constants())
    for _ in range(50):
        n = r.choice([4, 33, 130])
        cluster, req, now = _cluster(r, n)
        board = board_of(cluster.prefill)
        order: LoadOrder = order_of(board, LoadOrder)
        local = np.zeros(max(64, n), dtype=np.int64)
        for i in r.sample(range(n), min(n, 5)):
            local[i] = r.randint(0, 64)
        best_len = int(local.max())
        args = (consts, now, req.input_tokens, 16, best_len, int(local.argmax()), 1.0,
                r.choice([0.0, 3.0]), 30.0, 15.0, True, 0.02, 0.005)
        full_score, full_fetch = np.empty(n), np.empty(n, dtype=np.bool_)
        full_ties = np.empty(n, dtype=np.int64)
        count, kappa = rank_fifo(*args, board["up"], board["busy_until"],
                                 board["queued_work_s"], board["queue_len"], board["iid"],
                                 local, full_score, full_fetch, full_ties)
        _, _, agg, j1 = order.candidates(now, 2, local, 1)
        every = np.arange(n, dtype=np.int64)
        score, fetch = np.empty(n), np.empty(n, dtype=np.bool_)
        ties = np.empty(n, dtype=np.int64)
        c2, k2 = rank_rows(*args, agg, j1, every, board["up"], board["busy_until"],
                           board["queued_work_s"], board["iid"], local, score, fetch, ties)
        assert (c2, k2) == (count, kappa)
        assert ties[:c2].tolist() == full_ties[:count].tolist()
        rows = np.array(sorted(r.sample(range(n), max(1, n // 3))), dtype=np.int64)
        rank_rows(*args, agg, j1, rows, board["up"], board["busy_until"],
                  board["queued_work_s"], board["iid"], local, score, fetch, ties)
        finite = [int(i) for i in rows if np.isfinite(full_score[i]) and np.isfinite(score[i])]
        assert score[finite].tolist() == full_score[finite].tolist()


@pytest.mark.parametrize("policy", ["conductor"])
def test_on_a_large_pool_the_choice_is_the_full_scans_when_that_is_a_candidate(
        policy: str) -> None:
    """Two conductors, one pricing candidates (min_pool 2) and one every instance, on the
    same states: wherever the full choice's score band holds a candidate, the candidate
    choice scores inside that band (same TTFT up to the tie tolerance)."""
    r = random.Random(5)
    same = 0
    for _ in range(80):
        cluster, req, now = _cluster(r, r.choice([16, 64]))
        params = {"cpp": {"enabled": False}}
        full = Conductor(ConductorConfig(policy=policy, params=params,
                                         candidates=CandidatesConfig(enabled=False)))
        cand = Conductor(ConductorConfig(policy=policy, params=params,
                                         candidates=CandidatesConfig(min_pool=2)))
        a = full.policy.choose(req, cluster, now)
        b = cand.policy.choose(req, cluster, now)
        assert b.prefill is not None and a.prefill is not None
        if a.prefill == b.prefill:
            same += 1
        # the candidate choice is never more than the tie band worse in TTFT
        assert b.ttft_s <= a.ttft_s * 1.02 + 0.005 + 1e-9 or b.reused_blocks >= a.reused_blocks
        da = full.decode_selector.choose(req, cluster.decode)
        db = cand.decode_selector.choose(req, cluster.decode)
        assert db.predicted_tbt_s <= da.predicted_tbt_s * 1.01 + 1e-9
        assert (da.reject_reason is None) == (db.reject_reason is None)
    assert same > 20  # a real share of identical choices, not only equivalent ones


def test_lookahead_counts_reach_a_large_pools_order() -> None:
    """Requests placed on a decode instance whose prefill still runs weigh on it in the
    candidate path as in the full one: the same instance is avoided."""
    cfg = CandidatesConfig(min_pool=2, least_loaded=2)
    cond = Conductor(ConductorConfig(candidates=cfg))
    decode = [DecodeState(iid=i, capacity_tokens=0) for i in range(4)]
    req = RequestInfo(rid=1, arrival=0.0, input_tokens=4000, output_tokens=10, keys=[],
                      block_tokens=16)
    sel = cond.decode_selector
    first = sel.choose(req, decode)
    assert first.decode is not None
    for rid in range(10, 40):  # many requests sent ahead to the first choice
        sel.placed(RequestInfo(rid=rid, arrival=0.0, input_tokens=4000, output_tokens=1,
                               keys=[], block_tokens=16), first.decode)
    for _ in range(10):
        assert sel.choose(req, decode).decode != first.decode
    for rid in range(10, 40):
        sel.joined(RequestInfo(rid=rid, arrival=0.0, input_tokens=4000, output_tokens=1,
                               keys=[], block_tokens=16))
    order = board_of(decode).order
    assert order.ahead_n.tolist() == [0, 0, 0, 0]


def test_a_full_large_pool_refuses_as_the_full_pass_does() -> None:
    """No decode instance has KV room: both paths refuse for the TBT SLO, naming the
    fastest instance; with room on one instance only, both take it."""
    decode = [DecodeState(iid=i, capacity_tokens=10_000, context_tokens=9_000 - 100 * i,
                          batch=3) for i in range(6)]
    req = RequestInfo(rid=1, arrival=0.0, input_tokens=2000, output_tokens=10, keys=[],
                      block_tokens=16)
    full = Conductor(ConductorConfig(candidates=CandidatesConfig(enabled=False)))
    cand = Conductor(ConductorConfig(candidates=CandidatesConfig(min_pool=2, least_loaded=2)))
    a, b = full.decode_selector.choose(req, decode), cand.decode_selector.choose(req, decode)
    assert a.reject_reason == b.reject_reason == "tbt-slo"
    assert a.decode == b.decode == 5  # the least context steps fastest
    decode[2].context_tokens = 1000
    a, b = full.decode_selector.choose(req, decode), cand.decode_selector.choose(req, decode)
    assert a.reject_reason is None and (a.decode, b.decode, b.reject_reason) == (2, 2, None)
    for d in decode:
        d.up = False
    assert cand.decode_selector.choose(req, decode).reject_reason == "no-decode-instance"


def _req(rid: int, tokens: int = 100) -> RequestInfo:
    return RequestInfo(rid=rid, arrival=0.0, input_tokens=tokens, output_tokens=1, keys=[],
                       block_tokens=16)


def test_the_order_counts_exactly_the_requests_its_owner_sent_ahead() -> None:
    """Requests placed before the order exists, a new pool list in another row order, a
    second selector taking the pool over and giving it back, and joins: the order's
    counts by row are always the owner's requests still ahead."""
    cfg = CandidatesConfig(min_pool=2)
    one = Conductor(ConductorConfig(candidates=cfg)).decode_selector
    two = Conductor(ConductorConfig(candidates=cfg)).decode_selector
    states = [DecodeState(iid=i, capacity_tokens=0) for i in range(4)]
    one.placed(_req(1, 100), 0)  # before any order: loaded when it is made
    one.placed(_req(2, 50), 0)
    one.placed(_req(3, 7), 2)
    one.choose(_req(99), states)
    order = board_of(states).order
    assert order.ahead_n.tolist() == [2, 0, 1, 0]
    assert order.ahead_tokens.tolist() == [150, 0, 7, 0]
    one.placed(_req(4, 30), 3)  # told at once, no choice needed
    assert order.ahead_n.tolist() == [2, 0, 1, 1]
    one.joined(_req(2))  # one of the two on instance 0 left
    assert order.ahead_n.tolist() == [1, 0, 1, 1]
    assert order.ahead_tokens.tolist() == [100, 0, 7, 30]
    two.choose(_req(98), states)  # another selector's order: its own (none) counted
    assert order.ahead_n.tolist() == [0, 0, 0, 0]
    one.placed(_req(5, 11), 1)  # not the owner now: the order is left alone
    assert order.ahead_n.tolist() == [0, 0, 0, 0]
    one.choose(_req(97), states)  # back to the first: everything it has ahead
    assert order.ahead_n.tolist() == [1, 1, 1, 1]
    assert order.ahead_tokens.tolist() == [100, 11, 7, 30]
    moved = list(reversed(states))  # a new list: rows are iids reversed
    one.choose(_req(96), moved)
    fresh = board_of(moved).order
    assert fresh is not order
    assert fresh.ahead_tokens.tolist() == [30, 7, 11, 100]
    one.placed(_req(6, 5), 3)  # the new order follows; the old one is left as it was
    assert fresh.ahead_tokens.tolist() == [35, 7, 11, 100]
    assert order.ahead_tokens.tolist() == [100, 11, 7, 30]
    for rid in (1, 3, 4, 5, 6):
        one.joined(_req(rid))
    assert fresh.ahead_n.tolist() == [0, 0, 0, 0]
    assert fresh.ahead_tokens.tolist() == [0, 0, 0, 0]


def test_an_order_stays_sorted_whichever_way_its_rows_move() -> None:
    r = random.Random(5)
    for trial in range(60):
        rows = r.randint(1, 40) if trial % 2 else r.randint(300, 700)
        orders = _Orders(rows, 3)
        keys: list[dict[int, float]] = [{}, {}, {}]
        for _ in range(3 * rows):
            row = r.randrange(rows)
            new = []
            for want in keys:  # out (NaN), or a key: few distinct ones give ties by row
                if r.random() < 0.15:
                    want.pop(row, None)
                    new.append(math.nan)
                else:
                    want[row] = float(r.randint(0, 12 if trial % 4 < 2 else 10**6))
                    new.append(want[row])
            orders.set(row, *new)
        for which, want in enumerate(keys):
            size = int(orders.sizes[which])
            entries = list(zip(orders.keys[which, :size].tolist(),
                               orders.rows[which, :size].tolist(), strict=True))
            assert entries == sorted((k, row) for row, k in want.items())
            assert {row: orders.cur[which, row] for row in range(rows)
                    if not math.isnan(orders.cur[which, row])} == want
