"""Instance states keep their board (numpy columns for the compiled rankings) current."""

from __future__ import annotations

import random

from mooncake_conductor.state import Board, DecodeState, PrefillState, board_of


def _columns_match(states: list[PrefillState] | list[DecodeState], board: Board) -> None:
    for name in type(states[0]).COLUMNS:
        assert board[name].tolist() == [getattr(s, name) for s in states], name
    assert board["iid"].tolist() == [s.iid for s in states]


def test_every_write_reaches_the_board() -> None:
    r = random.Random(2)
    prefill = [PrefillState(iid=i) for i in range(6)]
    decode = [DecodeState(iid=i, capacity_tokens=10_000) for i in range(5)]
    pb, db = board_of(prefill), board_of(decode)
    for step in range(500):
        p, d = r.choice(prefill), r.choice(decode)
        op = r.random()
        if op < 0.3:
            p.enqueue(step, r.random(), r.random(), 1, 16)
        elif op < 0.5 and p.queue:
            p.pop(r.choice([None, r.choice(p.queue).rid]))
        elif op < 0.6:
            p.busy_until = r.random() * 10
        elif op < 0.7:
            p.up = d.up = r.random() < 0.8
        else:
            d.batch += 1
            d.context_tokens += r.randint(1, 100)
            d.reserved_tokens = r.randint(0, 50)
        assert board_of(prefill) is pb and board_of(decode) is db  # no rebuild needed
        _columns_match(prefill, pb)
        _columns_match(decode, db)
    assert pb["queue_len"].tolist() == [len(p.queue) for p in prefill]


def test_a_changed_list_or_binding_gets_a_new_board() -> None:
    states = [PrefillState(iid=i, busy_until=float(i)) for i in range(3)]
    first = board_of(states)
    states.append(PrefillState(iid=7, up=False))  # a new instance joins the pool
    second = board_of(states)
    assert second is not first
    _columns_match(states, second)
    assert second.row_of(7) == 3 and second.row_of(1) == 1 and second.row_of(9) == -1
    other = board_of(states[:2])  # two states bound elsewhere: this board is stale now
    assert not second.valid and other.valid
    third = board_of(states)
    assert third is not second and third.valid
    states[0].busy_until = 5.0
    assert third["busy_until"][0] == 5.0
    assert not other.valid  # rebinding took the states back


def test_the_same_list_or_a_copy_of_it_keeps_its_board() -> None:
    states = [PrefillState(iid=i) for i in range(4)]
    board = board_of(states)
    assert board_of(states) is board  # the list last asked about: no element compared
    copy = list(states)
    assert board_of(copy) is board  # another list with the same states, compared once
    assert board_of(copy) is board and board_of(states) is board
    copy.append(PrefillState(iid=9))  # the copy grows: its board is a new one
    assert board_of(copy) is not board and not board.valid


def test_live_mask_follows_up_and_down() -> None:
    states = [PrefillState(iid=i) for i in (0, 3, 70)]
    board = board_of(states)
    assert board.live_mask == 1 | 1 << 3 | 1 << 70
    states[1].up = False
    assert board.live_mask == 1 | 1 << 70
    states[1].up = True
    states[0].up = False
    assert board_of(states) is board and board.live_mask == 1 << 3 | 1 << 70
