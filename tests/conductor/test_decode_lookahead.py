"""``tbt-lookahead``: ``tbt-slo`` priced with the requests already sent to each decode
instance whose prefill is still running, on hand-made instances; and the Conductor
telling its selector what it placed and what finished prefilling."""

import random
from typing import Any

import numpy as np
import pytest
from mooncake_conductor.decode import TBTLookaheadDecode, create_decode_selector
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.state import DecodeState, RequestInfo

from .helpers import COST, cluster, request

KEYS = list(range(20))  # 10240 tokens
N = 20 * 512


def lookahead(tbt_s: float = 0.1, seed: int = 0) -> TBTLookaheadDecode:
    sel = create_decode_selector("tbt-lookahead", COST, tbt_s, random.Random(seed))
    assert isinstance(sel, TBTLookaheadDecode)
    return sel


def idle(n: int = 2) -> list[DecodeState]:
    return [DecodeState(iid=i, capacity_tokens=COST.kv_capacity_tokens) for i in range(n)]


def req(rid: int, blocks: int = 20) -> RequestInfo:
    return request(list(range(rid * 1000, rid * 1000 + blocks)), rid=rid)


def test_a_request_in_prefill_counts_in_its_decode_instances_batch() -> None:
    sel, ds = lookahead(), idle()
    sel.placed(req(1), 0)
    ch = sel.choose(req(2), ds)
    # instance 1 is empty: a batch of one; instance 0 would be two with both prompts
    assert ch.decode == 1 and ch.reject_reason is None
    assert ch.predicted_tbt_s == COST.decode_step_time(1, N)
    sel.placed(req(2), 1)
    sel.placed(req(3), 1)
    # now 1 on instance 0 against 2 on instance 1
    ch = sel.choose(req(4), ds)
    assert ch.decode == 0 and ch.predicted_tbt_s == COST.decode_step_time(2, 2 * N)


def test_pending_prompts_count_in_the_context() -> None:
    """One pending request on each instance; the one on 0 has the longer prompt, so 1 is
    cheaper by context alone."""
    sel, ds = lookahead(), idle()
    sel.placed(req(1, blocks=200), 0)
    sel.placed(req(2, blocks=20), 1)
    ch = sel.choose(req(3), ds)
    assert ch.decode == 1
    assert ch.predicted_tbt_s == COST.decode_step_time(2, 2 * N)


def test_running_and_pending_add_up() -> None:
    ds = [DecodeState(iid=0, batch=3, context_tokens=30_000,
                      capacity_tokens=COST.kv_capacity_tokens),
          DecodeState(iid=1, batch=1, context_tokens=10_000,
                      capacity_tokens=COST.kv_capacity_tokens)]
    sel = lookahead()
    for rid in (1, 2, 3):
        sel.placed(req(rid), 1)  # 1 running + 3 pending on 1 against 3 running on 0
    ch = sel.choose(req(4), ds)
    assert ch.decode == 0 and ch.predicted_tbt_s == COST.decode_step_time(4, 30_000 + N)
    # the running batch alone (tbt-slo) would have picked 1
    plain = create_decode_selector("tbt-slo", COST, 0.1, random.Random(0))
    assert plain.choose(req(4), ds).decode == 1


def test_prefilled_requests_leave_the_count() -> None:
    sel, ds = lookahead(), idle()
    sel.placed(req(1), 0)
    sel.placed(req(2), 0)
    sel.joined(req(1))
    sel.placed(req(3), 1)
    sel.placed(req(4), 1)
    # 1 pending on 0 against 2 on 1
    ch = sel.choose(req(5), ds)
    assert ch.decode == 0 and ch.predicted_tbt_s == COST.decode_step_time(2, 2 * N)
    sel.joined(req(2))
    sel.joined(req(3))
    sel.joined(req(4))
    # nothing pending: the two tie, and a seed draws each
    assert {lookahead_after(seed).decode for seed in range(20)} == {0, 1}
    assert sel.choose(req(5), ds).predicted_tbt_s == COST.decode_step_time(1, N)


def lookahead_after(seed: int) -> Any:
    sel, ds = lookahead(seed=seed), idle()
    sel.placed(req(1), 0)
    sel.joined(req(1))
    return sel.choose(req(5), ds)


