"""Candidates: the few instances of a large pool worth pricing, found without a pass over
every instance.

Rule (issue 36, in the filters → scorers → picker shape of the llm-d router): on a pool
of at least ``min_pool`` instances, a prefill choice is priced over

- the holders of the longest cached prefixes of the request (the index walk yields them
  already: only instances that hold the first block are visited), the ``holders``
  longest, and
- the ``least_loaded`` instances that free first (FIFO wait ``max(busy_until, now) +
  queued work``),

and a decode choice over the ``least_loaded`` instances with the smallest predicted step
for the request that have KV room for it. Every other instance matches no more of the
prompt than the holders priced and waits at least as long as the least loaded, so the
full pass picks one of them unless the price of work, a fetch or a tie band changes the
order (measured in ``docs/results/fleet-decisions.md``: choices worse beyond the tie
band no more often than between two full passes).

How the least loaded are found: each pool keeps its rows in sorted orders, one per load
key, updated whenever a row's load changes (:class:`~.state.Board` calls
:meth:`LoadOrder.touch`): flat arrays changed in compiled code, which moves only the
entries between a row's old and new place (:mod:`.candidates_kernel`). A prefill row is
either running (busy past the last query) or free: within each set one key orders the
rows by wait exactly (``busy_until + queued work``; queued work), so the ``k`` that free
first are the first ``k`` of the two orders merged. A decode row's step is the larger of
two arms, each monotone in one key (memory: the context; compute: ``per_seq * batch +
per_ctx * context``), read by the *threshold algorithm* (Fagin, Lotem and Naor, PODS
2001) until the ``k``-th best is no worse than any unread row can be, in one compiled
pass over the two orders. The pool's aggregates the prefill price needs (live, busy and
waiting counts; the two earliest free times) are kept alongside. What is left that
grows with the pool is compiled or numpy work over one array per pool (the walk's
lengths by instance id), no Python per instance.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from .candidates_kernel import (
    decode_pick,
    decode_touch,
    order_update,
    prefill_candidates,
)
from .scoring_kernel import POOL_FIELDS

if TYPE_CHECKING:
    from .state import Board

F64Array = npt.NDArray[np.float64]
I64Array = npt.NDArray[np.int64]




class CandidatesConfig(BaseModel):
    """When and how wide decisions look at candidates instead of the whole pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="price candidates only on large pools")
    min_pool: int = Field(
        128, ge=2, description="instances in a pool from which candidates are used (below "
        "it one compiled pass over the pool is cheaper than keeping the order)")
    least_loaded: int = Field(
        8, ge=2, description="the instances that free first (prefill) or step fastest with "
        "room (decode) priced in every decision")
    holders: int = Field(
        8, ge=1, description="the holders of the longest cached prefixes priced in every "
        "prefill decision")


class _Orders:
    """``count`` sorted orders of ``(key, row)``, at most one entry per row in each, as
    arrays (:mod:`.candidates_kernel`): a change moves only the entries between a row's
    old and new place, in compiled code; order ``w`` is ``keys[w, :sizes[w]]`` with
    ``rows[w, :sizes[w]]``."""

    def __init__(self, rows: int, count: int) -> None:
        self.keys: F64Array = np.zeros((count, rows))
        self.rows: I64Array = np.zeros((count, rows), dtype=np.int64)
        self.cur: F64Array = np.full((count, rows), np.nan)  # each row's key (NaN: out)
        self.sizes: I64Array = np.zeros(count, dtype=np.int64)

    def set(self, row: int, k0: float, k1: float = math.nan, k2: float = math.nan) -> None:
        """Row ``row`` at key ``k0`` in order 0, ``k1`` in 1, ``k2`` in 2 (NaN: out)."""
        order_update(self.keys, self.rows, self.cur, self.sizes, row, k0, k1, k2)


