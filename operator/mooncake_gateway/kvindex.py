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
gateway never saw (events lost beyond replay) leaves those blocks out of the index,
counted in :attr:`InstanceFeed.orphans` — a missing entry costs a cache miss, a
wrong one would cost a wrong route.
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
    clears: int = 0
    orphans: int = 0
    mismatched_block_size: int = 0
    last_seq: int = -1


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
        """Forget everything ``iid`` holds (resync after lost events, restart, down)."""
        f = self.feed(iid)
        f.engine_to_key.clear()
        f.clears += 1
        self.index.clear(iid)

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
            state = unmix64(parent)
        n = min(len(ev.block_hashes), len(ev.token_ids) // bs)
        if n == 0:
            return
        keys = block_keys(np.asarray(ev.token_ids[: n * bs], dtype=np.int64), bs, state)
        for h, k in zip(ev.block_hashes[:n], keys, strict=True):
            f.engine_to_key[hash_to_int(h)] = k
        f.stored_blocks += n
        self.index.store(f.iid, keys, tier_of_medium(ev.medium))
