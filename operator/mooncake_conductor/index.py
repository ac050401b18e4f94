"""The global prefix index: which instance holds which block, on which tier.

- Every instance (prefill or decode engine, or the shared store pool, each a
  small integer id) has an LRU of block keys with a capacity in blocks, so
  the index's memory is bounded by the sum of the capacities.
- ``holders[key]`` is a bitmask of the instances holding ``key``; a
  longest-prefix match for *every* instance is one pass over the request's
  keys, ANDing masks until no instance is left (:meth:`PrefixIndex.match_all`).
- Blocks are chained (a key names its whole prefix), so a prefix is touched
  from its last block to its first: the first blocks are the most recently
  used and leaves are evicted before the roots they hang from.
- Past :data:`VECTOR_MIN_KEYS` distinct keys the holder and pending masks are
  mirrored into :class:`~mooncake_conductor.keytable.KeyMaskTable` s and
  ``match_all`` runs vectorised (a few numpy gathers instead of a cold dict
  lookup per key); below it the dicts are cache-resident and faster. The
  mirror catches up with the keys changed since the last query, lazily. Once an
  instance id past 63 holds a block or is asked about, the mirror's tables map
  each key to the id of its holder set (:mod:`.holdersets`) instead of to a mask
  that would grow with the fleet.
- ``pending`` marks blocks a queued prefill will have written by the time a
  later request on the same instance runs (in-flight prefixes); matches may
  count them (``include_pending``).

Tier numbers follow the KV-event ``medium`` field: :data:`HBM` ("GPU"),
:data:`DRAM` ("CPU"), :data:`STORE` ("STORAGE").
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_, neg, or_
from typing import Any

import numpy as np
import numpy.typing as npt

from .holdersets import HolderSets
from .kernels import (
    lookup_values,
    walk_keys,
    walk_lengths,
    walk_lengths_sets,
)
from .keytable import (
    WORD_BITS,
    KeyMaskTable,
    U64Array,
    as_key_array,
    masks_to_words,
)

HBM = 0
DRAM = 1
STORE = 2
TIER_NAMES = {HBM: "GPU", DRAM: "CPU", STORE: "STORAGE"}
#: engines' ``medium`` names (docs/kv-events.md): SGLang's host tiers are DRAM (0.5.23:
#: ``CPU_PINNED``), vLLM's file and object offload tiers and SGLang's disk and external
#: pool (Mooncake) are storage; ``tests/conformance`` holds every name the engines define
TIER_BY_MEDIUM = {
    **{v: k for k, v in TIER_NAMES.items()},
    "CPU_TIER1": DRAM, "CPU_TIER2": DRAM, "CPU_PINNED": DRAM,
    "FS": STORE, "OBJ": STORE, "DISK": STORE, "EXTERNAL": STORE,
}


def tier_of_medium(medium: str | None) -> int:
    """Index tier of a KV event's ``medium``: GPU when absent (engines that do not send it
    only report GPU blocks); an unknown name is taken as the slowest tier, so a cache the
    index cannot place is never priced as if it were in HBM."""
    if medium is None:
        return HBM
    return TIER_BY_MEDIUM.get(medium.upper(), STORE)
#: wide masks remembered before the ones no key holds are forgotten (then twice those held)
SHARED_MIN = 1 << 12
#: distinct keys from which matching runs vectorised (below: the dict is cache-resident)
VECTOR_MIN_KEYS = 1 << 18
#: the vectorised mirror is dropped again below this share of VECTOR_MIN_KEYS
VECTOR_DROP_SHARE = 0.25
#: masks whose words the mirror keeps between walks (a pool's live mask, stored and pending)
WORDS_MEMO = 4

_LOW_WORD = (1 << WORD_BITS) - 1

Keys = Sequence[int] | npt.NDArray[Any]
I64Array = npt.NDArray[np.int64]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


#: the ids of one-word holder masks, ascending, as :func:`_bit_list` has seen them: a walk
#: drops the same few sets of instances again and again (at most ``BIT_LISTS_MAX`` kept)
_BIT_LISTS: dict[int, tuple[int, ...]] = {}
BIT_LISTS_MAX = 1 << 12


def _bit_list(mask: int) -> tuple[int, ...]:
    """The set bits of ``mask`` (non-negative), ascending, as :func:`_bits`; one-word
    masks are remembered (a dict look-up instead of a generator per drop)."""
    bits = _BIT_LISTS.get(mask)
    if bits is None:
        bits = tuple(_bits(mask))
        if not mask >> WORD_BITS and len(_BIT_LISTS) < BIT_LISTS_MAX:
            _BIT_LISTS[mask] = bits
    return bits


class _Mirror:
    """Vectorised copies of the holder and pending masks, and the keys changed since
    they were last brought up to date."""

    def __init__(self, holders: dict[int, int], pending: dict[int, int]) -> None:
        self.dirty_stored: set[int] = set()
        self.dirty_pending: set[int] = set()
        #: the last few masks asked about, as words (a pool's live mask rarely changes)
        self._words: dict[tuple[int, int], U64Array] = {}
        self._load(holders, pending, _words_for(list(holders.values())) > 1
                   or _words_for(list(pending.values())) > 1)

    def _load(self, holders: dict[int, int], pending: dict[int, int], sets: bool) -> None:
        """Every key, read in the dicts' own order (not looked up one by one); with
        ``sets`` (an instance id past 63) the tables map keys to holder-set ids."""
        self.stored = KeyMaskTable()
        self.pending = KeyMaskTable()
        self.sets = HolderSets() if sets else None
        self.dirty_stored.clear()
        self.dirty_pending.clear()
        self._put(self.stored, list(holders), list(holders.values()))
        self._put(self.pending, list(pending), list(pending.values()))

    def words_of(self, mask: int, words: int) -> U64Array:
        """``mask`` as ``words`` uint64 words (a fresh copy: the walk uses it up), the
        conversion kept for the next decisions over the same pool."""
        got = self._words.get((mask, words))
        if got is None:
            if len(self._words) >= WORDS_MEMO:
                self._words.clear()
            got = self._words[mask, words] = _words(mask, words)
        return got.copy()

    def mask_of(self, table: KeyMaskTable, key: int) -> int:
        """The holder mask the mirror keeps for ``key`` in ``table`` (its set's)."""
        value = table.mask_of(key)
        return value if self.sets is None else self.sets.mask(value)

    def to_sets(self, holders: dict[int, int], pending: dict[int, int]) -> None:
        """Hold set ids from now on (an instance id past 63 is held or asked about)."""
        self._load(holders, pending, True)

    def _put(self, table: KeyMaskTable, keys: list[int], masks: list[int]) -> None:
        if self.sets is None:
            _assign_masks(table, keys, masks)
        else:
            _assign_sets(table, keys, masks, self.sets)

    def sync(self, holders: dict[int, int], pending: dict[int, int]) -> None:
        for dirty, table, source in ((self.dirty_stored, self.stored, holders),
                                     (self.dirty_pending, self.pending, pending)):
            if not dirty:
                continue
            keys = list(dirty)
            dirty.clear()
            masks = list(map(source.get, keys, repeat(0)))
            if self.sets is None and _words_for(masks) > 1:
                self.to_sets(holders, pending)  # the first instance id past 63
                return
            self._put(table, keys, masks)


def _assign_sets(table: KeyMaskTable, keys: list[int], masks: list[int],
                 sets: HolderSets) -> None:
    """``masks[i]`` as the holders of ``keys[i]`` (distinct), stored as set ids."""
    if len(keys) > ASSIGN_PART:  # one growth to the final size, then part after part
        table.reserve(len(keys))
    for lo in range(0, len(keys), ASSIGN_PART):
        part = masks[lo : lo + ASSIGN_PART]
        karr = np.fromiter(keys[lo : lo + ASSIGN_PART], dtype=np.uint64, count=len(part))
        old = lookup_values(table.kernel_view(), karr) if table.count or len(table) else \
            np.zeros(len(karr), dtype=np.uint64)
        new = sets.intern(part)
        table.assign(karr, new[:, None])
        sets.release(old, new)


#: keys assigned to the mirror per part when a sync has more (the first, of every key):
#: the mask rows of one part are all that is made at a time (~130 MB of 16-word rows)
ASSIGN_PART = 1 << 20


def _assign_masks(table: KeyMaskTable, keys: list[int], masks: list[int]) -> None:
    """``masks[i]`` as the mask of ``keys[i]`` (distinct), as wide as the widest mask or
    the table; every per-key step runs in C or compiled code."""
    words = table.words
    if len(keys) > ASSIGN_PART:  # one growth to the final size, then part after part
        words = max(words, _words_for(masks))
        table.ensure_words(words)
        table.reserve(len(keys))
    for lo in range(0, len(keys), ASSIGN_PART):
        part = masks[lo : lo + ASSIGN_PART]
        karr = np.fromiter(keys[lo : lo + ASSIGN_PART], dtype=np.uint64, count=len(part))
        table.assign(karr, _mask_rows(part, words))


def _words_for(masks: list[int]) -> int:
    """How many 64-bit words the widest of ``masks`` needs (at least one)."""
    return max(1, -(-max(map(int.bit_length, masks), default=0) // WORD_BITS))


def _mask_rows(masks: list[int], words: int) -> U64Array:
    """``masks`` as rows of at least ``words`` words, as many as the widest needs (instance
    ids past 63: several), converted in bulk (:func:`.keytable.masks_to_words`)."""
    if words == 1:
        try:
            return np.fromiter(masks, dtype=np.uint64, count=len(masks))[:, None]
        except OverflowError:  # a mask past instance id 63
            pass
    return masks_to_words(masks, max(words, _words_for(masks)))


def _words(mask: int, words: int) -> U64Array:
    """A non-negative mask as ``words`` uint64 words, low word first (a writable copy)."""
    return np.frombuffer(mask.to_bytes(words * 8, "little"), dtype="<u8").astype(np.uint64)


def _matches(drops: list[tuple[int, int, int]], left: int, n: int) -> dict[int, int]:
    """Longest prefix per instance from a walk's drops ``(position, set before, set
    after)`` and the set ``left`` holding all ``n`` keys (instances that drop at the
    first key match nothing and are left out)."""
    out: dict[int, int] = {}
    for at, before, after in drops:
        if at:
            for inst in _bit_list(before & ~after):
                out[inst] = at
    for inst in _bit_list(left):
        out[inst] = n
    return out


class PrefixIndex:
    """Block-key → holder index with per-instance LRU capacity."""

    def __init__(
        self, capacity_blocks: int, instances: int = 0, vector_min_keys: int = VECTOR_MIN_KEYS
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.vector_min_keys = vector_min_keys
        self._mirror: _Mirror | None = None
        self._drops = np.empty((0, 3), dtype=np.uint64)  # the compiled walk's drop rows
        self.default_capacity = capacity_blocks
        self.holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, int] | None] = []
        self._capacity: list[int] = []
        self._pending: dict[int, int] = {}
        #: per instance, its in-flight prefills' references to each pending key
        self._pending_count: dict[int, dict[int, int]] = {}
        self.live_mask = 0
        self.evictions = 0
        #: one int object per distinct wide mask (instance ids past 63), shared by every
        #: key with those holders: a mask as wide as the fleet is kept once, not per key
        self._shared: dict[int, int] = {}
        self._shared_limit = SHARED_MIN
        for i in range(instances):
            self.add_instance(i)

    # -- instances -------------------------------------------------------------------------
    def add_instance(self, instance: int, capacity_blocks: int | None = None) -> None:
        while len(self._lru) <= instance:
            self._lru.append(None)
            self._capacity.append(self.default_capacity)
        if self._lru[instance] is None:
            self._lru[instance] = OrderedDict()
        cap = self.default_capacity if capacity_blocks is None else capacity_blocks
        if cap <= 0:
            raise ValueError("capacity_blocks must be positive")
        self._capacity[instance] = cap
        self.live_mask |= 1 << instance
        self._evict_to(instance, cap)

    def remove_instance(self, instance: int) -> None:
        self.clear(instance)
        if instance < len(self._lru):
            self._lru[instance] = None
        self.live_mask &= ~(1 << instance)

    def capacity(self, instance: int) -> int:
        return self._capacity[instance]

    def _table(self, instance: int) -> OrderedDict[int, int]:
        """The instance's LRU, adding the instance if it is not there (for storing)."""
        table = self._held(instance)
        if table is None:
            self.add_instance(instance)
            table = self._lru[instance]
            assert table is not None
        return table

    def _held(self, instance: int) -> OrderedDict[int, int] | None:
        """The instance's LRU, ``None`` for an instance never added or removed (queries
        and removals leave the set of instances as it is)."""
        return self._lru[instance] if instance < len(self._lru) else None

    # -- mutation --------------------------------------------------------------------------
    def store(self, instance: int, keys: Sequence[int], tier: int = HBM) -> list[int]:
        """Record that ``instance`` holds ``keys`` (a chained prefix or any blocks).

        Returns the keys evicted from this instance to stay within capacity.
        """
        table = self._table(instance)
        bit = 1 << instance
        holders = self.holders
        get, move, holder = table.get, table.move_to_end, holders.get
        share = self._shared.setdefault
        alone = share(bit, bit) if bit >> WORD_BITS else bit  # a key only it holds
        for key in reversed(keys):
            held = get(key)
            if held is not None:
                move(key)
                if tier < held:
                    table[key] = tier
            else:
                table[key] = tier
                was = holder(key)
                if was is None:  # no new wide int to make and hash
                    holders[key] = alone
                else:
                    mask = was | bit
                    holders[key] = share(mask, mask) if mask >> WORD_BITS else mask
        if self._mirror is not None:
            self._mirror.dirty_stored.update(keys)
        evicted = self._evict_to(instance, self._capacity[instance])
        if len(self._shared) > self._shared_limit:
            self._reshare()
        return evicted

    def touch(self, instance: int, keys: Sequence[int]) -> None:
        """Mark the held ones of ``keys`` as just used (roots most recent)."""
        table = self._held(instance)
        if table is None:
            return
        for key in reversed(keys):
            if key in table:
                table.move_to_end(key)

    def demote(self, instance: int, keys: Sequence[int]) -> None:
        """Move the held ones of ``keys`` to the least-recently-used end (evicted first)."""
        table = self._held(instance)
        if table is None:
            return
        for key in keys:
            if key in table:
                table.move_to_end(key, last=False)

    def _evict_to(self, instance: int, capacity: int) -> list[int]:
        table = self._lru[instance]
        assert table is not None
        if len(table) <= capacity:
            return []
        bit = 1 << instance
        keep = ~bit
        holders = self.holders
        share = self._shared.setdefault
        alone = self._shared.get(bit, bit)  # the object keys only it holds share
        evicted: list[int] = []
        while len(table) > capacity:
            key, _ = table.popitem(last=False)
            was = holders[key]
            mask = 0 if was is alone else was & keep
            if mask:
                holders[key] = share(mask, mask) if mask >> WORD_BITS else mask
            else:
                del holders[key]
            evicted.append(key)
        self.evictions += len(evicted)
        if self._mirror is not None:
            self._mirror.dirty_stored.update(evicted)
        return evicted

    def remove(self, instance: int, keys: Iterable[int]) -> None:
        table = self._held(instance)
        if table is None:
            return
        bit = 1 << instance
        keep = ~bit
        dirty = self._mirror.dirty_stored if self._mirror is not None else None
        share = self._shared.setdefault
        alone = self._shared.get(bit, bit)  # the object keys only it holds share
        for key in keys:
            if table.pop(key, None) is not None:
                was = self.holders[key]
                mask = 0 if was is alone else was & keep
                if mask:
                    self.holders[key] = share(mask, mask) if mask >> WORD_BITS else mask
                else:
                    del self.holders[key]
                if dirty is not None:
                    dirty.add(key)

    def _reshare(self) -> None:
        """Forget the wide masks no key holds any more (keys keep their objects)."""
        shared: dict[int, int] = {}
        for source in (self.holders, self._pending):
            for key, mask in source.items():
                if mask >> WORD_BITS:
                    source[key] = shared.setdefault(mask, mask)
        self._shared = shared
        self._shared_limit = max(SHARED_MIN, 2 * len(shared))

    def clear(self, instance: int) -> None:
        table = self._held(instance)
        if table is not None:
            self.remove(instance, list(table))
        for key in list(self._pending_count.get(instance, ())):
            self._drop_pending(key, instance, all_refs=True)

    # -- pending (in-flight) ---------------------------------------------------------------
    def add_pending(self, instance: int, keys: Sequence[int]) -> None:
        """One reference more to each of ``keys`` on ``instance``; a key's pending mask
        gains the instance's bit with its first reference (later ones leave it as is)."""
        bit = 1 << instance
        share = self._shared.setdefault
        counts = self._pending_count.setdefault(instance, {})
        count_of = counts.get
        pending = self._pending
        for key in keys:
            count = count_of(key, 0)
            counts[key] = count + 1
            if not count:
                mask = pending.get(key, 0) | bit
                pending[key] = share(mask, mask) if mask >> WORD_BITS else mask
        if self._mirror is not None:
            self._mirror.dirty_pending.update(keys)
        if len(self._shared) > self._shared_limit:
            self._reshare()

    def remove_pending(self, instance: int, keys: Iterable[int]) -> None:
        """One reference of each of ``keys`` on ``instance`` fewer (:meth:`_drop_pending`
        with ``all_refs=False``, inlined: a simulated trace drops every key it added)."""
        counts = self._pending_count.get(instance)
        if counts is None:
            return
        pending = self._pending
        dirty = self._mirror.dirty_pending if self._mirror is not None else None
        keep = ~(1 << instance)
        count_of = counts.get
        for key in keys:
            count = count_of(key, 0)
            if count > 1:
                counts[key] = count - 1
            elif count:
                del counts[key]
                mask = pending[key] & keep
                if mask:
                    pending[key] = self._shared.setdefault(mask, mask) if mask >> WORD_BITS \
                        else mask
                else:
                    del pending[key]
                if dirty is not None:
                    dirty.add(key)
        if not counts:  # an instance with nothing in flight keeps no table
            del self._pending_count[instance]

    def _drop_pending(self, key: int, instance: int, all_refs: bool) -> None:
        counts = self._pending_count.get(instance, {})
        count = counts.get(key, 0)
        if count == 0:
            return
        if count > 1 and not all_refs:
            counts[key] = count - 1
            return
        del counts[key]
        if not counts:
            del self._pending_count[instance]
        mask = self._pending[key] & ~(1 << instance)
        if mask:
            self._pending[key] = self._shared.setdefault(mask, mask) if mask >> WORD_BITS \
                else mask
        else:
            del self._pending[key]
        if self._mirror is not None:
            self._mirror.dirty_pending.add(key)

    # -- queries ---------------------------------------------------------------------------
    def match(self, instance: int, keys: Sequence[int], include_pending: bool = False) -> int:
        """Number of leading ``keys`` held by ``instance``."""
        bit = 1 << instance
        holders = self.holders
        pending = self._pending if include_pending else None
        for i, key in enumerate(keys):
            mask = holders.get(key, 0)
            if pending is not None:
                mask |= pending.get(key, 0)
            if not mask & bit:
                return i
        return len(keys)

    def match_all(
        self, keys: Keys, mask: int = -1, include_pending: bool = False,
        key_array: U64Array | None = None,
    ) -> dict[int, int]:
        """Longest held prefix (in blocks) for every instance in ``mask`` that holds at
        least the first block; instances not in the result match nothing. ``key_array``
        (the same keys as uint64, when the caller has them) spares the large-index path a
        conversion; the small-index path walks ``keys``."""
        start = self.live_mask & mask
        if not start or not len(keys):
            return {}
        with_pending = include_pending and bool(self._pending)
        if self._vectorised():
            arr = as_key_array(keys) if key_array is None else key_array
            return self._match_vec(arr, start, with_pending)
        keys_seq: Sequence[int] = keys.tolist() if isinstance(keys, np.ndarray) else keys
        return self._match_dict(keys_seq, start, with_pending)

    def match_lengths(
        self, keys: Keys, mask: int, pending_mask: int | None = None,
        key_array: U64Array | None = None,
    ) -> tuple[I64Array, I64Array, int | None, int]:
        """Longest held prefix (blocks) of every instance, as arrays indexed by instance
        id (0: nothing): stored blocks for the ids in ``mask``, and stored or pending
        blocks for the ids in ``pending_mask`` (the second array is the first when
        ``pending_mask`` is ``None`` or nothing is pending); then the holder of the
        longest stored prefix (the lowest id on ties, ``None`` when nothing matches) and
        its length. The arrays cover every id of a non-negative mask. Same answers as
        :meth:`match_all`; on a large index of at most 64 instance ids, one compiled pass
        (:func:`.kernels.walk_lengths`)."""
        start = self.live_mask & mask
        with_view = pending_mask is not None and bool(self._pending)
        start_p = self.live_mask & pending_mask if pending_mask is not None and with_view else 0
        # long enough for every id asked about, held or not
        size = max(WORD_BITS, max(mask, 0).bit_length(), max(pending_mask or 0, 0).bit_length(),
                   start.bit_length(), start_p.bit_length())
        if start | start_p and len(keys) and self._vectorised():
            mirror = self._mirror
            assert mirror is not None
            mirror.sync(self.holders, self._pending)
            if mirror.sets is None and size > WORD_BITS:  # ids past 63 asked about
                mirror.to_sets(self.holders, self._pending)
            if mirror.sets is not None:
                return self._lengths_sets(mirror, keys, key_array, start, start_p, size,
                                          with_view)
            # one-word masks (no id past 63 held or asked about): one compiled pass
            out, out_p = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64)
            best, length = walk_lengths(
                mirror.stored.kernel_view(), mirror.pending.kernel_view(),
                as_key_array(keys) if key_array is None else key_array, start, start_p,
                out, out_p)
            return out, out_p if with_view else out, best if length else None, length
        stored = self.match_all(keys, mask, key_array=key_array)
        out = np.zeros(size, dtype=np.int64)
        for iid, length in stored.items():
            out[iid] = length
        best = int(out.argmax())  # the first (lowest) id on ties, as the compiled walk
        best_src, best_len = (best, int(out[best])) if out[best] else (None, 0)
        if pending_mask is None or not with_view:
            return out, out, best_src, best_len
        view = np.zeros(size, dtype=np.int64)
        for iid, length in self.match_all(keys, pending_mask, include_pending=True,
                                          key_array=key_array).items():
            view[iid] = length
        return out, view, best_src, best_len

    def _match_vec(self, keys: U64Array, start: int, with_pending: bool) -> dict[int, int]:
        mirror = self._mirror
        assert mirror is not None
        mirror.sync(self.holders, self._pending)
        if mirror.sets is not None:
            size = max(WORD_BITS, start.bit_length())
            out, view, _, _ = self._lengths_sets(
                mirror, keys, keys, 0 if with_pending else start,
                start if with_pending else 0, size, True)
            lengths = view if with_pending else out
            at = np.flatnonzero(lengths)
            at = at[np.argsort(lengths[at], kind="stable")]  # the dict walk's order
            return dict(zip(at.tolist(), lengths[at].tolist(), strict=True))
        tables = [mirror.stored, mirror.pending] if with_pending else [mirror.stored]
        return self._walk(keys, start, tables)  # one-word masks: no id past 63 is held

    def _walk(self, keys: U64Array, start: int, tables: list[KeyMaskTable]) -> dict[int, int]:
        """Longest prefixes by the compiled walk (:mod:`.kernels`)."""
        n = len(keys)
        if len(self._drops) <= n:
            self._drops = np.empty((n + 1, 3), dtype=np.uint64)
        _, acc, dropped = walk_keys([t.kernel_view() for t in tables], keys,
                                    start & _LOW_WORD, self._drops)
        return _matches(self._drops[:dropped].tolist(), acc, n)

    def _lengths_sets(
        self, mirror: _Mirror, keys: Keys, key_array: U64Array | None, start: int,
        start_p: int, size: int, with_view: bool,
    ) -> tuple[I64Array, I64Array, int | None, int]:
        """:meth:`match_lengths` over a mirror of holder-set ids (one compiled pass)."""
        sets = mirror.sets
        assert sets is not None
        words = max(sets.words, -(-size // WORD_BITS))
        sets.ensure_words(words)
        out = np.empty(words * WORD_BITS, dtype=np.int64)
        out_p = np.empty(words * WORD_BITS, dtype=np.int64)
        best, length = walk_lengths_sets(
            mirror.stored.kernel_view(), mirror.pending.kernel_view(), sets.rows,
            as_key_array(keys) if key_array is None else key_array,
            mirror.words_of(start, words), mirror.words_of(start_p, words), out, out_p)
        return out, out_p if with_view else out, best if length else None, length

    def sync(self) -> None:
        """Bring the vectorised mirror up to date now (else the next match does it):
        call after applying a batch of changes, off the decision's critical path."""
        if self._mirror is not None:
            self._mirror.sync(self.holders, self._pending)

    def _vectorised(self) -> bool:
        n = len(self.holders)
        if self._mirror is None:
            if n >= self.vector_min_keys:
                self._mirror = _Mirror(self.holders, self._pending)
        elif n < VECTOR_DROP_SHARE * self.vector_min_keys:
            self._mirror = None
        return self._mirror is not None

    def _match_dict(self, keys: Sequence[int], start: int, include_pending: bool) -> dict[int, int]:
        """``alive[k]`` = the instances holding all of ``keys[:k]``: a running AND of the
        holder masks, computed in C (``accumulate``) and cut where it reaches zero.
        Bits only ever drop, so ``alive`` never grows and each instance's match is the end
        of the last run that still has its bit; runs are found by binary search
        (``bisect`` on the negated values), one per drop.
        """
        if not start:
            return {}
        if include_pending and self._pending:
            holders, pending = self.holders, self._pending
            masks: Iterable[int] = map(or_, map(holders.get, keys, repeat(0)),
                                       map(pending.get, keys, repeat(0)))
        else:
            masks = map(self.holders.get, keys, repeat(0))
        alive = list(takewhile(bool, accumulate(masks, and_, initial=start)))
        out: dict[int, int] = {}
        last = len(alive) - 1
        i = 0
        for _ in alive:  # a run per pass, so never more passes than values
            value = alive[i]
            end = bisect_right(alive, -value, i, key=neg) - 1  # where the run of value ends
            if end:
                for inst in _bit_list(value if end == last else value & ~alive[end + 1]):
                    out[inst] = end
            if end == last:
                break
            i = end + 1
        return out

    @property
    def has_pending(self) -> bool:
        """Whether any instance has in-flight (pending) blocks."""
        return bool(self._pending)

    def pending_size(self, instance: int) -> int:
        """How many blocks ``instance`` has pending (distinct keys of its in-flight
        prefills); a scan of every pending key, for reports."""
        bit = 1 << instance
        return sum(1 for mask in self._pending.values() if mask & bit)

    def holder_mask(self, key: int) -> int:
        return self.holders.get(key, 0)

    def tier_counts(self, instance: int, keys: Sequence[int]) -> dict[int, int]:
        """How many of ``keys`` (held by ``instance``) sit on each tier."""
        table = self._held(instance)
        counts: dict[int, int] = {}
        if table is None:
            return counts
        for key in keys:
            tier = table.get(key)
            if tier is not None:
                counts[tier] = counts.get(tier, 0) + 1
        return counts

    def blocks(self, instance: int) -> set[int]:
        return set(self._held(instance) or ())

    def size(self, instance: int | None = None) -> int:
        if instance is None:
            return sum(len(t) for t in self._lru if t is not None)
        return len(self._held(instance) or ())

    def __len__(self) -> int:
        return len(self.holders)
