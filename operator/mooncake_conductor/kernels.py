"""Compiled (numba) inner loops of the core: block keys, prefix matching over a
large index, and applying batches of changes to the index's mirror.

**Block keys** (:func:`chain_keys`): the same chain as
:func:`mooncake_conductor.blockkeys.block_keys_reference`, one block at a time
(``S = sum_j (token_j + 1) * P^(B-1-j)``, ``h = h * P^B + S``, key = ``mix64(h)``)
in one pass: ~8 µs for 8k tokens at block size 16 against ~18 µs for the numpy
formulation, which serves short prompts until the loop is compiled (no numba
import in a process that never sees a long prompt or warms up).

**Prefix matching** (:func:`walk_keys`). Rule: walk a request's keys in order,
look each one up in one or two :class:`~mooncake_conductor.keytable.KeyMaskTable`
s (holders, and pending blocks when they count), AND its mask into the running
set of instances still matching, record every drop (position, set before, set
after) and stop as soon as the set is empty. Every key's home row is touched
first in a separate loop (independent loads the CPU overlaps), then the walk
runs mostly from cache; no Python object is made per key. A key its home
bucket does not hold is looked for in its overflow bucket and the (sorted)
stash only when the home has sent keys away, so the walk never returns to
Python. ~20 µs for a cold 8k-token prompt against a million-block index, where
a numpy formulation pays ~30 array operations (~60 µs) and a Python dict walk a
dependent cache miss per key (~110 µs). Masks of one 64-bit word (up to 64
instance ids) take the lean walk; past that the tables hold holder-set ids
(:mod:`mooncake_conductor.holdersets`) and :func:`walk_lengths_sets` reads the sets'
words only where the holders change.
:func:`walk_lengths` runs the conductor's two walks (stored blocks; stored or
pending blocks) in the same pass, probes the pending table only while an
instance left could hold a key there alone, and writes each instance's match
length straight into an array by id. Touching the home rows ahead of the walk
in one pass beats touching them a fixed distance ahead of it (measured: the
walk's branches keep the rolling loads from overlapping).

**Rankings** (:func:`rank_fifo`, :func:`rank_decode`): the conductor's prefill
pricing and the ``tbt-slo`` decode pricing over every instance of a pool at
once, reading the pool's :class:`~mooncake_conductor.state.Board` columns; the
cost model's formulas operation for operation (tests hold them equal bit for
bit, and the choices and random draws equal the Python pricing's).

**Upsert** (:func:`upsert_keys`): set, replace or delete each key's mask in one
pass (home bucket, else overflow bucket with the home's count kept exact); the
few keys with no room or in the stash go back to Python.

numba is imported on first use only; :func:`mooncake_conductor.warmup.warm_up`
compiles everything (or loads it from numba's cache) up front, as the gateway does at
startup. The key table's layout (slots per bucket, the hashes' multipliers) comes from
:mod:`mooncake_conductor.tablehash`, which :mod:`~mooncake_conductor.keytable` shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .tablehash import H1, H2, SLOTS

U64Array = npt.NDArray[np.uint64]

_kernel: Callable[..., tuple[int, int, int]] | None = None
_views: Callable[..., tuple[int, int, Any]] | None = None
#: compiled helpers the kernels call (set by the functions that compile them)
_probe: Any = None
_settle: Any = None
_prefill_time: Any = None

#: one table as the walk reads it: rows, per-bucket overflow counts, ``[hash shift,
#: mask of key 0]`` and the stash as a key-sorted ``(n, 2)`` array of (key, mask)
TableView = tuple[U64Array, Any, U64Array, U64Array]


def _compile() -> tuple[Callable[..., tuple[int, int, int]],
                        Callable[..., tuple[int, int, Any]]]:
    from numba import njit  # heavy import, deferred to the first large index

    # the helpers the kernels call are module globals, not closure cells: numba keys its
    # cache on the pickled closure, and a dispatcher pickles differently in every
    # process, so a kernel closing over one was compiled again by every process
    global _probe, _settle
    h1, h2 = np.uint64(H1), np.uint64(H2)
    slots = SLOTS

    @njit(cache=True, nogil=True, inline="always")
    def probe(rows: Any, over: Any, meta: Any, stash: Any, key: Any) -> Any:
        """The key's mask: home bucket; if the home sent keys away, the overflow
        bucket, then the stash; the key 0 from ``meta``."""
        if key == 0:
            return meta[1]
        b = (key * h1) >> meta[0]
        for j in range(slots):
            if rows[b, j] == key:
                return rows[b, slots + j]
        if over[b] == 0:
            return np.uint64(0)
        b = (key * h2) >> meta[0]
        for j in range(slots):
            if rows[b, j] == key:
                return rows[b, slots + j]
        if stash.shape[0]:
            at = np.searchsorted(stash[:, 0], key)
            if at < stash.shape[0] and stash[at, 0] == key:
                return stash[at, 1]
        return np.uint64(0)

    _probe = probe

    @njit(cache=True, nogil=True)
    def walk(
        rows1: Any, over1: Any, meta1: Any, stash1: Any,
        rows2: Any, over2: Any, meta2: Any, stash2: Any,
        two: bool, keys: Any, acc: Any, drops: Any,
    ) -> tuple[int, int, int]:
        dropped = 0
        n = keys.shape[0]
        # touch every key's home row first: independent loads the CPU overlaps, so the
        # walk below (a branchy loop) mostly hits cache
        sink = np.uint64(0)
        for i in range(n):
            sink ^= rows1[(keys[i] * h1) >> meta1[0], 0]
        drops[n, 0] = sink  # keeps the loads (the row past the last usable one)
        for i in range(n):
            key = keys[i]
            mask = _probe(rows1, over1, meta1, stash1, key)
            if two:
                mask |= _probe(rows2, over2, meta2, stash2, key)
            new = acc & mask
            if new != acc:
                drops[dropped, 0] = i
                drops[dropped, 1] = acc
                drops[dropped, 2] = new
                dropped += 1
                acc = new
                if acc == 0:
                    return i, acc, dropped
        return n, acc, dropped

    one, zero = np.uint64(1), np.uint64(0)

    @njit(cache=True, nogil=True, inline="always")
    def settle(gone: Any, at: int, out: Any) -> None:
        """``out[b] = at`` for every bit ``b`` of ``gone``."""
        b = 0
        while gone != zero:
            if gone & one:
                out[b] = at
            gone >>= one
            b += 1

    _settle = settle

    @njit(cache=True, nogil=True)
    def lengths(
        rows1: Any, over1: Any, meta1: Any, stash1: Any,
        rows2: Any, over2: Any, meta2: Any, stash2: Any,
        keys: Any, acc: Any, acc_p: Any, out: Any, out_p: Any,
    ) -> tuple[int, int, Any]:
        out[:] = 0
        out_p[:] = 0
        n = keys.shape[0]
        sink = zero
        if acc_p:  # both tables' home rows
            for i in range(n):
                sink ^= rows1[(keys[i] * h1) >> meta1[0], 0]
                sink ^= rows2[(keys[i] * h1) >> meta2[0], 0]
        else:
            for i in range(n):
                sink ^= rows1[(keys[i] * h1) >> meta1[0], 0]
        for i in range(n):
            key = keys[i]
            mask = _probe(rows1, over1, meta1, stash1, key)
            new = acc & mask
            if new != acc:
                _settle(acc & ~new, i, out)
                acc = new
            if acc_p & ~mask:  # else every instance left holds the key: nothing drops
                new = acc_p & (mask | _probe(rows2, over2, meta2, stash2, key))
                if new != acc_p:
                    _settle(acc_p & ~new, i, out_p)
                    acc_p = new
            if acc == zero and acc_p == zero:
                break
        _settle(acc, n, out)
        _settle(acc_p, n, out_p)
        best = 0
        for b in range(out.shape[0]):
            if out[b] > out[best]:
                best = b
        return best, out[best], sink  # returning the loads' sum keeps them

    return walk, lengths


def walk_keys(
    tables: list[TableView], keys: U64Array, acc: int, drops: U64Array
) -> tuple[int, int, int]:
    """Walk ``keys`` with running set ``acc`` over one or two tables; returns
    ``(position reached, set left, drops)`` with each drop written as a row
    ``(position, set before, set after)`` of ``drops`` (at least ``len(keys) + 1``
    rows; the last is scratch)."""
    global _kernel, _views
    if _kernel is None:
        _kernel, _views = _compile()
    second = tables[1] if len(tables) > 1 else tables[0]
    end, left, dropped = _kernel(*tables[0], *second, len(tables) > 1, keys,
                                 np.uint64(acc), drops)
    return int(end), int(left), int(dropped)


def walk_lengths(
    stored: TableView, pending: TableView, keys: U64Array, acc: int, acc_pending: int,
    out: npt.NDArray[np.int64], out_pending: npt.NDArray[np.int64],
) -> tuple[int, int]:
    """Two walks in one pass over ``keys``: ``acc`` through ``stored`` alone and
    ``acc_pending`` (0: none) through ``stored`` or ``pending``, each key's stored
    mask probed once. Writes every instance's longest prefix (blocks) into ``out`` /
    ``out_pending`` by id (at least 64 long; 0 for the rest) and returns the first
    instance with the longest stored prefix and its length."""
    global _kernel, _views
    if _views is None:
        _kernel, _views = _compile()
    best, length, _ = _views(*stored, *pending, keys, np.uint64(acc), np.uint64(acc_pending),
                             out, out_pending)
    return int(best), int(length)


_lengths_sets: Callable[..., tuple[int, int, Any]] | None = None
_settle_at: Any = None


def _compile_lengths_sets() -> Callable[..., tuple[int, int, Any]]:
    """:func:`walk_lengths` over tables whose values are holder-set ids."""
    global _kernel, _views
    if _kernel is None:  # the one-word probe and settle are compiled there
        _kernel, _views = _compile()
    from numba import njit

    global _settle_at  # a module global, not a closure cell: see _compile
    h1 = np.uint64(H1)
    one, zero = np.uint64(1), np.uint64(0)

    @njit(cache=True, nogil=True, inline="always")
    def settle_at(gone: Any, base: int, at: int, out: Any) -> None:
        """``out[base + b] = at`` for every bit ``b`` of ``gone``."""
        b = 0
        while gone != zero:
            if gone & one:
                out[base + b] = at
            gone >>= one
            b += 1

    _settle_at = settle_at

    @njit(cache=True, nogil=True)
    def lengths_sets(
        rows1: Any, over1: Any, meta1: Any, stash1: Any,
        rows2: Any, over2: Any, meta2: Any, stash2: Any,
        sets: Any, keys: Any, acc: Any, acc_p: Any, out: Any, out_p: Any, act: Any,
    ) -> tuple[int, int, Any]:
        w = acc.shape[0]
        out[:] = 0
        out_p[:] = 0
        n = keys.shape[0]
        live = 0  # words still holding an instance (either walk), listed in ``act``
        pending = False
        for k in range(w):
            if acc[k] | acc_p[k]:
                act[live] = k
                live += 1
            if acc_p[k]:
                pending = True
        sink = zero
        for i in range(n):  # every key's home rows first: loads the CPU overlaps
            sink ^= rows1[(keys[i] * h1) >> meta1[0], 0]
            if pending:
                sink ^= rows2[(keys[i] * h1) >> meta2[0], 0]
        last1 = np.uint64(0xFFFFFFFFFFFFFFFF)  # no key read yet
        last2 = last1
        covered = False  # the pending walk's instances all hold the last stored set
        for i in range(n):
            if live == 0:
                break
            key = keys[i]
            s1 = _probe(rows1, over1, meta1, stash1, key)
            if s1 == last1 and covered:
                continue  # the same holders as the key before: nothing drops
            need2 = False  # is the pending table needed (an instance of it lacks s1)?
            for j in range(live):
                k = act[j]
                if acc_p[k] & ~sets[s1, k]:
                    need2 = True
                    break
            s2 = np.uint64(0)
            if need2:
                s2 = _probe(rows2, over2, meta2, stash2, key)
                if s1 == last1 and s2 == last2:
                    continue
            last1, last2 = s1, s2
            covered = not need2
            j = 0
            while j < live:
                k = act[j]
                m1 = sets[s1, k]
                new = acc[k] & m1
                if new != acc[k]:
                    _settle_at(acc[k] & ~new, 64 * k, i, out)
                    acc[k] = new
                if need2 and acc_p[k]:
                    new = acc_p[k] & (m1 | sets[s2, k])
                    if new != acc_p[k]:
                        _settle_at(acc_p[k] & ~new, 64 * k, i, out_p)
                        acc_p[k] = new
                if acc[k] == zero and acc_p[k] == zero:
                    live -= 1
                    act[j] = act[live]
                else:
                    j += 1
        for k in range(w):
            _settle_at(acc[k], 64 * k, n, out)
            _settle_at(acc_p[k], 64 * k, n, out_p)
        best = 0
        for b in range(out.shape[0]):
            if out[b] > out[best]:
                best = b
        return best, out[best], sink

    return lengths_sets


def walk_lengths_sets(
    stored: TableView, pending: TableView, sets: U64Array, keys: U64Array, acc: U64Array,
    acc_pending: U64Array, out: npt.NDArray[np.int64], out_pending: npt.NDArray[np.int64],
) -> tuple[int, int]:
    """:func:`walk_lengths` for instance ids past 63, over tables that map each key to
    the id of its holder set (:mod:`.holdersets`), ``sets[id]`` the set's mask words
    (row 0: the empty set; ``len(acc)`` words; ``acc`` and ``acc_pending`` are used
    up): ``out`` and ``out_pending`` at least ``64 * len(acc)`` long. Each key reads
    only the words that still hold an instance, and a run of keys with the same
    holders only its set ids, so the cost follows the holders, not the fleet."""
    global _lengths_sets
    if _lengths_sets is None:
        _lengths_sets = _compile_lengths_sets()
    act = np.empty(len(acc), dtype=np.int64)
    best, length, _ = _lengths_sets(*stored, *pending, sets, keys, acc, acc_pending, out,
                                    out_pending, act)
    return int(best), int(length)


_lookup: Callable[..., None] | None = None


def lookup_values(view: TableView, keys: U64Array) -> U64Array:
    """Each key's one-word value in a table (0 where absent), in one compiled pass."""
    global _lookup, _kernel, _views
    if _lookup is None:
        if _kernel is None:
            _kernel, _views = _compile()
        from numba import njit

        @njit(cache=True, nogil=True)
        def lookup(rows: Any, over: Any, meta: Any, stash: Any, keys: Any, out: Any) -> None:
            for i in range(keys.shape[0]):
                out[i] = _probe(rows, over, meta, stash, keys[i])

        _lookup = lookup
    out = np.empty(len(keys), dtype=np.uint64)
    _lookup(*view, keys, out)
    return out


