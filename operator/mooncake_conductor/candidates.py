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
prompt than these and waits at least as long, so the full scan picks one of them unless
a fetch or a tie band changes the order (measured in ``docs/results/fleet-scale.md``).

How the least loaded are found: each pool keeps two heaps per load key, updated in
``O(log n)`` whenever a row's load changes (:class:`~.state.Board` calls
:meth:`LoadOrder.touch`; an entry made stale by a later change is skipped and the heaps
are rebuilt once stale entries outnumber the rows). A prefill row's wait is
``max(a + q, now + q) - now`` (``a`` busy until, ``q`` queued work): monotone in ``a +
q`` and in ``q``, so the *threshold algorithm* (Fagin, Lotem and Naor, PODS 2001) reads
both heaps in order and stops once the ``k``-th best wait is no worse than what any
unread row could have. A decode row's step is monotone in its batch and its context (the
requests sent ahead counted), read the same way. The pool's aggregates the prefill price
needs (live, busy and waiting counts; the two earliest free times) are kept alongside:
nothing in a decision visits every instance.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right, insort
from collections.abc import Callable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from .state import Board

F64Array = npt.NDArray[np.float64]
#: a heap entry: (key, row, version of the row when pushed)
_Entry = tuple[float, int, int]
#: stale entries allowed per row (and a floor) before the heaps are rebuilt
_STALE_PER_ROW = 2
_STALE_FLOOR = 64


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


class _Heaps:
    """Heaps of ``(key, row, version)`` entries over the rows of a pool; an entry is
    live while its version is the row's (a later change pushes a new one). Read in order
    without being changed (:meth:`scan`); rebuilt once stale entries outnumber the
    rows."""

    def __init__(self, rows: int, count: int) -> None:
        self.version = [0] * rows
        self.heaps: list[list[_Entry]] = [[] for _ in range(count)]

    def bump(self, row: int) -> int:
        v = self.version[row] + 1
        self.version[row] = v
        return v

    def push(self, which: int, key: float, row: int, v: int) -> None:
        heapq.heappush(self.heaps[which], (key, row, v))

    def stale(self) -> bool:
        return sum(map(len, self.heaps)) > _STALE_PER_ROW * len(self.version) + _STALE_FLOOR

    def scan(self, which: int) -> Iterator[tuple[float, int]]:
        """Live entries of one heap as ``(key, row)`` in order: a best-first walk of the
        heap's tree (children of position ``p`` at ``2p + 1`` and ``2p + 2``)."""
        heap, version = self.heaps[which], self.version
        if not heap:
            return
        front = [(heap[0], 0)]
        size = len(heap)
        while front:
            (key, row, v), pos = heapq.heappop(front)
            for child in (2 * pos + 1, 2 * pos + 2):
                if child < size:
                    heapq.heappush(front, (heap[child], child))
            if v == version[row]:
                yield key, row


class LoadOrder:
    """The prefill pool of a :class:`~.state.Board`, ordered by FIFO wait, with the
    aggregates the conductor's price reads. Kept current by :meth:`touch`.

    Live rows are in one of two sets: *running* (busy until a time after the last query)
    ordered by ``busy_until + queued work`` and *free* (not running) ordered by queued
    work; each order is the rows' wait order within its set, so the ``k`` that free
    first are the first ``k`` of the two merged. A running row whose end has passed
    moves to the free set at the next query (a third heap orders them by end)."""

    #: the board columns whose writes change the order or the aggregates
    WATCHED = frozenset({"up", "busy_until", "queued_work_s", "queue_len"})
    _RUN, _FREE, _END = 0, 1, 2

    def __init__(self, board: Board) -> None:
        cols = board.columns
        self._up = cols["up"]
        self._busy = cols["busy_until"]
        self._qwork = cols["queued_work_s"]
        self._qlen = cols["queue_len"]
        n = len(self._up)
        self._heaps = _Heaps(n, 3)
        self._clock = -math.inf  # the last query's time: rows ending after it run
        #: per row what the aggregates counted: (up, busy_until, queue length)
        self._seen: list[tuple[bool, float, int]] = [(False, 0.0, 0)] * n
        self.live = 0
        self.waiting = 0
        self._queued_rows = 0  # live rows with a queue
        self._idle_until: list[float] = []  # busy_until of live rows without a queue
        for row in range(n):
            self.touch(row)

    def _place(self, row: int) -> None:
        """Push the live row's entries into the set its end puts it in."""
        h = self._heaps
        v = h.bump(row)
        a, q = float(self._busy[row]), float(self._qwork[row])
        if a > self._clock:
            h.push(self._RUN, a + q, row, v)
            h.push(self._END, a, row, v)
        else:
            h.push(self._FREE, q, row, v)

    def touch(self, row: int) -> None:
        """Row ``row``'s load (up, busy until, queued work or queue length) changed."""
        up, a, qlen = bool(self._up[row]), float(self._busy[row]), int(self._qlen[row])
        was_up, was_a, was_qlen = self._seen[row]
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
            self._heaps.bump(row)
            return
        self.live += 1
        self.waiting += qlen
        if qlen:
            self._queued_rows += 1
        else:
            insort(self._idle_until, a)
        self._place(row)
        if self._heaps.stale():
            self._rebuild()

    def _rebuild(self) -> None:
        self._heaps.heaps = [[] for _ in self._heaps.heaps]
        for row, (up, _, _) in enumerate(self._seen):
            if up:
                self._place(row)

    def _advance(self, now: float) -> None:
        """Rows whose end has passed by ``now`` move to the free set."""
        if now <= self._clock:
            return
        self._clock = now
        ends, version = self._heaps.heaps[self._END], self._heaps.version
        while ends and ends[0][0] <= now:
            _, row, v = heapq.heappop(ends)
            if v == version[row]:
                self._place(row)

    def busy(self, now: float) -> int:
        """Live rows running at ``now`` or with a queue."""
        idle = self._idle_until
        return self._queued_rows + len(idle) - bisect_right(idle, now)

    def least(self, now: float, k: int) -> list[tuple[float, int]]:
        """The ``k`` live rows that free first: ``(wait in seconds, row)`` in order."""
        self._advance(now)
        busy, qwork = self._busy, self._qwork
        running = ((key - now, row) for key, row in self._heaps.scan(self._RUN))
        rows = [row for _, row in islice(heapq.merge(running, self._heaps.scan(self._FREE)),
                                          k)]
        out = []
        for row in rows:
            a = float(busy[row])
            out.append(((a - now if a > now else 0.0) + float(qwork[row]), row))
        out.sort()
        return out

    def pool(self, now: float, first: list[tuple[float, int]]) -> tuple[F64Array, int]:
        """:data:`~.kernels.POOL_FIELDS` aggregates for :func:`~.kernels.rank_rows`, and
        the row that frees first, given ``first`` (:meth:`least`, at least two rows
        when the pool has two)."""
        pool: F64Array = np.array([self.live, self.busy(now), self.waiting,
                                   first[0][0] if first else math.inf,
                                   first[1][0] if len(first) > 1 else math.inf])
        return pool, first[0][1] if first else -1


