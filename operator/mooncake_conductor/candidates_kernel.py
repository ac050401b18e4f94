"""The load orders of :mod:`.candidates` compiled (numba): sorted ``(key, row)`` arrays
updated in place, and the decode candidates read from them.

An order is one row of three arrays: ``keys`` and ``rows`` sorted by ``(key, row)``
over its first ``sizes[w]`` places, and ``cur[w, row]``, the row's key there (NaN: not
in it). A change finds the old and the new place by binary search and moves only the
entries between them, so a pool of thousands costs a few microseconds per change, with
no Python object per entry to chase through memory on the decision's path.

numba is imported on first use only (:func:`.warmup.warm_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

F64Array = npt.NDArray[np.float64]
I64Array = npt.NDArray[np.int64]


class _Kernels(NamedTuple):
    """The compiled calls this module's functions dispatch to."""

    update: Callable[..., None]
    pick: Callable[..., int]
    gather: Callable[..., tuple[int, int]]
    touch: Callable[..., None]


_loaded: _Kernels | None = None
_locate: Any = None
_update_row: Any = None
_least_rows: Any = None


def _compile() -> tuple[Callable[..., None], Callable[..., int]]:
    from numba import njit

    global _locate, _update_row, _least_rows  # module globals, not closure cells: see
    # kernels._compile

    @njit(cache=True, nogil=True, inline="always")
    def locate(keys: Any, rows: Any, size: int, key: float, row: int) -> int:
        """The first place whose entry is not below ``(key, row)``."""
        lo, hi = 0, size
        while lo < hi:
            mid = (lo + hi) >> 1
            k = keys[mid]
            if k < key or (k == key and rows[mid] < row):
                lo = mid + 1
            else:
                hi = mid
        return lo

    _locate = locate

    @njit(cache=True, nogil=True)
    def update(keys: Any, rows: Any, cur: Any, sizes: Any, row: int, k0: float, k1: float,
               k2: float) -> None:
        """Row ``row`` at key ``k0`` in order 0, ``k1`` in order 1, ``k2`` in order 2 (as
        many as there are orders; NaN: out of that order)."""
        for w in range(keys.shape[0]):
            key = k0 if w == 0 else k1 if w == 1 else k2
            old = cur[w, row]
            if old == key or (np.isnan(old) and np.isnan(key)):
                continue
            ks, rs = keys[w], rows[w]
            size = sizes[w]
            if np.isnan(key):  # leaves the order: the entries after it move up one
                i = _locate(ks, rs, size, old, row)
                for t in range(i, size - 1):
                    ks[t] = ks[t + 1]
                    rs[t] = rs[t + 1]
                sizes[w] = size - 1
            elif np.isnan(old):  # joins it: the entries from its place move down one
                j = _locate(ks, rs, size, key, row)
                for t in range(size, j, -1):
                    ks[t] = ks[t - 1]
                    rs[t] = rs[t - 1]
                ks[j] = key
                rs[j] = row
                sizes[w] = size + 1
            else:  # moves: only the entries between its old and new place shift
                i = _locate(ks, rs, size, old, row)
                j = _locate(ks, rs, size, key, row)
                if j > i:
                    for t in range(i, j - 1):
                        ks[t] = ks[t + 1]
                        rs[t] = rs[t + 1]
                    j -= 1
                else:
                    for t in range(i, j, -1):
                        ks[t] = ks[t - 1]
                        rs[t] = rs[t - 1]
                ks[j] = key
                rs[j] = row
            cur[w, row] = key

    _update_row = update

    @njit(cache=True, nogil=True)
    def least(keys: Any, rows: Any, cur: Any, sizes: Any, busy: Any, qwork: Any, now: float,
              advance: bool, k: int, wait: Any, out: Any) -> int:
        """The rows that free first (:func:`prefill_candidates`) over orders 0
        (running, by ``busy_until + queued work``), 1 (free, by queued work) and 2
        (running, by end): with ``advance``, the running rows whose end has passed by
        ``now`` move to the free order first; then the ``k`` rows that free first,
        ``(wait, row)`` ascending, in ``wait`` and ``out``; returns how many."""
        if advance:
            while sizes[2] > 0 and keys[2, 0] <= now:
                row = rows[2, 0]
                _update_row(keys, rows, cur, sizes, row, np.nan, qwork[row], np.nan)
        n = 0
        for w in range(2):
            stop = k if k < sizes[w] else sizes[w]
            for t in range(stop):
                row = rows[w, t]
                a = busy[row]
                wait[n] = (a - now if a > now else 0.0) + qwork[row]
                out[n] = row
                n += 1
        for i in range(1, n):  # (wait, row) ascending: at most 2k entries
            w_, r_ = wait[i], out[i]
            j = i - 1
            while j >= 0 and (wait[j] > w_ or (wait[j] == w_ and out[j] > r_)):
                wait[j + 1] = wait[j]
                out[j + 1] = out[j]
                j -= 1
            wait[j + 1] = w_
            out[j + 1] = r_
        return k if n > k else n

    _least_rows = least

    @njit(cache=True, nogil=True)
    def pick(keys: Any, rows: Any, sizes: Any, batch: Any, context: Any, reserved: Any,
             capacity: Any, ahead_n: Any, ahead_t: Any, consts: Any, k: int, tokens: int,
             need: int, seen: Any, steps: Any, cand: Any, room: Any, out: Any) -> int:
        """:meth:`.candidates.DecodeOrder.candidates` over orders 0 (context) and 1
        (flops): the rows chosen, ascending, in ``out``; returns their count (0: no row
        up). ``seen`` is scratch, all False on entry and on return; ``steps``, ``cand``
        and ``room`` are scratch of the pool's size."""
        weights, kvb, hbm = consts[0], consts[1], consts[2]
        per_seq, per_ctx, peak, overhead = consts[3], consts[4], consts[5], consts[6]
        total = sizes[0]
        if total == 0:
            return 0
        mem_base = weights + tokens * kvb
        cmp_base = per_seq + tokens * per_ctx
        scored = 0
        start, m = 0, k
        while True:
            stop = m if m < total else total
            for w in range(2):
                for t in range(start, stop):
                    row = rows[w, t]
                    if seen[row]:
                        continue
                    seen[row] = True
                    b = batch[row] + ahead_n[row]
                    c = context[row] + ahead_t[row]
                    mem = (mem_base + c * kvb) / hbm
                    compute = (per_seq * b + per_ctx * c + cmp_base) / peak
                    cap = capacity[row]
                    steps[scored] = overhead + (mem if mem >= compute else compute)
                    cand[scored] = row
                    room[scored] = cap <= 0 or c + reserved[row] + need <= cap
                    scored += 1
            if m >= total:
                break
            fits = 0
            kth = np.inf  # the k-th smallest (step, row) of the rows with room
            if scored >= k:
                fit_steps = np.empty(scored)
                for s in range(scored):
                    if room[s]:
                        fit_steps[fits] = steps[s]
                        fits += 1
                if fits >= k:
                    kth = np.sort(fit_steps[:fits])[k - 1]
            if fits >= k:
                f0, f1 = keys[0, m], keys[1, m]
                mem = (mem_base + f0 * kvb) / hbm
                compute = (f1 + cmp_base) / peak
                if kth <= overhead + (mem if mem >= compute else compute):
                    break
            start, m = m, 2 * m
        for s in range(scored):
            seen[cand[s]] = False
        fits = 0
        for s in range(scored):
            if room[s]:
                fits += 1
        if fits:
            order = np.empty(fits, dtype=np.int64)
            f = 0
            for s in range(scored):
                if room[s]:
                    order[f] = s
                    f += 1
            # (step, row) ascending: rows break ties, as the sort of tuples does
            by = np.argsort(cand[order], kind="mergesort")
            order = order[by]
            order = order[np.argsort(steps[order], kind="mergesort")]
            count = k if fits > k else fits
            chosen = np.sort(cand[order[:count]])
            for s in range(count):
                out[s] = chosen[s]
            return count
        best = 0  # none has room: the fastest of all, the lowest row on ties
        for s in range(1, scored):
            if steps[s] < steps[best] or (steps[s] == steps[best] and cand[s] < cand[best]):
                best = s
        out[0] = cand[best]
        return 1

    return update, pick