_upsert: Callable[..., int] | None = None


def _compile_upsert() -> Callable[..., int]:
    from numba import njit

    h1, h2 = np.uint64(H1), np.uint64(H2)
    slots = SLOTS

    @njit(cache=True, nogil=True)
    def upsert(
        rows: Any, over: Any, shift: Any, stash: Any, keys: Any, masks: Any, left: Any
    ) -> Any:
        """Set each key's mask (0 removes it) in place; returns the change in the number
        of stored keys and marks in ``left`` the keys left to Python: 1 found no room
        (stash them or grow), 2 sit in the stash."""
        delta = 0
        for i in range(keys.shape[0]):
            key = keys[i]
            mask = masks[i]
            home = np.int64((key * h1) >> shift)
            away = np.int64((key * h2) >> shift)
            at_b = np.int64(-1)
            at_j = 0
            for j in range(slots):
                if rows[home, j] == key:
                    at_b = home
                    at_j = j
                    break
            if at_b < 0 and over[home] != 0:
                for j in range(slots):
                    if rows[away, j] == key:
                        at_b = away
                        at_j = j
                        break
                if at_b < 0 and stash.shape[0]:
                    at = np.searchsorted(stash[:, 0], key)
                    if at < stash.shape[0] and stash[at, 0] == key:
                        left[i] = 2
                        continue
            if at_b >= 0:
                if mask != 0:
                    rows[at_b, slots + at_j] = mask
                else:
                    rows[at_b, at_j] = 0
                    rows[at_b, slots + at_j] = 0
                    delta -= 1
                    if at_b != home:
                        over[home] -= 1
                continue
            if mask == 0:
                continue
            placed = False
            for b in (home, away):
                for j in range(slots):
                    if rows[b, j] == 0:
                        rows[b, j] = key
                        rows[b, slots + j] = mask
                        placed = True
                        break
                if placed:
                    if b != home:
                        over[home] += 1
                    break
            if placed:
                delta += 1
            else:
                left[i] = 1
        return delta

    return upsert