class DecodeOrder:
    """The decode pool of a :class:`~.state.Board`, ordered by the two arms of its
    predicted step (:meth:`~.cost.CostModel.decode_step_time`: the larger of reading
    weights and KV, which grows with the context, and the batch's FLOPs, which grow with
    ``per_seq * batch + per_ctx * context``), the requests sent ahead counted
    (:meth:`ahead`). Kept current by :meth:`touch`."""

    WATCHED = frozenset({"up", "batch", "context_tokens"})

    def __init__(self, board: Board, per_seq: float = 1.0, per_ctx: float = 0.0) -> None:
        cols = board.columns
        self._up = cols["up"]
        self._batch = cols["batch"]
        self._context = cols["context_tokens"]
        self.per_seq, self.per_ctx = per_seq, per_ctx
        n = len(self._up)
        #: the selector whose requests sent ahead :meth:`ahead` counts (one per pool)
        self.owner: object = None
        self.ahead_n = np.zeros(n, dtype=np.int64)
        self.ahead_tokens = np.zeros(n, dtype=np.int64)
        self._heaps = _Heaps(n, 2)
        for row in range(n):
            self.touch(row)

    def load(self, row: int) -> tuple[int, int]:
        """The row's batch and context, the requests sent ahead counted."""
        return (int(self._batch[row] + self.ahead_n[row]),
                int(self._context[row] + self.ahead_tokens[row]))

    def _keys(self, row: int) -> tuple[float, float]:
        batch, context = self.load(row)
        return float(context), self.per_seq * batch + self.per_ctx * context

    def touch(self, row: int) -> None:
        """Row ``row``'s batch, context or ``up`` changed."""
        h = self._heaps
        v = h.bump(row)
        if self._up[row]:
            k1, k2 = self._keys(row)
            h.push(0, k1, row, v)
            h.push(1, k2, row, v)
            if h.stale():
                h.heaps = [[], []]
                for r in range(len(h.version)):
                    if self._up[r]:
                        self.touch(r)

    def ahead(self, row: int, requests: int, tokens: int) -> None:
        """``requests`` more (or fewer) requests of ``tokens`` prompt tokens in all were
        sent to ``row`` ahead of their prefill."""
        self.ahead_n[row] += requests
        self.ahead_tokens[row] += tokens
        self.touch(row)

    def fastest(
        self, k: int, value: Callable[[int], float], bound: Callable[[float, float], float],
        eligible: Callable[[int], bool],
    ) -> list[tuple[float, int]]:
        """The ``k`` eligible live rows with the smallest ``value`` (the step, the larger
        of its two arms), ``(value, row)`` in order. ``bound(context, flops key)`` is the
        step of a row at those keys; the threshold algorithm (Fagin, Lotem and Naor)
        reads the two orders, each time the one whose arm is the larger now, until the
        ``k``-th best is no worse than any unread row can be."""
        scans = [self._heaps.scan(0), self._heaps.scan(1)]
        fronts: list[tuple[float, int] | None] = [next(scans[0], None), next(scans[1], None)]
        seen: set[int] = set()
        found: list[tuple[float, int]] = []  # max-heap of the best k as (-value, -row)
        while fronts[0] is not None or fronts[1] is not None:
            f = [fr[0] if fr is not None else math.inf for fr in fronts]
            if len(found) >= k and -found[0][0] <= bound(f[0], f[1]):
                break  # no unread row can beat the k-th best
            arms = (bound(f[0], -math.inf), bound(-math.inf, f[1]))
            h = 0 if fronts[1] is None or (fronts[0] is not None and arms[0] >= arms[1]) else 1
            entry = fronts[h]
            assert entry is not None
            fronts[h] = next(scans[h], None)
            row = entry[1]
            if row in seen:
                continue
            seen.add(row)
            if not eligible(row):
                continue
            item = (-value(row), -row)
            if len(found) < k:
                heapq.heappush(found, item)
            elif item > found[0]:
                heapq.heapreplace(found, item)
        return sorted((-val, -neg_row) for val, neg_row in found)


def order_of(board: Board, make: Callable[[Board], Any]) -> Any:
    """The board's load order, made by ``make(board)`` on first use (:class:`LoadOrder`
    or a :class:`DecodeOrder`); the board keeps it current from then on."""
    order = board.order
    if order is None:
        order = board.order = make(board)
    return order