def test_unknown_repeated_and_undecided_requests_change_nothing() -> None:
    sel, ds = lookahead(), idle()
    sel.placed(req(1), None)  # rejected before a decode instance was chosen
    sel.joined(req(9))  # never placed
    sel.placed(req(2), 0)
    sel.placed(req(2), 0)  # the same request again counts once
    sel.joined(req(2))
    sel.joined(req(2))  # and leaves once
    sel.placed(req(3), 1)
    ch = sel.choose(req(4), ds)
    assert ch.decode == 0 and ch.predicted_tbt_s == COST.decode_step_time(1, N)


def busy(batch: int = 300, context: int = 150_000) -> list[DecodeState]:
    """One instance whose batch is large enough for the step to be compute-bound, so
    every request in it counts (at small batches the step is memory-bound and only the
    context matters)."""
    return [DecodeState(iid=0, batch=batch, context_tokens=context,
                        capacity_tokens=COST.kv_capacity_tokens)]


def test_each_pending_request_counts_once_in_a_compute_bound_batch() -> None:
    one = 512
    assert COST.decode_step_time(302, 150_000) > COST.decode_step_time(301, 150_000)
    sel = lookahead()
    assert sel.choose(req(9, blocks=1), busy()).predicted_tbt_s == \
        COST.decode_step_time(301, 150_000 + one)
    sel.placed(req(1, blocks=1), 0)
    assert sel.choose(req(9, blocks=1), busy()).predicted_tbt_s == \
        COST.decode_step_time(302, 150_000 + 2 * one)
    sel.placed(req(2, blocks=1), 0)
    sel.placed(req(3, blocks=1), 0)
    assert sel.choose(req(9, blocks=1), busy()).predicted_tbt_s == \
        COST.decode_step_time(304, 150_000 + 4 * one)
    sel.joined(req(1, blocks=1))
    assert sel.choose(req(9, blocks=1), busy()).predicted_tbt_s == \
        COST.decode_step_time(303, 150_000 + 3 * one)
    sel.joined(req(2, blocks=1))
    sel.joined(req(3, blocks=1))
    assert sel.choose(req(9, blocks=1), busy()).predicted_tbt_s == \
        COST.decode_step_time(301, 150_000 + one)


def test_pending_requests_add_to_the_running_batch_not_replace_it() -> None:
    """300 running on 0 plus one pending against 301 running on 1 with the same
    context: a tie by batch, and 0 holds one more prompt, so 1 wins; counting the
    pending request instead of the running batch (or against it) would pick 0."""
    ds = [DecodeState(iid=0, batch=300, context_tokens=150_000,
                      capacity_tokens=COST.kv_capacity_tokens),
          DecodeState(iid=1, batch=301, context_tokens=150_000,
                      capacity_tokens=COST.kv_capacity_tokens)]
    sel = lookahead()
    sel.placed(req(1, blocks=1), 0)
    ch = sel.choose(req(9, blocks=1), ds)
    assert ch.decode == 1 and ch.predicted_tbt_s == COST.decode_step_time(302, 150_512)


def test_pending_requests_can_break_the_tbt_slo() -> None:
    """An SLO the empty instance meets but not with three more in its batch."""
    ds = idle(1)
    alone, crowded = COST.decode_step_time(1, N), COST.decode_step_time(4, 4 * N)
    slo = (alone + crowded) / 2
    sel = lookahead(tbt_s=slo)
    assert sel.choose(req(9), ds).reject_reason is None
    for rid in (1, 2, 3):
        sel.placed(req(rid), 0)
    ch = sel.choose(req(9), ds)
    assert ch.reject_reason == "tbt-slo" and ch.decode == 0
    assert ch.predicted_tbt_s == crowded


def test_no_instance_up_is_no_decode_instance() -> None:
    sel = lookahead()
    assert sel.choose(req(1), []).reject_reason == "no-decode-instance"
    down = [DecodeState(iid=0, up=False, capacity_tokens=COST.kv_capacity_tokens)]
    sel.placed(req(2), 0)
    ch = sel.choose(req(1), down)
    assert ch.decode is None and ch.reject_reason == "no-decode-instance"


def test_the_running_board_is_not_changed() -> None:
    sel, ds = lookahead(), idle()
    sel.placed(req(1), 0)
    sel.choose(req(2), ds)
    assert (ds[0].batch, ds[0].context_tokens) == (0, 0)


# -- the Conductor tells its selector ---------------------------------------------------------

def test_conductor_decodes_with_the_lookahead_by_default() -> None:
    assert Conductor(ConductorConfig(policy="conductor")).decode_selector.name \
        == "tbt-lookahead"
    assert Conductor(ConductorConfig(policy="mooncake-paper")).decode_selector.name \
        == "tbt-slo"