def upsert_keys(
    rows: U64Array, over: Any, shift: np.uint64, stash: U64Array, keys: U64Array,
    masks: U64Array,
) -> tuple[int, npt.NDArray[np.int8]]:
    """Assign one-word ``masks`` to distinct non-zero ``keys``; returns the change in
    stored keys and, per key, 0 (done), 1 (no room) or 2 (in the sorted ``stash``)."""
    global _upsert
    if _upsert is None:
        _upsert = _compile_upsert()
    left = np.zeros(len(keys), dtype=np.int8)
    delta = _upsert(rows, over, shift, stash, keys, masks, left)
    return int(delta), left


_chain: Callable[..., U64Array] | None = None


def _compile_chain() -> Callable[..., U64Array]:
    from numba import njit

    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)

    @njit(cache=True, nogil=True)
    def chain(tokens: Any, block: int, weights: Any, ones: Any, q: Any, seed: Any) -> Any:
        blocks = tokens.shape[0] // block
        out = np.empty(blocks, np.uint64)
        h = seed
        for i in range(blocks):
            s = ones
            base = i * block
            for j in range(block):
                s += np.uint64(tokens[base + j]) * weights[j]
            h = h * q + s
            x = h ^ (h >> s30)
            x *= m1
            x ^= x >> s27
            x *= m2
            out[i] = x ^ (x >> s31)
        return out

    return chain


