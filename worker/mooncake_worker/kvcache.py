"""Paged KV cache with an LRU prefix cache, emitting vLLM-style KV events.

- The cache has ``capacity`` blocks of ``block_size`` tokens.
- A *full* block whose KV is computed gets its key (``mooncake_conductor.blockkeys``
  chained key of its whole prefix) and enters the prefix cache; a
  :class:`~mooncake_worker.kvevents.BlockStored` event announces it.
- A block is *in use* while a sequence (or the pod agent's pin) references it;
  cached blocks nobody references stay cached, ordered least-recently used, and are
  evicted (announced by ``BlockRemoved``) when a new block is needed.
- Capacity a running sequence may still grow into is reserved at admission, so a
  running sequence never has to be preempted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mooncake_contract.kvevents.codec import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class Block:
    __slots__ = ("key", "ref", "tokens")

    def __init__(self, key: int | None = None, tokens: tuple[int, ...] = ()) -> None:
        self.key = key
        self.ref = 1
        self.tokens = tokens


class CacheFull(Exception):
    """No free block is left (every block is referenced or reserved)."""


class PrefixCache:
    """Block accounting, prefix cache and event log of one engine."""

    def __init__(self, capacity: int, block_size: int, medium: str = "GPU") -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self.medium = medium
        self.cached: dict[int, Block] = {}
        self.lru: OrderedDict[int, Block] = OrderedDict()
        self.used = 0  # blocks referenced (cached with ref > 0, or private)
        self.reserved = 0  # blocks promised to running sequences, not yet allocated
        self.events: list[KVEvent] = []

    # -- accounting -----------------------------------------------------------------------
    @property
    def blank(self) -> int:
        return self.capacity - self.used - self.reserved - len(self.lru)

    @property
    def free(self) -> int:
        """Blocks a new sequence can obtain (blank plus evictable)."""
        return self.capacity - self.used - self.reserved

    @property
    def usage(self) -> float:
        return self.used / self.capacity

    def held_keys(self) -> set[int]:
        return set(self.cached)

    # -- lookup ---------------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> int:
        n = 0
        cached = self.cached
        for k in keys:
            if k not in cached:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[int]) -> list[Block]:
        """Reference the cached blocks of ``keys`` (all must be cached), marking them used."""
        out = []
        for k in keys:
            b = self.cached[k]
            if b.ref == 0:
                del self.lru[k]
                self.used += 1
            b.ref += 1
            out.append(b)
        return out

    # -- allocation -----------------------------------------------------------------------
    def _evict_one(self) -> None:
        key, _ = self.lru.popitem(last=False)
        del self.cached[key]
        ev = self.events[-1] if self.events else None
        if isinstance(ev, BlockRemoved):
            ev.block_hashes.append(key)
        else:
            self.events.append(BlockRemoved([key], self.medium))

    def reserve(self, n: int) -> None:
        """Promise ``n`` blocks (evicting LRU blocks as needed) or raise :class:`CacheFull`."""
        if n > self.free:
            raise CacheFull(f"need {n} blocks, {self.free} free")
        while self.blank < n:
            self._evict_one()
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def take_reserved(self) -> Block:
        """Turn one reserved block into a private (uncached) block."""
        self.reserved -= 1
        self.used += 1
        return Block()

    def commit(self, block: Block, key: int, parent: int | None, tokens: tuple[int, ...]) -> Block:
        """A private block became full and computed: cache it under ``key``.

        Returns the block the sequence should hold (an existing cached copy when another
        sequence already cached the same key; the private one is then freed)."""
        existing = self.cached.get(key)
        if existing is not None:
            if existing is block:
                return block
            self.release([block])
            return self.acquire([key])[0]
        block.key = key
        block.tokens = tokens
        self.cached[key] = block
        ev = self.events[-1] if self.events else None
        if (
            isinstance(ev, BlockStored)
            and ev.block_hashes
            and ev.block_hashes[-1] == parent
            and ev.block_size == self.block_size
        ):
            ev.block_hashes.append(key)
            ev.token_ids.extend(tokens)
        else:
            self.events.append(
                BlockStored([key], parent, list(tokens), self.block_size, None, self.medium, None)
            )
        return block

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; unreferenced cached blocks join the LRU
        tail first, so a sequence's last blocks are evicted before its first (as in vLLM:
        first blocks are the most shared)."""
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref > 0:
                continue
            self.used -= 1
            if b.key is not None and self.cached.get(b.key) is b:
                self.lru[b.key] = b

    def insert(
        self, keys: Sequence[int], parent: int | None, tokens: Sequence[Sequence[int]]
    ) -> int:
        """Add computed-elsewhere blocks (from the store) as cached, unreferenced blocks.

        Stops at the first block that does not fit; returns how many of ``keys`` are now
        cached. A block fits when a blank block or an evictable block of *another* chain is
        left: evicting one of this call's own blocks would cut the chain it extends."""
        n = 0
        own = 0  # blocks of ``keys`` in the LRU (evictable, but not to make room for ``keys``)
        for key, toks in zip(keys, tokens, strict=True):
            if key in self.cached:
                if key in self.lru:
                    self.lru.move_to_end(key)
                    own += 1
            else:
                if self.free - own <= 0:
                    break
                if self.blank <= 0:
                    self._evict_one()
                b = Block(None)
                b.ref = 0
                self.used += 1
                b = self.commit(b, key, parent, tuple(toks))
                self.used -= 1
                self.lru[key] = b
                own += 1
            parent = key
            n += 1
        return n

    def clear(self) -> int:
        """Forget every cached block (blocks in use stay allocated but uncached)."""
        n = len(self.cached)
        for b in self.cached.values():
            b.key = None
        self.cached.clear()
        self.lru.clear()
        self.events.append(AllBlocksCleared())
        return n

    def take_events(self) -> list[KVEvent]:
        ev, self.events = self.events, []
        return ev
