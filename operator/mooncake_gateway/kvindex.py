"""KV events → the Conductor core's :class:`~mooncake_conductor.index.PrefixIndex`.

Engines name blocks with their own hashes (vLLM's depend on its hash algorithm and
seed). The gateway never trusts them as keys: every ``BlockStored`` carries the
tokens of exactly the stored blocks, so the gateway computes its *own* chained block
keys (:func:`mooncake_conductor.blockkeys.block_keys`, engine block size, the model's
namespace seed) and remembers ``engine hash → own key`` per instance for later
``BlockRemoved`` events.

Continuing a chain from a parent: a key is ``mix64(h)`` of the polynomial prefix
state ``h``, and ``mix64`` is a bijection, so the parent's state is
``unmix64(parent key)`` and ``block_keys(tokens, block_size, seed=that state)``
continues the chain exactly as if the whole prefix had been hashed. A parent the
gateway never saw (stored in events lost beyond replay) leaves those blocks out of the
index, counted in :attr:`InstanceFeed.orphans` — a missing entry costs a cache miss, a
wrong one would cost a wrong route.

Two ways to lose track of an instance:

- :meth:`IndexFeeder.reset` forgets everything it holds: the engine says so
  (``AllBlocksCleared``), its publisher restarted, it is down or gone. What it held then
  is known to be gone, or unknowable.
- :meth:`IndexFeeder.gap` is a gap in its event stream that the replay could not fill.
  The engine is the same and its cache mostly too, so its entries and its ``engine hash
  → own key`` map are **kept**: later blocks that extend a block stored before the gap
  are indexed, not orphaned. What the gap may have hidden: stores (their children are
  orphans, as above) and removals (entries the engine no longer holds).

The rule that bounds those stale entries is the index's own LRU: an instance's entries
are bounded by the engine's cache size (its scraped ``num_gpu_blocks``; the model's
``index_capacity_blocks`` until then) and kept in the order they were stored (the gateway
never touches them: a cached hit sends no event). Entries kept across a gap are
therefore older than everything stored after it, so once the instance is full each new
block evicts one of them first: after at most one turnover of the cache (as many blocks
stored as it holds) none is left that the engine has not stored again. An engine removes
blocks when its cache is full and evicting, which is when that turnover runs. Until then
a stale entry costs at most one mis-route per prefix: the request sent there makes the
engine store that prefix again, which makes the entry true. There is no timer: an engine
keeps a hot prefix cached without sending anything about it, so dropping kept entries
after a time would drop the roots its newer blocks hang from and leave routing as blind
as forgetting at the gap.
:attr:`InstanceFeed.unconfirmed` holds the kept entries the engine has not vouched for
since (stored again, or named as the parent of a new block);
:meth:`IndexFeeder.unconfirmed_blocks` counts those still held (not removed or evicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mooncake_conductor.blockkeys import MASK64, block_keys
from mooncake_conductor.index import PrefixIndex, tier_of_medium
from mooncake_contract.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    hash_to_int,
)

_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_C1_INV = pow(_C1, -1, 1 << 64)
_C2_INV = pow(_C2, -1, 1 << 64)
_WORD_BITS = 64


def _unxorshift(y: int, shift: int) -> int:
    x = y
    for _ in range(_WORD_BITS // shift + 1):
        x = y ^ (x >> shift)
    return x & MASK64


def unmix64(key: int) -> int:
    """Inverse of :func:`mooncake_conductor.blockkeys.mix64` (SplitMix64 finaliser)."""
    x = _unxorshift(key & MASK64, 31)
    x = (x * _C2_INV) & MASK64
    x = _unxorshift(x, 27)
    x = (x * _C1_INV) & MASK64
    return _unxorshift(x, 30)


@dataclass(slots=True)
class InstanceFeed:
    """Event bookkeeping of one instance."""

    iid: int
    engine_to_key: dict[int, int] = field(default_factory=dict)
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    #: times everything was forgotten (:meth:`IndexFeeder.reset`)
    clears: int = 0
    #: blocks whose parent the gateway does not know, left out of the index
    orphans: int = 0
    mismatched_block_size: int = 0
    last_seq: int = -1
    #: unfillable gaps survived with the entries kept (:meth:`IndexFeeder.gap`)
    gaps_kept: int = 0
    #: index entries held at those gaps, summed over them
    kept_blocks: int = 0
    #: own keys kept across a gap that the engine has not vouched for since (stored again
    #: or extended); some may have left the index: :meth:`IndexFeeder.unconfirmed_blocks`
    unconfirmed: set[int] = field(default_factory=set)


class IndexFeeder:
    """Applies KV-event batches of many instances to one :class:`PrefixIndex`."""

    def __init__(self, index: PrefixIndex, block_size: int, seed: int) -> None:
        self.index = index
        self.block_size = block_size
        self.seed = seed
        self.feeds: dict[int, InstanceFeed] = {}
        self.events_total = 0

    def feed(self, iid: int) -> InstanceFeed:
        f = self.feeds.get(iid)
        if f is None:
            f = self.feeds[iid] = InstanceFeed(iid)
        return f

    def reset(self, iid: int) -> None:
        """Forget everything ``iid`` holds (publisher restart, ``AllBlocksCleared``, down,
        gone, a resubscription)."""
        f = self.feed(iid)
        f.engine_to_key.clear()
        f.unconfirmed.clear()
        f.clears += 1
        self.index.clear(iid)

    def gap(self, iid: int) -> None:
        """A gap in ``iid``'s events that the replay could not fill: keep what it holds,
        to age out with the cache's turnover (the module's rule). All of it is
        unconfirmed again, whatever an earlier gap's left."""
        f = self.feed(iid)
        f.unconfirmed = self.index.blocks(iid)
        f.gaps_kept += 1
        f.kept_blocks += len(f.unconfirmed)

    def unconfirmed_blocks(self, iid: int) -> int:
        """How many of ``iid``'s entries are still unconfirmed since a gap; forgets those
        no longer held (removed, or evicted: by new blocks, or when the capacity shrank to
        the engine's)."""
        f = self.feed(iid)
        if f.unconfirmed:
            index, bit = self.index, 1 << iid
            f.unconfirmed = {k for k in f.unconfirmed if index.holder_mask(k) & bit}
        return len(f.unconfirmed)

    def apply(self, iid: int, seq: int, batch: KVEventBatch) -> None:
        f = self.feed(iid)
        f.last_seq = seq
        for ev in batch.events:
            f.events += 1
            self.events_total += 1
            if isinstance(ev, BlockStored):
                self._stored(f, ev)
            elif isinstance(ev, BlockRemoved):
                keys = [
                    k for h in ev.block_hashes
                    if (k := f.engine_to_key.pop(hash_to_int(h), None)) is not None
                ]
                f.removed_blocks += len(keys)
                self.index.remove(iid, keys)
            elif isinstance(ev, AllBlocksCleared):
                self.reset(iid)
        self.index.sync()  # the mirror's update is paid here, not by the next decision

    def _stored(self, f: InstanceFeed, ev: BlockStored) -> None:
        bs = self.block_size
        if ev.block_size != bs:
            f.mismatched_block_size += 1
            return
        if ev.parent_block_hash is None:
            state = self.seed
        else:
            parent = f.engine_to_key.get(hash_to_int(ev.parent_block_hash))
            if parent is None:
                f.orphans += len(ev.block_hashes)
                return
            f.unconfirmed.discard(parent)  # the engine holds what it extends
            state = unmix64(parent)
        n = min(len(ev.block_hashes), len(ev.token_ids) // bs)
        if n == 0:
            return
        keys = block_keys(np.asarray(ev.token_ids[: n * bs], dtype=np.int64), bs, state)
        for h, k in zip(ev.block_hashes[:n], keys, strict=True):
            f.engine_to_key[hash_to_int(h)] = k
        f.stored_blocks += n
        self.index.store(f.iid, keys, tier_of_medium(ev.medium))
        if f.unconfirmed:
            f.unconfirmed.difference_update(keys)  # stored again: true, and newest