def _compile_whole() -> tuple[Callable[..., tuple[int, int]], Callable[..., None]]:
    """The calls that do a whole step of :mod:`.candidates` in one dispatch."""
    from numba import njit

    @njit(cache=True, nogil=True)
    def gather(keys: Any, rows: Any, cur: Any, sizes: Any, busy: Any, qwork: Any, now: float,
               advance: bool, k: int, wait: Any, least: Any, local: Any, row_index: Any,
               up: Any, holders: int, hold_len: Any, hold_ids: Any, mark: Any, out: Any,
               agg: Any) -> tuple[int, int]:
        """:func:`prefill_candidates`: the ``k`` rows that free first (``wait`` and
        ``least``), the ``holders`` ids with the longest ``local`` prefix (ties: the
        lower id) mapped to rows by ``row_index`` and kept if ``up``, their union
        ascending in ``out``, and ``agg[3:5]`` the two earliest waits; returns the
        count of the first and of the union. ``mark`` is scratch, all False on entry
        and on return."""
        n_least = _least_rows(keys, rows, cur, sizes, busy, qwork, now, advance, k, wait,
                              least)
        held = 0  # hold_ids[:held] by (length descending, id ascending)
        for iid in range(local.shape[0]):
            v = local[iid]
            if v == 0 or (held == holders and v <= hold_len[held - 1]):
                continue
            j = held if held < holders else holders - 1
            while j > 0 and hold_len[j - 1] < v:
                hold_len[j] = hold_len[j - 1]
                hold_ids[j] = hold_ids[j - 1]
                j -= 1
            hold_len[j] = v
            hold_ids[j] = iid
            if held < holders:
                held += 1
        count = 0
        for t in range(n_least):
            row = least[t]
            mark[row] = True
            out[count] = row
            count += 1
        for t in range(held):
            iid = hold_ids[t]
            row = row_index[iid] if iid < row_index.shape[0] else -1
            if row >= 0 and up[row] and not mark[row]:
                mark[row] = True
                out[count] = row
                count += 1
        for t in range(count):
            mark[out[t]] = False
        out[:count].sort()
        agg[3] = wait[0] if n_least > 0 else np.inf
        agg[4] = wait[1] if n_least > 1 else np.inf
        return n_least, count

    @njit(cache=True, nogil=True)
    def touch(keys: Any, rows: Any, cur: Any, sizes: Any, up: Any, batch: Any, context: Any,
              ahead_n: Any, ahead_t: Any, per_seq: float, per_ctx: float, row: int,
              requests: int, tokens: int) -> None:
        """:func:`decode_touch`."""
        ahead_n[row] += requests
        ahead_t[row] += tokens
        if up[row]:
            b = batch[row] + ahead_n[row]
            c = context[row] + ahead_t[row]
            _update_row(keys, rows, cur, sizes, row, float(c), per_seq * b + per_ctx * c,
                        np.nan)
        else:
            _update_row(keys, rows, cur, sizes, row, np.nan, np.nan, np.nan)

    return gather, touch