def test_a_burst_spreads_over_decode_instances() -> None:
    """Three requests at once on an idle pool: each one's decode instance counts the
    ones before it, so they spread; with ``tbt-slo`` the first two tie on empty
    batches every time."""
    cond = Conductor(ConductorConfig(policy="conductor"))
    c = cluster(4, decode=3)
    picks = [cond.schedule(req(rid), c, 0.0).decode.decode for rid in (1, 2, 3)]
    assert sorted(picks) == [0, 1, 2]


def test_prefilled_and_failed_requests_release_their_decode_slot() -> None:
    cond = Conductor(ConductorConfig(policy="conductor"))
    sel = cond.decode_selector
    assert isinstance(sel, TBTLookaheadDecode)
    c = cluster(4, decode=2)
    r1, r2 = req(1), req(2)
    d1 = cond.schedule(r1, c, 0.0)
    d2 = cond.schedule(r2, c, 0.0)
    assert {d1.decode.decode, d2.decode.decode} == {0, 1}
    cond.prefilled(r1, d1)
    cond.finished(r2, d2)  # its prefill failed: it never decodes
    assert sel.choose(req(3), c.decode).predicted_tbt_s == COST.decode_step_time(1, N)
    cond.finished(r1, d1)  # after prefilled: nothing more to release
    assert sel.choose(req(3), c.decode).predicted_tbt_s == COST.decode_step_time(1, N)


def test_rejected_requests_are_not_counted() -> None:
    cond = Conductor(ConductorConfig(policy="conductor", slo={"ttft_s": 0.01, "tbt_s": 0.1}))
    c = cluster(2, decode=1)
    d = cond.schedule(req(1), c, 0.0)
    assert d.rejected and d.reject_reason == "ttft-slo"
    sel = cond.decode_selector
    assert sel.choose(req(2), c.decode).predicted_tbt_s == pytest.approx(
        COST.decode_step_time(1, N))


def test_a_request_that_starts_on_its_decode_instance_leaves_the_count() -> None:
    """The gateway's direct rule: no prefill instance, the decode engine prefills itself
    and is in its batch from then on (``Conductor.decoding``)."""
    cond = Conductor(ConductorConfig(policy="conductor"))
    c = cluster(4, decode=1)
    r1 = req(1)
    d1 = cond.schedule(r1, c, 0.0)
    assert cond.decode_selector.choose(req(2), c.decode).predicted_tbt_s == \
        COST.decode_step_time(2, 2 * N)
    cond.decoding(r1, d1)
    assert cond.decode_selector.choose(req(2), c.decode).predicted_tbt_s == \
        COST.decode_step_time(1, N)


def test_the_counts_by_row_follow_placements_and_pool_changes() -> None:
    """What the full pass reads as sent ahead (by row of the pool's board) is kept as
    requests are placed and join, and counted anew when the pool list changes: always
    the recount of the requests still ahead."""
    from mooncake_conductor.state import board_of

    r = random.Random(5)
    sel = lookahead()
    states = idle(12)
    pool = states[:8]
    ahead: dict[int, tuple[int, int]] = {}  # rid -> (decode iid, prompt tokens)
    for rid in range(1, 400):
        kind = r.random()
        if kind < 0.5:
            q = req(rid, blocks=r.randint(1, 40))
            iid = r.choice(pool).iid
            sel.placed(q, iid)
            ahead[rid] = (iid, q.input_tokens)
        elif kind < 0.85 and ahead:
            gone = r.choice(sorted(ahead))
            sel.joined(req(gone))
            del ahead[gone]
        elif kind < 0.9:  # instances join or leave: another list, another board
            pool = r.sample(states, r.randint(2, 12))
        sel.choose(req(10_000 + rid), pool)  # reads (and after a change rebuilds) the counts
        board = board_of(pool)
        n, tokens = sel._ahead(board)
        if not ahead:
            assert n is None and tokens is None
            continue
        assert n is not None and tokens is not None
        # the compiled ranking's types; kept between decisions, not counted anew
        assert n.dtype == np.int64 and tokens.dtype == np.int64
        again = sel._ahead(board)
        assert again[0] is n and again[1] is tokens
        for row, st in enumerate(pool):
            mine = [t for i, t in ahead.values() if i == st.iid]
            assert (int(n[row]), int(tokens[row])) == (len(mine), sum(mine))
