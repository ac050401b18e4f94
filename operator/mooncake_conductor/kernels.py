"""Compiled (numba) inner loops of the prefix index: prefix matching over a large
index, look-ups, and applying batches of changes to the index's mirror. The other
kernels sit beside their Python twins: :mod:`.blockkeys_kernel`, :mod:`.scoring_kernel`
(the conductor's ranking) and :mod:`.decode_kernel`.

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
from typing import Any

import numpy as np
import numpy.typing as npt

from .tablehash import H1, H2, SLOTS

U64Array = npt.NDArray[np.uint64]

_kernel: Callable[..., tuple[int, int, int]] | None = None
_views: Callable[..., tuple[int, int, Any]] | None = None
#: compiled helpers the kernels call (set by the functions that compile them)
_probe: Any = None
_settle: Any = None

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
_settle_best: Any = None


def _compile_lengths_sets() -> Callable[..., tuple[int, int, Any]]:
    """:func:`walk_lengths` over tables whose values are holder-set ids."""
    global _kernel, _views
    if _kernel is None:  # the one-word probe and settle are compiled there
        _kernel, _views = _compile()
    from numba import njit

    global _settle_at, _settle_best  # module globals, not closure cells: see _compile
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

    @njit(cache=True, nogil=True, inline="always")
    def settle_best(gone: Any, base: int, at: int, out: Any, best: int,
                    best_len: int) -> tuple[int, int]:
        """:func:`settle_at`, keeping ``(best, best_len)`` the lowest id settled at the
        longest position so far (no pass over ``out`` afterwards)."""
        b = 0
        while gone != zero:
            if gone & one:
                out[base + b] = at
                if at > best_len or (at == best_len and base + b < best):
                    best, best_len = base + b, at
            gone >>= one
            b += 1
        return best, best_len

    _settle_best = settle_best

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
        best = 0  # the lowest id with the longest stored prefix, and its length
        length = 0
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
                    if i:  # dropped at the first key: 0, as written above
                        best, length = _settle_best(acc[k] & ~new, 64 * k, i, out, best,
                                                   length)
                    acc[k] = new
                if need2 and acc_p[k]:
                    new = acc_p[k] & (m1 | sets[s2, k])
                    if new != acc_p[k]:
                        if i:
                            _settle_at(acc_p[k] & ~new, 64 * k, i, out_p)
                        acc_p[k] = new
                if acc[k] == zero and acc_p[k] == zero:
                    live -= 1
                    act[j] = act[live]
                else:
                    j += 1
        for k in range(w):
            if n:
                best, length = _settle_best(acc[k], 64 * k, n, out, best, length)
                _settle_at(acc_p[k], 64 * k, n, out_p)
        return best, length, sink

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
