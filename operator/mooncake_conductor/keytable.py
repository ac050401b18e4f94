"""A vectorised map from 64-bit block keys to instance bitmasks.

Rule: bucketed hashing with a second choice. Every key has a home bucket and
an overflow bucket (two multiplicative hashes), each of :data:`SLOTS` slots; a
bucket's row holds its slots' keys *and* masks side by side, so one row (one
cache line for up to 64 instances) answers a key. A new key goes home when
there is room, else to its overflow bucket, and the home bucket counts the keys
it sent away (decremented when they leave, so the count stays exact under
churn); the few keys that find both buckets full wait in a small stash (a dict,
at most ``capacity >> STASH_SHIFT`` of them), and the table doubles when the
stash is full or it passes :data:`MAX_LOAD`. A miss at home is final unless the
home's count is non-zero. Deleting a key just empties its slot.

Queries: the compiled walks of :mod:`mooncake_conductor.kernels` read the rows
directly, with no per-key Python work (a Python ``dict`` pays a dependent cache
miss per key, one after another); :meth:`KeyMaskTable.mask_of` answers one key.
Batches of one-word masks are applied by a compiled upsert
(:func:`.kernels.upsert_keys`) from :data:`COMPILED_MIN_BATCH` keys, the rest by
vectorised numpy (the index's mirror holds one word a key: masks, or holder-set ids);
Python ints become mask rows in bulk (:func:`masks_to_words`).

Masks are ``words`` unsigned 64-bit words (bit ``i`` of the mask is bit
``i % 64`` of word ``i // 64``); a zero mask means "no holder" and the key
leaves. Slot key 0 marks an empty slot, so the key 0 itself is kept aside.

This table mirrors :attr:`mooncake_conductor.index.PrefixIndex.holders` (and its
pending blocks) for the vectorised queries; the dicts stay the source of truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import and_
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .kernels import upsert_keys
from .tablehash import H1, H2
from .tablehash import SLOTS as SLOTS  # part of this module's interface too

MAX_LOAD = 0.4  #: keys per slot before the table doubles (keeps overflows rare)
WORD_BITS = 64
MIN_BUCKETS_LOG2 = 4
STASH_SHIFT = 10  #: the stash holds up to capacity / 2**STASH_SHIFT keys
MIN_STASH = 64
_H1 = np.uint64(H1)  # the two hashes' odd multipliers (.tablehash)
_H2 = np.uint64(H2)
_H1_INT = H1
_H2_INT = H2
#: batches from this many keys (one-word masks) are assigned by a compiled loop
COMPILED_MIN_BATCH = 64
_MASK64 = (1 << WORD_BITS) - 1
_CACHE_LINE = 64

U64Array = npt.NDArray[np.uint64]
IntpArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]


def as_key_array(keys: Sequence[int] | npt.NDArray[Any]) -> U64Array:
    """Keys as a uint64 array (no copy when they already are one)."""
    if isinstance(keys, np.ndarray):
        return keys if keys.dtype == np.uint64 else keys.astype(np.uint64)
    return np.fromiter(keys, dtype=np.uint64, count=len(keys))


def mask_to_words(mask: int, words: int) -> U64Array:
    """A non-negative Python int mask as ``words`` uint64 words (low word first)."""
    return np.array(
        [(mask >> (WORD_BITS * w)) & _MASK64 for w in range(words)], dtype=np.uint64
    )


def masks_to_words(masks: Sequence[int], words: int) -> U64Array:
    """Many masks at once: an ``(n, words)`` array whose row ``i`` is
    ``mask_to_words(masks[i], words)``, higher words cut and negative ints in two's
    complement alike. Each int is written as ``8 * words`` little-endian bytes by
    ``int.to_bytes`` (called from C, no Python frame per mask) into one buffer that numpy
    reads as it is: ~0.3-0.4 µs a 16-word mask, where :func:`mask_to_words` takes ~7.
    Non-negative masks that fit are the index's case; others take a second pass."""
    size = 8 * words
    little: repeat[Literal["little"]] = repeat("little")
    try:
        raw = bytearray().join(map(int.to_bytes, masks, repeat(size), little))
    except OverflowError:  # wider than ``words`` or negative: cut as mask_to_words does
        cut = (1 << (8 * size)) - 1
        raw = bytearray().join(map(int.to_bytes, map(and_, masks, repeat(cut)),
                                   repeat(size), little))
    out: U64Array = np.frombuffer(raw, dtype="<u8").reshape(len(masks), size // 8)
    return out.astype(np.uint64, copy=False)  # native order (no copy on little-endian)


def words_to_mask(row: U64Array) -> int:
    """Inverse of :func:`mask_to_words`."""
    out = 0
    for w, v in enumerate(row.tolist()):
        out |= int(v) << (WORD_BITS * w)
    return out


class KeyMaskTable:
    """uint64 key → bitmask table: batch assignment here, queries by the compiled walks
    of :mod:`mooncake_conductor.kernels` (and :meth:`mask_of` for one key)."""

    def __init__(self, words: int = 1, buckets_log2: int = MIN_BUCKETS_LOG2) -> None:
        self.words = max(1, words)
        self.count = 0  # keys stored in the rows (key 0 excluded)
        self._zero = np.zeros(self.words, dtype=np.uint64)  # mask of key 0
        self._alloc(max(MIN_BUCKETS_LOG2, buckets_log2))

    def _alloc(self, log2: int) -> None:
        self._log2 = log2
        self._shift = np.uint64(WORD_BITS - log2)
        n = 1 << log2
        # row = SLOTS keys, then SLOTS masks of ``words`` words each; rows start on a
        # cache line so that a one-word row is one line
        self._rows = _aligned_zeros(n, SLOTS * (1 + self.words))
        # per bucket: how many keys whose home it is live elsewhere (overflow bucket or
        # stash); 0 means a miss at home is final
        self._overflowed = np.zeros(n, dtype=np.uint32)
        self._stash: dict[int, U64Array] = {}  # key -> mask words, both buckets were full
        self._stash_view: U64Array | None = None  # the stash sorted, for the compiled walk
        self._meta: U64Array | None = None  # [shift, mask of key 0], for the compiled walk
        self._stash_max = max(MIN_STASH, self.capacity >> STASH_SHIFT)

    @property
    def capacity(self) -> int:
        return len(self._rows) * SLOTS

    def __len__(self) -> int:
        return self.count + len(self._stash) + (1 if self._zero.any() else 0)

    def _entries(self) -> tuple[U64Array, U64Array]:
        """Every stored key (key 0 excluded) and its mask."""
        keys = self._rows[:, :SLOTS].ravel()
        used = np.flatnonzero(keys)
        masks = self._rows[:, SLOTS:].reshape(self.capacity, self.words)[used]
        if self._stash:
            extra = np.array(list(self._stash), dtype=np.uint64)
            return (np.concatenate([keys[used], extra]),
                    np.concatenate([masks, np.stack(list(self._stash.values()))]))
        return keys[used], masks

    def ensure_words(self, words: int) -> None:
        if words <= self.words:
            return
        keys, masks = self._entries()
        wide = np.zeros((len(masks), words), dtype=np.uint64)
        wide[:, : self.words] = masks
        zero = np.zeros(words, dtype=np.uint64)
        zero[: self.words] = self._zero
        self._zero = zero
        self.words = words
        self._alloc(self._log2)  # empty rows and stash, views to rebuild
        self.count = 0
        self._insert(keys, wide)

    # -- lookup ------------------------------------------------------------------------------
    def _home_of(self, key: int) -> int:
        return ((key * _H1_INT) & _MASK64) >> (WORD_BITS - self._log2)

    def _home(self, keys: U64Array) -> IntpArray:
        out: IntpArray = ((keys * _H1) >> self._shift).astype(np.intp)
        return out

    def _away(self, keys: U64Array) -> IntpArray:
        out: IntpArray = ((keys * _H2) >> self._shift).astype(np.intp)
        return out

    def _probe(self, keys: U64Array, buckets: IntpArray) -> tuple[BoolArray, IntpArray]:
        """Whether each (non-zero) key is in its bucket, and at which slot."""
        eq = np.take(self._rows, buckets, axis=0)[:, :SLOTS] == keys[:, None]
        j = eq.argmax(axis=1)
        hit: BoolArray = eq[np.arange(len(keys)), j]
        return hit, j

    def _find(self, keys: U64Array) -> tuple[IntpArray, IntpArray, BoolArray]:
        """Bucket and slot of every (non-zero) key, and whether it is there."""
        bucket = self._home(keys)
        hit, j = self._probe(keys, bucket)
        retry = np.flatnonzero(~hit & (self._overflowed[bucket] != 0))
        if len(retry):
            away = self._away(keys[retry])
            hit2, j2 = self._probe(keys[retry], away)
            found = retry[hit2]
            bucket[found], j[found], hit[found] = away[hit2], j2[hit2], True
        return bucket, j, hit

    def _scalar_away(self, key: int) -> U64Array | None:
        """One key's mask from its overflow bucket or the stash (``None``: absent)."""
        bucket = ((key * _H2_INT) & _MASK64) >> (WORD_BITS - self._log2)
        row = self._rows[bucket]
        for j, k in enumerate(row[:SLOTS].tolist()):
            if k == key:
                w = self.words
                found: U64Array = row[SLOTS + j * w : SLOTS + (j + 1) * w]
                return found
        return self._stash.get(key)

    def kernel_view(self) -> tuple[U64Array, npt.NDArray[np.uint32], U64Array, U64Array]:
        """What the compiled walks of :mod:`mooncake_conductor.kernels` read: rows,
        overflow counts, ``[hash shift, words of key 0's mask]``, and the stash as a
        key-sorted ``(n, 1 + words)`` array."""
        if self._stash_view is None:
            self._build_stash_view()
        assert self._stash_view is not None
        if self._meta is None:
            self._meta = np.concatenate([np.array([int(self._shift)], dtype=np.uint64),
                                         self._zero])
        return self._rows, self._overflowed, self._meta, self._stash_view

    def mask_of(self, key: int) -> int:
        """One key's mask, wherever it lives (home, overflow bucket, stash, key 0)."""
        if key == 0:
            return words_to_mask(self._zero)
        w = self.words
        bucket = self._home_of(key)
        row = self._rows[bucket]
        keys: list[int] = row[:SLOTS].tolist()
        if key in keys:
            j = keys.index(key)
            return words_to_mask(row[SLOTS + j * w : SLOTS + (j + 1) * w])
        if not self._overflowed[bucket]:
            return 0
        found = self._scalar_away(key)
        return 0 if found is None else words_to_mask(found)

    # -- mutation ----------------------------------------------------------------------------
    def reserve(self, keys: int) -> None:
        """Grow now (once, as :meth:`assign` would) so that ``keys`` more keys fit under
        :data:`MAX_LOAD`: a large batch assigned in parts then never doubles on the way."""
        if self.count + keys > MAX_LOAD * self.capacity:
            self._grow(self.count + keys)

    def assign(self, keys: U64Array, masks: U64Array) -> None:
        """Set the masks of distinct ``keys`` (rows of ``masks``, ``(n, words)`` or fewer
        words); a zero row removes its key."""
        if not len(keys):
            return
        self.ensure_words(masks.shape[1])
        if masks.shape[1] != self.words:  # narrower: padded with zero words
            wide = np.zeros((len(masks), self.words), dtype=np.uint64)
            wide[:, : masks.shape[1]] = masks
            masks = wide
        zero = keys == 0
        if zero.any():
            self._zero = masks[zero][-1].copy()
            self._meta = None
            keys, masks = keys[~zero], masks[~zero]
        if self.words == 1 and len(keys) >= COMPILED_MIN_BATCH:
            # one compiled pass: update, delete, place home or away; the rest below
            self.reserve(len(keys))
            delta, left = upsert_keys(self._rows, self._overflowed, self._shift,
                                      self.kernel_view()[3], keys,
                                      np.ascontiguousarray(masks[:, 0]))
            self.count += delta
            stashed = left == 2
            if stashed.any():
                self._assign_stashed(keys[stashed], masks[stashed])
            room = left == 1
            if room.any():
                self._insert(keys[room], masks[room])
            if self._stash_view is None:
                self._build_stash_view()  # here, not in the next (timed) match
            return
        if self._stash:
            stashed = np.isin(keys, self.kernel_view()[3][:, 0])
            if stashed.any():
                self._assign_stashed(keys[stashed], masks[stashed])
                keys, masks = keys[~stashed], masks[~stashed]
        bucket, j, hit = self._find(keys)
        empty: BoolArray = np.logical_not(masks.any(axis=1))
        self._put(bucket[hit], j[hit], keys[hit] * ~empty[hit], masks[hit])
        gone = hit & empty
        self.count -= int(np.count_nonzero(gone))
        home = self._home(keys[gone])
        away = bucket[gone] != home  # leaving an overflow bucket: its home has one fewer
        np.subtract.at(self._overflowed, home[away], 1)
        new = ~hit & ~empty
        if new.any():
            self._insert(keys[new], masks[new])

    def _build_stash_view(self) -> None:
        """The stash as the walks read it, from scratch (after the table was rebuilt);
        batches keep it up to date after that (:meth:`_assign_stashed`, :meth:`_stash_new`)."""
        n = len(self._stash)
        view = np.empty((n, 1 + self.words), dtype=np.uint64)
        if n:
            keys = np.fromiter(self._stash, dtype=np.uint64, count=n)
            order = np.argsort(keys)
            view[:, 0] = keys[order]
            view[:, 1:] = np.concatenate(list(self._stash.values())).reshape(n, -1)[order]
        self._stash_view = view

    def _assign_stashed(self, keys: U64Array, masks: U64Array) -> None:
        """New masks for distinct ``keys`` that sit in the stash (a zero mask takes the key
        out); the sorted view is patched, not rebuilt: a batch near the load limit touches a
        few of thousands of stashed keys."""
        keep: BoolArray = np.asarray(masks.any(axis=1), dtype=np.bool_)
        rows = masks[keep].copy()
        self._stash.update(zip(keys[keep].tolist(), rows, strict=True))
        gone = keys[~keep]
        for key in gone.tolist():
            del self._stash[key]
        np.subtract.at(self._overflowed, self._home(gone), 1)
        view = self._stash_view
        if view is not None:
            at = np.searchsorted(view[:, 0], keys)
            view[at[keep], 1:] = rows
            if len(gone):
                self._stash_view = np.delete(view, at[~keep], axis=0)

    def _stash_new(self, keys: U64Array, masks: U64Array) -> None:
        """Put distinct absent ``keys`` in the stash (their homes count them), the sorted
        view patched."""
        rows = masks.copy()
        self._stash.update(zip(keys.tolist(), rows, strict=True))
        np.add.at(self._overflowed, self._home(keys), 1)
        view = self._stash_view
        if view is not None:
            order = np.argsort(keys)
            at = np.searchsorted(view[:, 0], keys[order])
            self._stash_view = np.insert(view, at, np.column_stack([keys[order], rows[order]]),
                                         axis=0)

    def _put(self, bucket: IntpArray, slot: IntpArray, keys: U64Array, masks: U64Array) -> None:
        w = self.words
        self._rows[bucket, slot] = keys
        for k in range(w):
            self._rows[bucket, SLOTS + slot * w + k] = masks[:, k]

    def _insert(self, keys: U64Array, masks: U64Array) -> None:
        """Place distinct absent non-zero ``keys``: home if there is room (several new
        keys of one bucket ranked into its free slots), else the overflow bucket (the
        home counts it), else the stash or the table doubles and they retry."""
        while len(keys):
            if self.count + len(keys) > MAX_LOAD * self.capacity:
                self._grow(self.count + len(keys))
            left = np.ones(len(keys), dtype=bool)
            home = self._home(keys)
            for bucket in (home, self._away(keys)):
                idx = np.flatnonzero(left)
                if not len(idx):
                    break
                b = bucket[idx]
                free = np.take(self._rows, b, axis=0)[:, :SLOTS] == 0
                rank = _rank_within(b)
                fits = rank < free.sum(axis=1)
                # the rank-th free slot of the bucket
                j = (np.cumsum(free[fits], axis=1) > rank[fits, None]).argmax(axis=1)
                placed = idx[fits]
                self._put(b[fits], j, keys[placed], masks[placed])
                self.count += len(placed)
                left[placed] = False
                if bucket is not home:
                    moved = home[placed]
                    np.add.at(self._overflowed, moved[b[fits] != moved], 1)
            if not left.any():
                return
            if left.all():  # both buckets full for every one of them
                if len(self._stash) + len(keys) <= self._stash_max:
                    self._stash_new(keys, masks)
                    return
                self._grow(2 * self.capacity)
            keys, masks = keys[left], masks[left]

    def _grow(self, need: int) -> None:
        """Double the table at least once, and until ``need`` keys fit under MAX_LOAD."""
        keys, masks = self._entries()
        buckets = math.ceil(need / (MAX_LOAD * SLOTS))
        self._alloc(max(self._log2 + 1, (buckets - 1).bit_length()))  # log2, rounded up
        self.count = 0
        self._insert(keys, masks)


def _aligned_zeros(rows: int, cols: int) -> U64Array:
    """A zeroed ``(rows, cols)`` uint64 array whose data starts on a 64-byte boundary."""
    per_line = _CACHE_LINE // 8
    buf = np.zeros(rows * cols + per_line, dtype=np.uint64)
    skip = (-buf.ctypes.data % _CACHE_LINE) // 8
    out: U64Array = buf[skip : skip + rows * cols].reshape(rows, cols)
    return out


def _rank_within(groups: IntpArray) -> IntpArray:
    """For each element, how many earlier elements share its value."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    n = len(groups)
    idx = np.arange(n)
    # each sorted position's group starts at the last position where the value changed
    first = np.zeros(n, dtype=np.intp)
    first[1:] = np.where(sorted_groups[1:] != sorted_groups[:-1], idx[1:], 0)
    rank = np.empty(n, dtype=np.intp)
    rank[order] = idx - np.maximum.accumulate(first)
    return rank
