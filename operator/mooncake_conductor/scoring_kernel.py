"""The conductor's FIFO ranking compiled (numba): the stages of :mod:`.scoring` summed
over every row of a pool's :class:`~mooncake_conductor.state.Board` at once
(:func:`rank_fifo`), or over candidate rows with the pool's aggregates given
(:func:`rank_rows`). The cost model's formulas operation for operation: tests hold the
scores equal to the stages' bit for bit, and the choices and random draws equal the
Python path's (``tests/conductor/test_kernels.py``, ``test_scoring.py``).

numba is imported on first use only (:func:`.warmup.warm_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .kernelrows import all_rows, zeros

_prefill_time: Any = None

_stats: Callable[..., int] | None = None
_rank: Callable[..., tuple[int, float]] | None = None

#: order of the cost model's constants in the array :func:`rank_fifo` reads
#: (:meth:`~mooncake_conductor.cost.CostModel.prefill_constants`)
COST_FIELDS = ("flops_a", "flops_b", "overhead", "mfu_max", "mfu_half", "peak",
               "kv_bytes_per_token", "h2d", "link")


def _compile_rank() -> tuple[Callable[..., int], Callable[..., tuple[int, float]]]:
    from numba import njit

    global _prefill_time  # a module global, not a closure cell: see kernels._compile

    @njit(cache=True, nogil=True, inline="always")
    def prefill_time(c: Any, n: int, cached: int) -> float:
        # CostModel.prefill_time(n, cached), operation for operation (tests hold the two
        # equal bit for bit)
        reused = min(max(cached, 0), n)
        new = n - reused
        if new <= 0:
            compute: float = c[2]
        else:
            a, b = c[0], c[1]
            fn, fr = float(n), float(reused)
            work = (a * fn * fn + b * fn) - (a * fr * fr + b * fr)
            mfu = c[3] * float(new) / (float(new) + c[4])
            compute = c[2] + work / (c[5] * mfu)
        load = float(max(0, cached) * np.int64(c[6])) / c[7]
        return compute if compute >= load else load

    _prefill_time = prefill_time

    @njit(cache=True, nogil=True)
    def stats(now: float, up: Any, busy_until: Any, qwork: Any, qlen: Any,
              out: Any) -> int:
        """The pool's aggregates over every row: ``out = [live, busy, waiting, first,
        second]``; returns ``j1``, the first row that frees first (-1: none up)."""
        busy = 0
        waiting = 0
        live = 0
        first = np.inf  # the earliest free time, at row j1, and the earliest of the others
        second = np.inf
        j1 = -1
        for i in range(busy_until.shape[0]):
            if not up[i]:
                continue
            live += 1
            run = busy_until[i] > now
            fifo = (busy_until[i] - now if run else 0.0) + qwork[i]
            if fifo < first:
                second = first
                first = fifo
                j1 = i
            elif fifo < second:
                second = fifo
            waiting += qlen[i]
            if qlen[i] > 0 or run:
                busy += 1
        out[0] = live
        out[1] = busy
        out[2] = waiting
        out[3] = first
        out[4] = second
        return j1

    @njit(cache=True, nogil=True)
    def rank(
        c: Any, now: float, n: int, block: int, best_len: int, best_pos: int,
        work_weight: float, shut_rate: float, slo_s: float, open_s: float, overlap: bool,
        tol: float, tol_s: float, pool: Any, j1: int, rows: Any,
        up: Any, busy_until: Any, qwork: Any, iid: Any, local: Any, score: Any,
        fetch: Any, ties: Any, topo: bool, place: Any, srcs: Any, lvl: Any, bw: Any,
        lat: Any,
    ) -> tuple[int, float]:
        live, busy, waiting, first, second = pool[0], pool[1], pool[2], pool[3], pool[4]
        n_places = lvl.shape[0]
        kappa = work_weight * (busy + waiting) / max(live, 1.0)
        if first > open_s:
            shut_rate = 0.0  # the pool saturates: every arrival queues anyway
        best_tokens = min(best_len * block, n)
        fetch_prefill = _prefill_time(c, n, best_tokens)
        on_time = False  # some priced row meets the TTFT SLO
        m = rows.shape[0]
        late = np.zeros(m, dtype=np.bool_)  # rows that break it, by position in ``rows``
        for r in range(m):
            i = rows[r]
            fetch[i] = False
            if not up[i]:
                score[i] = np.inf
                continue
            fifo = (busy_until[i] - now if busy_until[i] > now else 0.0) + qwork[i]
            held = local[iid[i]] if iid[i] < local.shape[0] else 0  # past the array: none
            held_tokens = min(held * block, n)
            recompute = _prefill_time(c, n, held_tokens)
            ttft = fifo + recompute
            used = recompute
            if best_len > held and i != best_pos:
                tokens = best_tokens - held_tokens
                if tokens <= 0:
                    transfer = 0.0
                elif topo:
                    # Topology.transfer_time from the nearest holder's place, operation
                    # for operation (an unknown or out-of-range place: the own link)
                    nbytes = float(tokens * np.int64(c[6]))
                    transfer = np.inf
                    here = place[i]
                    for s in range(srcs.shape[0]):
                        src = srcs[s]
                        lv = -1
                        if 0 <= here < n_places and 0 <= src < n_places:
                            lv = lvl[src, here]
                        t = nbytes / bw[lv + 1]
                        if lv >= 0:
                            t = lat[lv + 1] + t
                        if t < transfer:
                            transfer = t
                else:
                    transfer = float(tokens * np.int64(c[6])) / c[8]
                if overlap:
                    transfer = max(0.0, transfer - fifo)
                f_ttft = fifo + transfer + fetch_prefill
                if f_ttft < ttft:
                    ttft = f_ttft
                    used = fetch_prefill
                    fetch[i] = True
            score[i] = ttft + kappa * used
            if shut_rate > 0.0:
                free = min(second if i == j1 else first, ttft)
                if free > 0.0:
                    score[i] += shut_rate * free * free / 2.0
                late[r] = ttft > slo_s
                on_time = on_time or not late[r]
        best = np.inf
        for r in range(m):
            i = rows[r]
            if not up[i]:
                continue
            if on_time and late[r]:
                score[i] = np.inf  # the price never costs a request its own SLO
            elif score[i] < best:
                best = score[i]
        band = best * (1.0 + tol) + tol_s
        count = 0
        for r in range(m):  # a tie never pays a new copy when one that does not ties
            i = rows[r]
            if up[i] and score[i] <= band and not fetch[i]:
                ties[count] = i
                count += 1
        if count == 0:
            for r in range(m):
                i = rows[r]
                if up[i] and score[i] <= band:
                    ties[count] = i
                    count += 1
        return count, kappa

    return stats, rank


def rank_fifo(
    consts: npt.NDArray[np.float64], now: float, n: int, block: int, best_len: int,
    best_pos: int, work_weight: float, shut_rate: float, slo_s: float, open_s: float,
    overlap: bool, tol: float, tol_s: float, up: npt.NDArray[np.bool_],
    busy_until: npt.NDArray[np.float64], qwork: npt.NDArray[np.float64],
    qlen: npt.NDArray[np.int64], iid: npt.NDArray[np.int64], local: npt.NDArray[np.int64],
    score: npt.NDArray[np.float64], fetch: npt.NDArray[np.bool_], ties: npt.NDArray[np.int64],
    topo: TopoArrays | None = None,
) -> tuple[int, float]:
    """The conductor's FIFO ranking (:mod:`.policies.conductor`) over every live
    instance at once (the rows of a :class:`~mooncake_conductor.state.Board` that are
    ``up``): per row its queue (``busy_until`` past ``now`` plus ``qwork``; ``iid`` its
    instance id, ``local`` the local prefix by id), recompute-or-fetch TTFT (``fetch``
    set where fetching wins), score ``TTFT + kappa * prefill`` into ``score`` plus, with
    ``shut_rate`` above 0, the shut-out price ``shut_rate * t**2 / 2`` where ``t`` is
    when the first live row is free once this row holds the request to its TTFT, as long
    as the first row frees within ``open_s`` (and while a row meets the TTFT SLO
    ``slo_s``, the rows that break it score infinity), then
    the rows inside the tie band into ``ties`` (the ones that need no copy, if any do);
    returns their count and ``kappa``, the price of a GPU second. ``best_pos`` is the
    row of the longest prefix's holder (-1: none, or not a live instance), which cannot
    fetch from itself. ``topo`` (:class:`TopoArrays`, default: a flat fleet) prices each
    row's fetch from the nearest holder's place."""
    global _stats, _rank
    if _rank is None:
        _stats, _rank = _compile_rank()
    assert _stats is not None
    pool = np.empty(POOL_FIELDS)
    j1 = _stats(now, up, busy_until, qwork, qlen, pool)
    return rank_rows(consts, now, n, block, best_len, best_pos, work_weight, shut_rate, slo_s,
                     open_s, overlap, tol, tol_s, pool, j1, all_rows(len(up)), up, busy_until,
                     qwork, iid, local, score, fetch, ties, topo)


class TopoArrays(NamedTuple):
    """What the prefill ranking reads of the fleet's topology
    (:meth:`~mooncake_conductor.topology.Topology.kernel_arrays`): each row's place, the
    places of the longest prefix's holders, the level of every pair of places, and per
    level + 1 the link's bytes per second and latency (index 0: the cost model's link)."""

    place: npt.NDArray[np.int64]
    srcs: npt.NDArray[np.int64]
    levels: npt.NDArray[np.int64]
    bw: npt.NDArray[np.float64]
    latency: npt.NDArray[np.float64]


_FLAT: dict[int, TopoArrays] = {}


def _flat_topo(m: int) -> TopoArrays:
    """Arrays of the right types for a flat fleet (the ranking does not read them)."""
    t = _FLAT.get(m)
    if t is None:
        one = np.ones(1)
        t = _FLAT[m] = TopoArrays(zeros(m), zeros(1), np.full((1, 1), -1, dtype=np.int64),
                                  one, one)
    return t


#: the pool aggregates :func:`rank_rows` reads: live rows, busy rows (running or with a
#: queue), queued requests, the earliest free time (seconds from now) and the earliest of
#: the others
POOL_FIELDS = 5


def rank_rows(
    consts: npt.NDArray[np.float64], now: float, n: int, block: int, best_len: int,
    best_pos: int, work_weight: float, shut_rate: float, slo_s: float, open_s: float,
    overlap: bool, tol: float, tol_s: float, pool: npt.NDArray[np.float64], j1: int,
    rows: npt.NDArray[np.int64], up: npt.NDArray[np.bool_],
    busy_until: npt.NDArray[np.float64], qwork: npt.NDArray[np.float64],
    iid: npt.NDArray[np.int64], local: npt.NDArray[np.int64],
    score: npt.NDArray[np.float64], fetch: npt.NDArray[np.bool_], ties: npt.NDArray[np.int64],
    topo: TopoArrays | None = None,
) -> tuple[int, float]:
    """:func:`rank_fifo` over the candidate ``rows`` only (ascending), with the pool's
    aggregates given (``pool``, :data:`POOL_FIELDS`; ``j1`` the row that frees first)
    instead of read from every row: the same formulas, so a candidate's score is the one
    the full ranking gives it; ``score`` and ``fetch`` are written at ``rows`` only, and
    the tie band is the best candidate's."""
    global _stats, _rank
    if _rank is None:
        _stats, _rank = _compile_rank()
    t = _flat_topo(len(up)) if topo is None else topo
    count, kappa = _rank(consts, now, n, block, best_len, best_pos, work_weight, shut_rate,
                         slo_s, open_s, overlap, tol, tol_s, pool, j1, rows, up, busy_until,
                         qwork, iid, local, score, fetch, ties, topo is not None, t.place,
                         t.srcs, t.levels, t.bw, t.latency)
    return int(count), float(kappa)