def _kernels() -> _Kernels:
    """Every compiled call of this module, compiled (or loaded from numba's cache) on first
    use: the order kernels first, since the whole-step calls inline them."""
    global _loaded
    if _loaded is None:
        update, pick = _compile()
        gather, touch = _compile_whole()
        _loaded = _Kernels(update, pick, gather, touch)
    return _loaded


def order_update(keys: F64Array, rows: I64Array, cur: F64Array, sizes: I64Array, row: int,
                 k0: float, k1: float = np.nan, k2: float = np.nan) -> None:
    """Put ``row`` at key ``k0`` in order 0, ``k1`` in order 1 and ``k2`` in order 2 (NaN:
    out of that order; orders past ``len(keys)`` are ignored)."""
    _kernels().update(keys, rows, cur, sizes, row, k0, k1, k2)


def decode_pick(keys: F64Array, rows: I64Array, sizes: I64Array, batch: I64Array,
                context: I64Array, reserved: I64Array, capacity: I64Array,
                ahead_n: I64Array, ahead_t: I64Array, consts: F64Array, k: int, tokens: int,
                need: int, scratch: tuple[npt.NDArray[np.bool_], F64Array, I64Array,
                                          npt.NDArray[np.bool_]],
                out: I64Array) -> int:
    """The decode candidates (:meth:`.candidates.DecodeOrder.candidates`) into ``out``;
    returns how many (0: no row up)."""
    seen, steps, cand, room = scratch
    return int(_kernels().pick(keys, rows, sizes, batch, context, reserved, capacity,
                               ahead_n, ahead_t, consts, k, tokens, need, seen, steps, cand,
                               room, out))


def prefill_candidates(keys: F64Array, rows: I64Array, cur: F64Array, sizes: I64Array,
                       busy: F64Array, qwork: F64Array, now: float, advance: bool, k: int,
                       wait: F64Array, least: I64Array, local: I64Array, row_index: I64Array,
                       up: npt.NDArray[np.bool_], holders: int, hold_len: I64Array,
                       hold_ids: I64Array, mark: npt.NDArray[np.bool_], out: I64Array,
                       agg: F64Array) -> tuple[int, int]:
    """The prefill candidates in one compiled call: the ``k`` rows of a prefill load
    order that free first, ``(wait, row)`` ascending, into ``wait`` and ``least`` (both
    at least ``2 * k`` long; with ``advance``, the rows whose end has passed by ``now``
    first move from running to free); the ``holders`` instance ids with the longest
    prefix in ``local`` (by id; ties: the lower id), mapped to rows by ``row_index``
    (-1: none) and kept where ``up``; the union of both, ascending, in ``out``; the two
    earliest waits in ``agg[3]`` and ``agg[4]`` (infinity where none). ``hold_len`` and
    ``hold_ids`` are ``holders`` long, ``mark`` all False and as long as ``up``, ``out``
    at least ``2 * k + holders``. Returns how many rows free first and how many
    candidates."""
    n_least, count = _kernels().gather(keys, rows, cur, sizes, busy, qwork, now, advance,
                                       k, wait, least, local, row_index, up, holders,
                                       hold_len, hold_ids, mark, out, agg)
    return int(n_least), int(count)


def decode_touch(keys: F64Array, rows: I64Array, cur: F64Array, sizes: I64Array,
                 up: npt.NDArray[np.bool_], batch: I64Array, context: I64Array,
                 ahead_n: I64Array, ahead_t: I64Array, per_seq: float, per_ctx: float,
                 row: int, requests: int, tokens: int) -> None:
    """A decode order's row after a change (:meth:`.candidates.DecodeOrder.touch`), with
    ``requests`` and ``tokens`` more sent ahead of it first (0, 0: none): keyed in order
    0 by its context and in order 1 by ``per_seq * batch + per_ctx * context``, the
    requests sent ahead counted; out of both when not ``up``. One dispatch."""
    _kernels().touch(keys, rows, cur, sizes, up, batch, context, ahead_n, ahead_t, per_seq,
                     per_ctx, row, requests, tokens)