def chain_loaded() -> bool:
    """Whether the block-key loop is compiled already (then it serves every length)."""
    return _chain is not None


def chain_keys(
    tokens: U64Array, block_size: int, weights: U64Array, ones: np.uint64, q: int, seed: int
) -> U64Array:
    """Block keys of ``tokens`` (uint64) by the compiled chain; ``weights[j] =
    P^(B-1-j)``, ``ones = sum(weights)``, ``q = P^B``."""
    global _chain
    if _chain is None:
        _chain = _compile_chain()
    return _chain(tokens, block_size, weights, ones, np.uint64(q), np.uint64(seed))


_stats: Callable[..., int] | None = None
_rank: Callable[..., tuple[int, float]] | None = None
#: every row of a pool of each size, in order (what the full ranking prices)
_ALL_ROWS: dict[int, npt.NDArray[np.int64]] = {}

#: order of the cost model's constants in the array :func:`rank_fifo` reads
#: (:meth:`~mooncake_conductor.cost.CostModel.prefill_constants`)
COST_FIELDS = ("flops_a", "flops_b", "overhead", "mfu_max", "mfu_half", "peak",
               "kv_bytes_per_token", "h2d", "link")


def _compile_rank() -> tuple[Callable[..., int], Callable[..., tuple[int, float]]]:
    from numba import njit

    global _prefill_time  # a module global, not a closure cell: see _compile

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
    rows = _ALL_ROWS.get(len(up))
    if rows is None:
        rows = _ALL_ROWS[len(up)] = np.arange(len(up), dtype=np.int64)
    t = _flat_topo(len(up)) if topo is None else topo
    count, kappa = _rank(consts, now, n, block, best_len, best_pos, work_weight, shut_rate,
                         slo_s, open_s, overlap, tol, tol_s, pool, j1, rows, up, busy_until,
                         qwork, iid, local, score, fetch, ties, topo is not None, t.place,
                         t.srcs, t.levels, t.bw, t.latency)
    return int(count), float(kappa)


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
        t = _FLAT[m] = TopoArrays(_zeros(m), _zeros(1), np.full((1, 1), -1, dtype=np.int64),
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


_decode: Callable[..., tuple[int, int]] | None = None

#: order of the cost model's constants in the array :func:`rank_decode` reads
#: (:meth:`~mooncake_conductor.cost.CostModel.decode_constants`)
DECODE_FIELDS = ("weight_bytes", "kv_bytes_per_token", "hbm", "flops_per_seq",
                 "attn_flops_per_ctx", "peak", "overhead")


def _compile_decode() -> Callable[..., tuple[int, int]]:
    from numba import njit

    @njit(cache=True, nogil=True)
    def rank(
        c: Any, tokens: int, need: int, slo: float, tol: float, eps: float, rows: Any,
        up: Any, context: Any, batch: Any, ahead_n: Any, ahead_tokens: Any, reserved: Any,
        capacity: Any, step: Any, ties: Any,
    ) -> tuple[int, int]:
        kvb = np.int64(c[1])
        best = np.inf
        fastest = -1
        fits = 0  # rows within the SLO with KV room, gathered at the front of ``ties``
        for r in range(rows.shape[0]):
            i = rows[r]
            if not up[i]:
                step[i] = np.inf
                continue
            # CostModel.decode_step_time(batch + 1, context + tokens), operation for
            # operation (batch + 1 >= 1), the requests sent ahead counted in both
            here = context[i] + ahead_tokens[i]
            ctx = here + tokens
            mem = (c[0] + float(ctx * kvb)) / c[2]
            compute = (float(batch[i] + ahead_n[i] + 1) * c[3] + float(ctx) * c[4]) / c[5]
            step[i] = c[6] + (mem if mem >= compute else compute)
            if fastest < 0 or step[i] < step[fastest]:
                fastest = i
            room = capacity[i] <= 0 or here + reserved[i] + need <= capacity[i]
            if step[i] <= slo and room:
                ties[fits] = i
                fits += 1
                if step[i] < best:
                    best = step[i]
        band = best + (abs(best) * tol + eps)
        count = 0
        for j in range(fits):  # keep those inside the tie band, in order
            if step[ties[j]] <= band:
                ties[count] = ties[j]
                count += 1
        return count, fastest

    return rank


def rank_decode(
    consts: npt.NDArray[np.float64], tokens: int, need: int, slo: float, tol: float,
    eps: float, up: npt.NDArray[np.bool_], context: npt.NDArray[np.int64],
    batch: npt.NDArray[np.int64],
    reserved: npt.NDArray[np.int64], capacity: npt.NDArray[np.int64],
    step: npt.NDArray[np.float64], ties: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64] | None = None,
    ahead_n: npt.NDArray[np.int64] | None = None,
    ahead_tokens: npt.NDArray[np.int64] | None = None,
) -> tuple[int, int]:
    """The ``tbt-slo`` decode rule (:mod:`.decode`) over every live instance at once
    (the rows of a :class:`~mooncake_conductor.state.Board` that are ``up``), or over
    the candidate ``rows`` only (ascending): each one's predicted step with a request of
    ``tokens`` context added into ``step``; the rows within the SLO with ``need`` tokens
    of KV room whose step is inside the tie band (``best + (|best| * tol + eps)``) into
    ``ties``, in order. ``ahead_n`` / ``ahead_tokens`` (default none): requests already
    sent to each row that join its batch first, counted in its batch and context.
    Returns the count and the first row of the fastest instance (the answer when none
    fits; -1 when no row is up)."""
    global _decode
    if _decode is None:
        _decode = _compile_decode()
    m = len(up)
    if rows is None:
        rows = _ALL_ROWS.get(m)
        if rows is None:
            rows = _ALL_ROWS[m] = np.arange(m, dtype=np.int64)
    if ahead_n is None or ahead_tokens is None:
        ahead_n = ahead_tokens = _zeros(m)
    count, fastest = _decode(consts, tokens, need, slo, tol, eps, rows, up, context, batch,
                             ahead_n, ahead_tokens, reserved, capacity, step, ties)
    return int(count), int(fastest)


_ZEROS: dict[int, npt.NDArray[np.int64]] = {}


def _zeros(m: int) -> npt.NDArray[np.int64]:
    """A shared read-only array of ``m`` zeros."""
    z = _ZEROS.get(m)
    if z is None:
        z = _ZEROS[m] = np.zeros(m, dtype=np.int64)
        z.flags.writeable = False
    return z