class LoadOrder:
    """The prefill pool of a :class:`~.state.Board`, ordered by FIFO wait, with the
    aggregates the conductor's price reads. Kept current by :meth:`touch`.

    Live rows are in one of two sets: *running* (busy until a time after the last query)
    ordered by ``busy_until + queued work`` and *free* (not running) ordered by queued
    work; each order is the rows' wait order within its set, so the ``k`` that free
    first are the first ``k`` of the two merged. A running row whose end has passed
    moves to the free set at the next query (a third order sorts the running rows by
    end)."""

    #: the board columns whose writes change the order or the aggregates
    WATCHED = frozenset({"up", "busy_until", "queued_work_s", "queue_len"})

    def __init__(self, board: Board) -> None:
        cols = board.columns
        self._up = cols["up"]
        self._busy = cols["busy_until"]
        self._qwork = cols["queued_work_s"]
        self._qlen = cols["queue_len"]
        n = len(self._up)
        self._orders = _Orders(n, 3)
        self._clock = -math.inf  # the last query's time: rows ending after it run
        #: per row what the aggregates counted: (up, busy_until, queue length)
        self._seen: list[tuple[bool, float, int]] = [(False, 0.0, 0)] * n
        self.live = 0
        self.waiting = 0
        self._queued_rows = 0  # live rows with a queue
        self._idle_until: list[float] = []  # busy_until of live rows without a queue
        self._row_index = board.row_index
        # what the compiled gather writes (:func:`.candidates_kernel.prefill_candidates`)
        self._wait: F64Array = np.empty(0)
        self._rows: I64Array = np.empty(0, dtype=np.int64)
        self._hold_len: I64Array = np.empty(0, dtype=np.int64)
        self._hold_ids: I64Array = np.empty(0, dtype=np.int64)
        self._out: I64Array = np.empty(0, dtype=np.int64)
        self._mark = np.zeros(n, dtype=np.bool_)
        self._agg: F64Array = np.empty(POOL_FIELDS)
        for row in range(n):
            self.touch(row)

    def _place(self, row: int) -> None:
        """Put the live row in the set its end puts it in (orders: run, free, end)."""
        a, q = self._busy.item(row), self._qwork.item(row)
        if a > self._clock:
            self._orders.set(row, a + q, math.nan, a)
        else:
            self._orders.set(row, math.nan, q, math.nan)

    def touch(self, row: int) -> None:
        """Row ``row``'s load (up, busy until, queued work or queue length) changed."""
        up, a, qlen = bool(self._up.item(row)), self._busy.item(row), self._qlen.item(row)
        seen = self._seen[row]
        if seen == (up, a, qlen):  # the aggregates stand; the queued work may have moved
            if up:
                self._place(row)
            return
        was_up, was_a, was_qlen = seen
        if was_up:
            self.live -= 1
            self.waiting -= was_qlen
            if was_qlen:
                self._queued_rows -= 1
            else:
                idle = self._idle_until
                del idle[bisect_right(idle, was_a) - 1]
        self._seen[row] = (up, a, qlen)
        if not up:
            self._orders.set(row, math.nan, math.nan, math.nan)
            return
        self.live += 1
        self.waiting += qlen
        if qlen:
            self._queued_rows += 1
        else:
            insort(self._idle_until, a)
        self._place(row)

    def busy(self, now: float) -> int:
        """Live rows running at ``now`` or with a queue."""
        idle = self._idle_until
        return self._queued_rows + len(idle) - bisect_right(idle, now)

    def candidates(self, now: float, k: int, local: I64Array, holders: int,
                   ) -> tuple[I64Array, I64Array, F64Array, int]:
        """The rows worth pricing: the ``k`` live rows that free first, in order (ties by
        row; the first ``k`` of each set hold them, each set being in wait order, once
        the rows whose end has passed by ``now`` have moved to the free set), and the
        ``holders`` instances with the longest prefix in ``local`` (by instance id; ties:
        the lower id) that are up. Returns the first, the union of both ascending, the
        :data:`~.scoring_kernel.POOL_FIELDS` aggregates for
        :func:`~.scoring_kernel.rank_rows` and the row that frees first (-1: none); the
        arrays are views, valid until the next call."""
        advance = now > self._clock
        if advance:
            self._clock = now
        if len(self._wait) < 2 * k or len(self._hold_ids) != holders:
            self._wait, self._rows = np.empty(2 * k), np.empty(2 * k, dtype=np.int64)
            self._hold_len = np.empty(holders, dtype=np.int64)
            self._hold_ids = np.empty(holders, dtype=np.int64)
            self._out = np.empty(2 * k + holders, dtype=np.int64)
        agg = self._agg
        agg[0], agg[1], agg[2] = self.live, self.busy(now), self.waiting
        o = self._orders
        first, count = prefill_candidates(
            o.keys, o.rows, o.cur, o.sizes, self._busy, self._qwork, now, advance, k,
            self._wait, self._rows, local, self._row_index, self._up, holders,
            self._hold_len, self._hold_ids, self._mark, self._out, agg)
        least = self._rows[:first]
        return least, self._out[:count], agg, int(least[0]) if first else -1


