"""What each state method does to the numbers the policies and the gateway read.

Every expected value here is worked out by hand from the method's contract: queue
totals after enqueue / pop, FIFO among equal priorities, the defaults a newly joined
instance gets (the gateway and the simulator construct states with only an id and a
name), board rows and caches, and the group checks of :meth:`ClusterState.grouped`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mooncake_conductor import state as state_mod
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.state import (
    ClusterState,
    DecodeState,
    PrefillState,
    QueuedWork,
    _column,
    _group_column,
    _Instance,
    board_of,
)


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start the non-zero-group count at 0 and put the session's count back afterwards
    (states made here in other groups would otherwise stay counted)."""
    monkeypatch.setattr(_Instance, "nonzero_groups", 0)


# --- the prefill queue ---------------------------------------------------------------


def test_enqueue_and_pop_keep_every_queue_total() -> None:
    p = PrefillState(0, busy_until=2.0, running_blocks=4, running_tokens=300)
    board = board_of([p, PrefillState(1)])
    p.enqueue(10, priority=2.0, work_s=0.5, blocks=3, tokens=40)
    p.enqueue(11, priority=1.0, work_s=0.25, blocks=5, tokens=70)
    p.enqueue(12, priority=3.0, work_s=0.125, blocks=2, tokens=20)
    assert (p.queue_len, p.queued_work_s, p.queued_blocks, p.queued_tokens) == (3, 0.875, 10, 130)
    assert board["queue_len"][0] == 3 and board["queued_work_s"][0] == 0.875
    assert p.active_blocks == 14 and p.outstanding == 4
    # 1.5 s left of the running prefill, then everything queued / what goes before 2.0
    assert p.wait_time(0.5) == 1.5 + 0.875
    assert p.wait_time(0.5, priority=2.0) == 1.5 + 0.25 + 0.5

    item = p.pop(11)  # a request leaves the queue (cancelled, or started out of order)
    assert (item.rid, item.priority, item.work_s) == (11, 1.0, 0.25)
    assert (item.blocks, item.tokens) == (5, 70)
    assert (p.queue_len, p.queued_work_s, p.queued_blocks, p.queued_tokens) == (2, 0.625, 5, 60)
    assert board["queue_len"][0] == 2 and board["queued_work_s"][0] == 0.625

    item = p.pop()  # the front in priority order: 2.0 before 3.0
    assert (item.rid, item.work_s, item.blocks, item.tokens) == (10, 0.5, 3, 40)
    assert (p.queue_len, p.queued_work_s, p.queued_blocks, p.queued_tokens) == (1, 0.125, 2, 20)

    item = p.pop()
    assert (item.rid, item.blocks, item.tokens) == (12, 2, 20)
    assert (p.queue_len, p.queued_work_s, p.queued_blocks, p.queued_tokens) == (0, 0.0, 0, 0)
    assert board["queue_len"][0] == 0 and board["queued_work_s"][0] == 0.0
    assert p.active_blocks == 4 and p.outstanding == 1 and p.wait_time(0.5) == 1.5


def test_equal_priorities_are_served_first_come_first_served() -> None:
    p = PrefillState(0)
    for rid in (1, 2, 3, 4, 5):
        p.enqueue(rid, priority=1.0, work_s=0.1, blocks=1, tokens=8)
    p.enqueue(6, priority=0.5, work_s=0.1, blocks=1, tokens=8)  # goes first
    p.enqueue(7, priority=1.0, work_s=0.1, blocks=1, tokens=8)
    assert [p.pop().rid for _ in range(7)] == [6, 1, 2, 3, 4, 5, 7]
    # and after taking one out of the middle, the rest keep their order
    for rid in (1, 2, 3, 4, 5):
        p.enqueue(rid, priority=1.0, work_s=0.1, blocks=1, tokens=8)
    assert p.pop(3).rid == 3
    assert [p.pop().rid for _ in range(4)] == [1, 2, 4, 5]


def test_an_empty_queue_holds_exactly_no_work() -> None:
    """The sum of the work taken out need not cancel the sum put in (0.1 + 0.2 + 0.3
    leaves 1.1e-16): an empty queue must read 0, which the gateway's drain and the
    wait predictions rely on."""
    p = PrefillState(0)
    for rid, w in enumerate((0.1, 0.2, 0.3)):
        p.enqueue(rid, priority=1.0, work_s=w, blocks=1, tokens=8)
    p.pop()
    p.pop()
    assert p.queued_work_s > 0
    p.pop()
    assert p.queued_work_s == 0.0 and p.wait_time(0.0) == 0.0


def test_a_queue_given_to_the_constructor_is_used_in_priority_order() -> None:
    items = [QueuedWork(3.0, 1, rid=30, work_s=0.3), QueuedWork(1.0, 2, rid=10, work_s=0.1),
             QueuedWork(2.0, 3, rid=20, work_s=0.2)]
    p = PrefillState(0, queue=items, queued_work_s=0.6)
    assert p.queue is items and p.queue_len == 3 and p.outstanding == 3
    assert [p.pop().rid for _ in range(3)] == [10, 20, 30]


