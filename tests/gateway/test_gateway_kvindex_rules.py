"""The index feeder's counters and tiers on hand-made events (what ``/conductor/state``
and the gateway's metrics report, and what the Conductor prices)."""

from __future__ import annotations

from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_conductor.index import DRAM, HBM, STORE, PrefixIndex
from mooncake_contract.kvevents.codec import BlockRemoved, BlockStored, KVEventBatch
from mooncake_gateway.kvindex import IndexFeeder

BS = 4
SEED = namespace_seed("m", BS)
TOKENS = list(range(100, 100 + 3 * BS))
KEYS = block_keys(TOKENS, BS, SEED)


def feeder() -> IndexFeeder:
    return IndexFeeder(PrefixIndex(1 << 12), BS, SEED)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))  # type: ignore[arg-type]


def test_counters_add_up_over_events_and_instances() -> None:
    f = feeder()
    f.apply(0, 0, batch(BlockStored([1, 2], None, TOKENS[: 2 * BS], BS),
                        BlockStored([3], 2, TOKENS[2 * BS:], BS)))
    f.apply(1, 0, batch(BlockStored([1], None, TOKENS[:BS], BS)))
    f.apply(0, 1, batch(BlockRemoved([3, 2])))
    assert f.events_total == 4
    assert (f.feeds[0].events, f.feeds[1].events) == (3, 1)
    assert (f.feeds[0].stored_blocks, f.feeds[0].removed_blocks) == (3, 2)
    assert f.feeds[0].last_seq == 1
    assert f.index.match(0, KEYS) == 1
    assert f.index.match(1, KEYS) == 1


def test_skipped_blocks_are_counted_each_time() -> None:
    f = feeder()
    for _ in range(3):
        f.apply(0, 0, batch(BlockStored([5, 6], None, TOKENS[: 2 * BS], 2 * BS)))
    f.apply(0, 1, batch(BlockStored([7, 8], 99, TOKENS[: 2 * BS], BS)))  # unknown parent
    f.apply(0, 2, batch(BlockStored([9], 98, TOKENS[:BS], BS)))
    assert f.feeds[0].mismatched_block_size == 3
    assert f.feeds[0].orphans == 3
    assert f.index.size(0) == 0


def test_removing_blocks_never_stored_is_harmless() -> None:
    f = feeder()
    f.apply(0, 0, batch(BlockStored([1], None, TOKENS[:BS], BS)))
    f.apply(0, 1, batch(BlockRemoved([42, 43])))
    assert f.feeds[0].removed_blocks == 0
    assert f.index.match(0, KEYS) == 1


def test_the_event_medium_sets_the_tier() -> None:
    f = feeder()
    f.apply(0, 0, batch(BlockStored([1], None, TOKENS[:BS], BS, medium="CPU")))
    f.apply(1, 0, batch(BlockStored([1], None, TOKENS[:BS], BS, medium=None)))
    f.apply(2, 0, batch(BlockStored([1], None, TOKENS[:BS], BS, medium="cpu_tier2")))
    f.apply(3, 0, batch(BlockStored([1], None, TOKENS[:BS], BS)))  # GPU, the default
    assert f.index.tier_counts(0, KEYS[:1]) == {DRAM: 1}
    assert f.index.tier_counts(1, KEYS[:1]) == {HBM: 1}
    assert f.index.tier_counts(3, KEYS[:1]) == {HBM: 1}
    assert set(f.index.tier_counts(2, KEYS[:1])) <= {DRAM, STORE}
    assert f.index.tier_counts(2, KEYS[:1]) != {HBM: 1}
