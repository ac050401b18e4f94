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
- ``pending`` marks blocks a queued prefill will have written by the time a
  later request on the same instance runs (in-flight prefixes); matches may
  count them (``include_pending``).

Tier numbers follow the KV-event ``medium`` field: :data:`HBM` ("GPU"),
:data:`DRAM` ("CPU"), :data:`STORE` ("STORAGE").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_

HBM = 0
DRAM = 1
STORE = 2
TIER_NAMES = {HBM: "GPU", DRAM: "CPU", STORE: "STORAGE"}
TIER_BY_MEDIUM = {v: k for k, v in TIER_NAMES.items()}


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Block-key → holder index with per-instance LRU capacity."""

    def __init__(self, capacity_blocks: int, instances: int = 0) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.default_capacity = capacity_blocks
        self.holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, int] | None] = []
        self._capacity: list[int] = []
        self._pending: dict[int, int] = {}
        self._pending_count: dict[tuple[int, int], int] = {}
        self.live_mask = 0
        self.evictions = 0
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
        if instance >= len(self._lru) or self._lru[instance] is None:
            self.add_instance(instance)
        table = self._lru[instance]
        assert table is not None
        return table

    # -- mutation --------------------------------------------------------------------------
    def store(self, instance: int, keys: Sequence[int], tier: int = HBM) -> list[int]:
        """Record that ``instance`` holds ``keys`` (a chained prefix or any blocks).

        Returns the keys evicted from this instance to stay within capacity.
        """
        table = self._table(instance)
        bit = 1 << instance
        holders = self.holders
        for key in reversed(keys):
            if key in table:
                table.move_to_end(key)
                table[key] = min(table[key], tier)
            else:
                table[key] = tier
                holders[key] = holders.get(key, 0) | bit
        return self._evict_to(instance, self._capacity[instance])

    def touch(self, instance: int, keys: Sequence[int]) -> None:
        """Mark the held ones of ``keys`` as just used (roots most recent)."""
        table = self._table(instance)
        for key in reversed(keys):
            if key in table:
                table.move_to_end(key)

    def demote(self, instance: int, keys: Sequence[int]) -> None:
        """Move the held ones of ``keys`` to the least-recently-used end (evicted first)."""
        table = self._table(instance)
        for key in keys:
            if key in table:
                table.move_to_end(key, last=False)

    def _evict_to(self, instance: int, capacity: int) -> list[int]:
        table = self._lru[instance]
        if table is None or len(table) <= capacity:
            return []
        keep = ~(1 << instance)
        holders = self.holders
        evicted: list[int] = []
        while len(table) > capacity:
            key, _ = table.popitem(last=False)
            mask = holders[key] & keep
            if mask:
                holders[key] = mask
            else:
                del holders[key]
            evicted.append(key)
        self.evictions += len(evicted)
        return evicted

    def remove(self, instance: int, keys: Iterable[int]) -> None:
        if instance >= len(self._lru) or self._lru[instance] is None:
            return
        table = self._lru[instance]
        assert table is not None
        keep = ~(1 << instance)
        for key in keys:
            if table.pop(key, None) is not None:
                mask = self.holders[key] & keep
                if mask:
                    self.holders[key] = mask
                else:
                    del self.holders[key]

    def clear(self, instance: int) -> None:
        if instance < len(self._lru) and self._lru[instance] is not None:
            table = self._lru[instance]
            assert table is not None
            self.remove(instance, list(table))
        for (key, inst), _ in list(self._pending_count.items()):
            if inst == instance:
                self._drop_pending(key, inst, all_refs=True)

    # -- pending (in-flight) ---------------------------------------------------------------
    def add_pending(self, instance: int, keys: Iterable[int]) -> None:
        bit = 1 << instance
        for key in keys:
            ref = (key, instance)
            self._pending_count[ref] = self._pending_count.get(ref, 0) + 1
            self._pending[key] = self._pending.get(key, 0) | bit

    def remove_pending(self, instance: int, keys: Iterable[int]) -> None:
        for key in keys:
            self._drop_pending(key, instance, all_refs=False)

    def _drop_pending(self, key: int, instance: int, all_refs: bool) -> None:
        ref = (key, instance)
        count = self._pending_count.get(ref, 0)
        if count == 0:
            return
        if count > 1 and not all_refs:
            self._pending_count[ref] = count - 1
            return
        del self._pending_count[ref]
        mask = self._pending[key] & ~(1 << instance)
        if mask:
            self._pending[key] = mask
        else:
            del self._pending[key]

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
        self, keys: Sequence[int], mask: int = -1, include_pending: bool = False
    ) -> dict[int, int]:
        """Longest held prefix (in blocks) for every instance in ``mask`` that holds at
        least the first block; instances not in the result match nothing.

        ``alive[k]`` = the instances holding all of ``keys[:k]``: a running AND of the
        holder masks, computed in C (``accumulate``) and cut where it reaches zero.
        Bits only ever drop, so each instance's match is the end of the last run that
        still has its bit; runs are found by binary search, one per drop.
        """
        start = self.live_mask & mask
        if not start or not keys:
            return {}
        if include_pending and self._pending:
            holders, pending = self.holders, self._pending
            masks: Iterable[int] = (holders.get(k, 0) | pending.get(k, 0) for k in keys)
        else:
            masks = map(self.holders.get, keys, repeat(0))
        alive = list(takewhile(bool, accumulate(masks, and_, initial=start)))
        out: dict[int, int] = {}
        last = len(alive) - 1
        i = 0
        while True:
            value = alive[i]
            lo, hi = i, last  # the run of ``value`` ends at the last index holding it
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if alive[mid] == value:
                    lo = mid
                else:
                    hi = mid - 1
            gone = value if lo == last else value & ~alive[lo + 1]
            if lo:
                for inst in _bits(gone):
                    out[inst] = lo
            if lo == last:
                return out
            i = lo + 1

    @property
    def has_pending(self) -> bool:
        """Whether any instance has in-flight (pending) blocks."""
        return bool(self._pending)

    def holder_mask(self, key: int) -> int:
        return self.holders.get(key, 0)

    def tier_counts(self, instance: int, keys: Sequence[int]) -> dict[int, int]:
        """How many of ``keys`` (held by ``instance``) sit on each tier."""
        table = self._table(instance)
        counts: dict[int, int] = {}
        for key in keys:
            tier = table.get(key)
            if tier is not None:
                counts[tier] = counts.get(tier, 0) + 1
        return counts

    def blocks(self, instance: int) -> set[int]:
        if instance >= len(self._lru) or self._lru[instance] is None:
            return set()
        table = self._lru[instance]
        assert table is not None
        return set(table)

    def size(self, instance: int | None = None) -> int:
        if instance is None:
            return sum(len(t) for t in self._lru if t is not None)
        return len(self._table(instance))

    def __len__(self) -> int:
        return len(self.holders)