# --- what a state starts with ---------------------------------------------------------


def test_a_new_prefill_instance_has_no_load() -> None:
    p = PrefillState(4)
    assert (p.iid, p.name, p.up, p.group) == (4, "", True, 0)
    assert (p.busy_until, p.running_blocks, p.running_tokens) == (0.0, 0, 0)
    assert (p.queue, p.queue_len, p.queued_work_s, p.queued_blocks, p.queued_tokens) == (
        [], 0, 0.0, 0, 0)
    assert (p.cache_capacity_tokens, p.avg_prefill_s, p.completed) == (0, 0.0, 0)
    assert p.outstanding == 0 and p.active_blocks == 0 and p.wait_time(3.0) == 0.0


def test_the_observed_prefill_average_is_a_mean_then_a_moving_one() -> None:
    p = PrefillState(0)
    for t in (1.0, 2.0, 6.0):
        p.observe_prefill(t)
    assert (p.completed, p.avg_prefill_s) == (3, 3.0)  # the plain mean
    window = state_mod.AVG_PREFILL_WINDOW
    for _ in range(window - 3):
        p.observe_prefill(3.0)
    assert p.completed == window and p.avg_prefill_s == pytest.approx(3.0)
    p.observe_prefill(3.0 + window)  # past the window: one more moves it by 1/window
    assert p.avg_prefill_s == pytest.approx(4.0)
    p.observe_prefill(4.0 + window)
    assert p.avg_prefill_s == pytest.approx(5.0)


def test_a_prefill_state_keeps_what_it_is_given(groups: None) -> None:
    p = PrefillState(3, name="p3", up=False, busy_until=7.5, running_blocks=4,
                     running_tokens=300, queued_work_s=1.25, queued_blocks=6,
                     queued_tokens=700, cache_capacity_tokens=9000, avg_prefill_s=0.2,
                     completed=9, group=2)
    assert (p.iid, p.name, p.up, p.group) == (3, "p3", False, 2)
    assert (p.busy_until, p.running_blocks, p.running_tokens) == (7.5, 4, 300)
    assert (p.queued_work_s, p.queued_blocks, p.queued_tokens) == (1.25, 6, 700)
    assert (p.cache_capacity_tokens, p.avg_prefill_s, p.completed) == (9000, 0.2, 9)
    assert p.active_blocks == 10 and p.outstanding == 1
    assert p.running_remaining(5.0) == 2.5 and p.wait_time(5.0) == 3.75
    assert _Instance.nonzero_groups == 1


def test_a_new_decode_instance_has_no_load() -> None:
    d = DecodeState(2)
    assert (d.iid, d.name, d.up, d.group) == (2, "", True, 0)
    assert (d.batch, d.context_tokens, d.reserved_tokens, d.capacity_tokens) == (0, 0, 0, 0)
    assert (d.waiting, d.tokens_per_s, d.kv_usage) == (0, 0.0, 0.0)


def test_a_decode_state_keeps_what_it_is_given(groups: None) -> None:
    d = DecodeState(5, name="d5", up=False, batch=3, context_tokens=600,
                    capacity_tokens=1000, waiting=2, reserved_tokens=200,
                    tokens_per_s=40.0, group=1)
    assert (d.iid, d.name, d.up, d.group) == (5, "d5", False, 1)
    assert (d.batch, d.context_tokens, d.reserved_tokens, d.capacity_tokens) == (3, 600, 200, 1000)
    assert (d.waiting, d.tokens_per_s, d.kv_usage) == (2, 40.0, 0.8)
    assert _Instance.nonzero_groups == 1


# --- the board -------------------------------------------------------------------------


def test_row_of_finds_ids_that_are_not_their_rows() -> None:
    board = board_of([DecodeState(3), DecodeState(0), DecodeState(1)])
    assert [board.row_of(i) for i in (0, 1, 2, 3)] == [1, 2, -1, 0]


def test_rows_outside_a_group_are_kept_until_up_or_group_changes(groups: None) -> None:
    states = [DecodeState(0), DecodeState(1, group=1), DecodeState(2, up=False),
              DecodeState(3, group=2)]
    board = board_of(states)
    rows = board.rows_outside(0)
    assert rows.tolist() == [1, 3] and board.rows_outside(1).tolist() == [0, 3]
    assert board.rows_outside(0) is rows  # one decision after another reads the cache
    states[0].batch = 5  # not a live column: the cache stays
    assert board.rows_outside(0) is rows
    states[1].up = False
    assert board.rows_outside(0).tolist() == [3]
    states[3].group = 0
    assert board.rows_outside(0).tolist() == [] and board.rows_outside(1).tolist() == [0, 3]


