"""The index feeder across a KV-event gap the replay could not fill (``IndexFeeder.gap``)
against the ways it forgets everything (``reset``, ``AllBlocksCleared``): kept entries stay
matchable and extendable, removals still apply, and kept entries age out in the
instance's LRU before anything stored after the gap."""

from __future__ import annotations

from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_conductor.index import PrefixIndex
from mooncake_contract.kvevents.codec import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from mooncake_gateway.kvindex import IndexFeeder

BS = 4
SEED = namespace_seed("m", BS)


class Chain:
    """A prompt of ``blocks`` blocks; the engine names block ``i`` ``name * 100 + i``."""

    def __init__(self, name: int, blocks: int) -> None:
        self.tokens = list(range(name * 1000, name * 1000 + blocks * BS))
        self.hashes: list[BlockHash] = [name * 100 + i for i in range(blocks)]
        self.keys = block_keys(self.tokens, BS, SEED)

    def stored(self, start: int = 0, end: int | None = None) -> BlockStored:
        end = len(self.hashes) if end is None else end
        parent = self.hashes[start - 1] if start else None
        return BlockStored(self.hashes[start:end], parent,
                           self.tokens[start * BS : end * BS], BS)


def feeder(capacity: int = 1 << 12) -> IndexFeeder:
    return IndexFeeder(PrefixIndex(capacity), BS, SEED)


def apply(f: IndexFeeder, *events: KVEvent, iid: int = 0) -> None:
    f.apply(iid, f.feed(iid).last_seq + 1, KVEventBatch(0.0, list(events)))


def test_a_gap_keeps_what_the_instance_held_and_counts_it() -> None:
    a, b = Chain(1, 3), Chain(2, 2)
    f = feeder()
    apply(f, a.stored(), b.stored())
    apply(f, b.stored(), iid=1)
    f.gap(0)
    feed = f.feeds[0]
    assert f.index.match(0, a.keys) == 3 and f.index.match(0, b.keys) == 2
    assert f.index.size(0) == 5
    assert (feed.gaps_kept, feed.kept_blocks, feed.clears) == (1, 5, 0)
    assert f.unconfirmed_blocks(0) == 5
    # another instance is left alone
    assert f.feeds[1].gaps_kept == 0 and f.unconfirmed_blocks(1) == 0
    # a second gap: what is held then is unconfirmed, confirmed or not before (a kept
    # block counts again); what left the index since is not remembered
    c = Chain(3, 1)
    apply(f, c.stored(), BlockRemoved(a.hashes[1:]))
    assert f.unconfirmed_blocks(0) == 3
    f.gap(0)
    assert (feed.gaps_kept, feed.kept_blocks) == (2, 5 + 4)
    assert feed.unconfirmed == {a.keys[0], *b.keys, *c.keys}


def test_a_block_extending_a_parent_from_before_the_gap_is_indexed_not_an_orphan() -> None:
    a = Chain(1, 4)
    f = feeder()
    apply(f, a.stored(0, 2))
    f.gap(0)
    apply(f, a.stored(2, 4))  # its parent, block 1, was stored before the gap
    assert f.feeds[0].orphans == 0
    assert f.index.match(0, a.keys) == 4
    # the engine vouched for the parent it extended; the root is still unconfirmed
    assert f.unconfirmed_blocks(0) == 1
    assert f.feeds[0].unconfirmed == {a.keys[0]}


def test_after_a_reset_the_same_block_is_an_orphan() -> None:
    """What the gap keeps is what a reset (the old answer to a gap) loses."""
    a = Chain(1, 4)
    f = feeder()
    apply(f, a.stored(0, 2))
    f.reset(0)
    apply(f, a.stored(2, 4))
    assert f.feeds[0].orphans == 2
    assert f.index.size(0) == 0 and f.index.match(0, a.keys) == 0