class DecodeOrder:
    """The decode pool of a :class:`~.state.Board`, ordered by the two arms of its
    predicted step (:meth:`~.cost.CostModel.decode_step_time`: the larger of reading
    weights and KV, which grows with the context, and the batch's FLOPs, which grow with
    ``per_seq * batch + per_ctx * context``), the requests sent ahead counted
    (:meth:`ahead`). Kept current by :meth:`touch`."""

    WATCHED = frozenset({"up", "batch", "context_tokens"})

    def __init__(self, board: Board, consts: list[float]) -> None:
        cols = board.columns
        self._up = cols["up"]
        self._batch = cols["batch"]
        self._context = cols["context_tokens"]
        self._reserved = cols["reserved_tokens"]
        self._capacity = cols["capacity_tokens"]
        #: the cost model's decode constants (:data:`~.decode_kernel.DECODE_FIELDS` order)
        self._consts: F64Array = np.array(consts, dtype=np.float64)
        self.per_seq, self.per_ctx = consts[3], consts[4]
        n = len(self._up)
        #: the selector whose requests sent ahead :meth:`ahead` counts (one per pool)
        self.owner: object = None
        self.ahead_n = np.zeros(n, dtype=np.int64)
        self.ahead_tokens = np.zeros(n, dtype=np.int64)
        self._orders = _Orders(n, 2)
        # scratch of the compiled pick (:func:`.candidates_kernel.decode_pick`)
        self._scratch = (np.zeros(n, dtype=np.bool_), np.empty(n), np.empty(n, dtype=np.int64),
                         np.empty(n, dtype=np.bool_))
        self._out: I64Array = np.empty(max(n, 1), dtype=np.int64)
        for row in range(n):
            self.touch(row)

    def touch(self, row: int) -> None:
        """Row ``row``'s batch, context or ``up`` changed."""
        self.ahead(row, 0, 0)

    def ahead(self, row: int, requests: int, tokens: int) -> None:
        """``requests`` more (or fewer) requests of ``tokens`` prompt tokens in all were
        sent to ``row`` ahead of their prefill."""
        o = self._orders
        decode_touch(o.keys, o.rows, o.cur, o.sizes, self._up, self._batch, self._context,
                     self.ahead_n, self.ahead_tokens, self.per_seq, self.per_ctx, row,
                     requests, tokens)

    def candidates(self, k: int, tokens: int, need: int) -> I64Array | None:
        """The rows worth pricing for a request of ``tokens`` prompt tokens that needs
        ``need`` tokens of KV: the ``k`` with the smallest step that have room for it,
        or the fastest one when none has (the answer then); ``None`` when no row is
        up. The step is the cost model's (:meth:`~.cost.CostModel.decode_step_time`).

        Read in batches: the first ``m`` of both orders (``m = k``, doubling); done when
        ``k`` rows with room step no slower than any row past both prefixes could (the
        threshold algorithm's stopping rule, Fagin, Lotem and Naor, PODS 2001: such a
        row's context and flops keys are at least the ``m``-th of each order)."""
        o = self._orders
        count = decode_pick(o.keys, o.rows, o.sizes, self._batch, self._context,
                            self._reserved, self._capacity, self.ahead_n, self.ahead_tokens,
                            self._consts, k, tokens, need, self._scratch, self._out)
        if not count:
            return None
        out: I64Array = self._out[:count].copy()
        return out


def order_of(board: Board, make: Callable[[Board], Any]) -> Any:
    """The board's load order, made by ``make(board)`` on first use (:class:`LoadOrder`
    or a :class:`DecodeOrder`); the board keeps it current from then on."""
    order = board.order
    if order is None:
        order = board.order = make(board)
    return order