def test_take_down_hides_states_from_the_cached_rows_until_undone(groups: None) -> None:
    states = [DecodeState(0), DecodeState(1, group=1), DecodeState(2, group=2),
              DecodeState(3, group=1)]
    board = board_of(states)
    before = board.rows_outside(0)
    assert before.tolist() == [1, 2, 3] and board.live_mask == 0b1111
    undo = board.take_down(np.array([1, 3], dtype=np.intp))  # group 1, for one decision
    assert not states[1].up and not states[3].up
    assert board["up"].tolist() == [True, False, True, False]
    assert board.live_mask == 0b0101 and board.live_groups == frozenset({0, 2})
    assert board.rows_outside(0).tolist() == [2]
    undo()
    assert states[1].up and states[3].up and board["up"].all()
    assert board.live_mask == 0b1111 and board.live_groups == frozenset({0, 1, 2})
    assert board.rows_outside(0) is before
    board.take_down(np.array([], dtype=np.intp))()  # taking nothing down changes nothing
    assert board.live_mask == 0b1111 and board.rows_outside(0) is before


# --- groups ----------------------------------------------------------------------------


def _cluster(prefill: list[PrefillState], decode: list[DecodeState]) -> ClusterState:
    return ClusterState(prefill=prefill, decode=decode, index=PrefixIndex(64, instances=4))


def test_with_every_state_in_group_0_grouped_reads_no_board(
        groups: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_board(states: Any) -> Any:
        raise AssertionError("grouped() built a board while every group is 0")

    monkeypatch.setattr(state_mod, "board_of", no_board)
    cluster = _cluster([PrefillState(0), PrefillState(1)], [DecodeState(0)])
    assert cluster.grouped() is False


def test_grouped_with_a_pool_empty_or_all_down(groups: None) -> None:
    two = [DecodeState(0, group=1), DecodeState(1, group=2)]
    assert _cluster([], two).grouped() is False  # no prefill pool: nothing to pair
    assert _cluster([PrefillState(0, group=1), PrefillState(1, group=2)], []).grouped() is False
    # the prefill instances up span two groups, every decode instance is down
    down = [DecodeState(0, up=False, group=1)]
    assert _cluster([PrefillState(0, group=1), PrefillState(1, group=2)], down).grouped()
    # and the other way round
    assert _cluster([PrefillState(0, up=False, group=1)], two).grouped()
    # one group each side, the same one: no pairing needed
    assert not _cluster([PrefillState(0, group=1)], [DecodeState(0, group=1)]).grouped()


# --- the column descriptors ------------------------------------------------------------
#
# ``_column`` and ``_group_column`` run when state.py is imported, so the descriptors of
# PrefillState and DecodeState are made once per process. These tests make them anew,
# on a subclass of DecodeState, and check what they read and write.


def _fresh_decode_class() -> type[DecodeState]:
    class FreshDecode(DecodeState):
        __slots__ = ()  # no __dict__: every write must land in a slot
        up = _column("up")
        group = _group_column()
        batch = _column("batch")
        context_tokens = _column("context_tokens")

    return FreshDecode


def test_a_column_reads_its_slot_and_writes_through_to_the_board() -> None:
    fresh = _fresh_decode_class()
    states = [fresh(i, batch=i, context_tokens=10 * i) for i in range(3)]
    assert [s.batch for s in states] == [0, 1, 2] and states[2].context_tokens == 20
    board = board_of(states)
    assert board["batch"].tolist() == [0, 1, 2] and board["context_tokens"].tolist() == [0, 10, 20]
    assert board.live_mask == 0b111 and board.live_groups == frozenset({0})
    assert board.rows_outside(5).tolist() == [0, 1, 2]
    states[1].batch = 7
    states[1].context_tokens = 99
    assert states[1].batch == 7 and states[1].context_tokens == 99
    assert board["batch"].tolist() == [0, 7, 2] and board["context_tokens"].tolist() == [0, 99, 20]
    states[2].up = False  # a live column: the cached mask, groups and rows are redone
    assert states[2].up is False and board["up"].tolist() == [True, True, False]
    assert board.live_mask == 0b011 and board.live_groups == frozenset({0})
    assert board.rows_outside(5).tolist() == [0, 1]
    states[2].up = True
    assert states[2].up is True and board["up"].tolist() == [True, True, True]
    assert board.live_mask == 0b111


def test_the_group_column_counts_states_out_of_group_0(groups: None) -> None:
    fresh = _fresh_decode_class()
    a = fresh(0)  # the first write of group 0 counts nothing
    assert _Instance.nonzero_groups == 0 and a.group == 0
    b = fresh(1, group=2)
    c = fresh(2, group=3)
    assert _Instance.nonzero_groups == 2 and (b.group, c.group) == (2, 3)
    board = board_of([a, b, c])
    assert board["group"].tolist() == [0, 2, 3] and board.live_groups == frozenset({0, 2, 3})
    c.group = 4  # from one non-zero group to another: still counted once
    assert _Instance.nonzero_groups == 2 and c.group == 4
    assert board["group"].tolist() == [0, 2, 4] and board.live_groups == frozenset({0, 2, 4})
    b.group = 0
    assert _Instance.nonzero_groups == 1 and b.group == 0
    a.group = 1
    assert _Instance.nonzero_groups == 2 and board["group"].tolist() == [1, 0, 4]
    a.group = c.group = 0
    assert _Instance.nonzero_groups == 0 and board.live_groups == frozenset({0})