def test_a_removal_after_the_gap_still_removes() -> None:
    a = Chain(1, 4)
    f = feeder()
    apply(f, a.stored())
    f.gap(0)
    apply(f, BlockRemoved(a.hashes[2:]))
    assert f.feeds[0].removed_blocks == 2
    assert f.index.match(0, a.keys) == 2 and f.index.size(0) == 2
    assert f.unconfirmed_blocks(0) == 2
    assert f.feeds[0].unconfirmed == set(a.keys[:2])
    # and the engine-hash map no longer names them: storing them again is fresh
    apply(f, a.stored(2, 4))
    assert f.index.match(0, a.keys) == 4 and f.unconfirmed_blocks(0) == 1


def test_kept_entries_age_out_first_as_new_blocks_are_stored() -> None:
    """Capacity 4 (the engine's cache): 4 blocks kept across the gap; every block stored
    after it evicts a kept one, leaf first, never one stored after the gap."""
    old, new = Chain(1, 4), Chain(2, 4)
    f = feeder(capacity=4)
    apply(f, old.stored())
    f.gap(0)
    apply(f, new.stored(0, 1))
    assert f.index.match(0, old.keys) == 3  # the leaf went first
    assert f.index.match(0, new.keys) == 1
    assert f.unconfirmed_blocks(0) == 3
    apply(f, new.stored(1, 3))
    assert f.index.match(0, old.keys) == 1
    assert f.index.match(0, new.keys) == 3
    apply(f, new.stored(3, 4))
    # one turnover of the cache: nothing from before the gap is left
    assert f.index.match(0, old.keys) == 0
    assert f.index.match(0, new.keys) == 4
    assert f.unconfirmed_blocks(0) == 0 and not f.feeds[0].unconfirmed


def test_a_kept_block_stored_again_is_confirmed_and_outlives_the_others() -> None:
    old, new = Chain(1, 3), Chain(2, 3)
    f = feeder(capacity=4)
    apply(f, old.stored())
    f.gap(0)
    apply(f, old.stored(0, 1))  # the engine stored the root again: true, and newest
    assert f.unconfirmed_blocks(0) == 2
    apply(f, new.stored())
    assert f.index.match(0, old.keys) == 1  # the root, not its unconfirmed children
    assert f.index.match(0, new.keys) == 3
    assert f.unconfirmed_blocks(0) == 0


def test_the_unconfirmed_count_follows_the_index_when_its_capacity_shrinks() -> None:
    a = Chain(1, 4)
    f = feeder()
    apply(f, a.stored())
    f.gap(0)
    f.index.add_instance(0, 1)  # the engine's num_gpu_blocks, scraped after the gap
    assert f.unconfirmed_blocks(0) == 1
    assert f.feeds[0].unconfirmed == {a.keys[0]}


def test_all_blocks_cleared_after_a_gap_forgets_everything() -> None:
    a = Chain(1, 4)
    f = feeder()
    apply(f, a.stored(0, 2))
    f.gap(0)
    apply(f, AllBlocksCleared())
    feed = f.feeds[0]
    assert f.index.size(0) == 0 and f.index.match(0, a.keys) == 0
    assert (feed.clears, f.unconfirmed_blocks(0), len(feed.engine_to_key)) == (1, 0, 0)
    apply(f, a.stored(2, 4))  # a child of what was cleared: unknown now
    assert feed.orphans == 2 and f.index.size(0) == 0


def test_a_reset_after_a_gap_forgets_everything() -> None:
    """A publisher restart, an instance down or gone: ``reset``, kept entries included."""
    a, b = Chain(1, 2), Chain(2, 2)
    f = feeder()
    apply(f, a.stored())
    f.gap(0)
    apply(f, b.stored())
    f.reset(0)
    feed = f.feeds[0]
    assert f.index.size(0) == 0
    assert f.index.match(0, a.keys) == 0 and f.index.match(0, b.keys) == 0
    assert (feed.clears, f.unconfirmed_blocks(0), len(feed.engine_to_key)) == (1, 0, 0)
    assert feed.gaps_kept == 1  # the counters of what happened stay
