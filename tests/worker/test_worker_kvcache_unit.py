"""The prefix cache on its own: block accounting, LRU eviction, commits, inserts of blocks
computed elsewhere, and the vLLM-style KV events it logs (one event per run of chained
blocks, removals merged)."""

from __future__ import annotations

import pytest
from mooncake_contract.kvevents.codec import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake_worker.kvcache import Block, CacheFull, PrefixCache

BS = 4


def toks(i: int) -> tuple[int, ...]:
    return tuple(range(i * BS, (i + 1) * BS))


def cached_chain(c: PrefixCache, keys: list[int]) -> list[Block]:
    """Compute and cache a chain of blocks the way a sequence does; still referenced."""
    c.reserve(len(keys))
    out = []
    parent = None
    for k in keys:
        out.append(c.commit(c.take_reserved(), k, parent, toks(k)))
        parent = k
    return out


def test_sizes_must_be_positive() -> None:
    for cap, bs in ((0, 4), (4, 0), (-1, 4), (4, -1), (0, 0)):
        with pytest.raises(ValueError, match=r"^capacity and block_size must be positive$"):
            PrefixCache(cap, bs)
    c = PrefixCache(1, 1)
    assert (c.capacity, c.block_size, c.medium) == (1, 1, "GPU")
    assert (c.used, c.reserved, c.blank, c.free, c.usage) == (0, 0, 1, 1, 0.0)
    assert PrefixCache(2, 8, "CPU").medium == "CPU"


def test_block_keeps_its_key_and_tokens() -> None:
    b = Block(7, (1, 2))
    assert (b.key, b.ref, b.tokens) == (7, 1, (1, 2))
    assert (Block().key, Block().tokens) == (None, ())


def test_commit_logs_one_event_per_chain_and_starts_anew_off_chain() -> None:
    c = PrefixCache(8, BS, "CPU")
    blocks = cached_chain(c, [1, 2, 3])
    assert [b.key for b in blocks] == [1, 2, 3] and [b.tokens for b in blocks] == [
        toks(1), toks(2), toks(3)]
    assert c.events == [BlockStored([1, 2, 3], None, [*toks(1), *toks(2), *toks(3)], BS, None,
                                    "CPU", None)]
    # a block whose parent is not the last one logged starts a new event
    c.reserve(1)
    c.commit(c.take_reserved(), 9, 1, toks(9))
    assert c.events[-1] == BlockStored([9], 1, list(toks(9)), BS, None, "CPU", None)
    # so does one after an event of another kind
    c.events.append(AllBlocksCleared())
    c.reserve(1)
    c.commit(c.take_reserved(), 10, 9, toks(10))
    assert c.events[-1] == BlockStored([10], 9, list(toks(10)), BS, None, "CPU", None)
    assert len(c.take_events()) == 4 and c.events == []


def test_commit_does_not_extend_an_event_of_another_block_size() -> None:
    c = PrefixCache(8, BS)
    c.events.append(BlockStored([1], None, list(range(8)), 8))
    c.reserve(1)
    c.commit(c.take_reserved(), 2, 1, toks(2))
    assert c.events[-1] == BlockStored([2], 1, list(toks(2)), BS, None, "GPU", None)
    assert c.events[0].block_hashes == [1]  # type: ignore[union-attr]


def test_commit_of_a_key_already_cached_hands_out_the_cached_block() -> None:
    c = PrefixCache(8, BS)
    (first,) = cached_chain(c, [5])
    c.take_events()
    c.reserve(1)
    private = c.take_reserved()
    assert c.used == 2
    got = c.commit(private, 5, None, toks(5))
    assert got is first and first.ref == 2 and private.ref == 0
    assert c.used == 1 and c.cached == {5: first} and private.key is None
    assert c.events == []  # nothing new to announce
    assert c.commit(first, 5, None, toks(5)) is first and first.ref == 2


def test_release_puts_last_blocks_first_in_line_for_eviction() -> None:
    c = PrefixCache(4, BS)
    blocks = cached_chain(c, [1, 2, 3])
    c.reserve(1)
    private = c.take_reserved()
    assert (c.used, c.blank, c.free, c.usage) == (4, 0, 0, 1.0)
    c.release([*blocks, private])
    assert c.used == 0 and list(c.lru) == [3, 2, 1]  # the private block is not cached
    assert all(c.lru[k] is b for k, b in zip([1, 2, 3], blocks, strict=True))
    assert (c.blank, c.free) == (1, 4)
    c.take_events()
    c.reserve(3)  # one blank block, two evicted: 3 then 2, in one event
    assert c.events == [BlockRemoved([3, 2], "GPU")]
    assert set(c.cached) == {1} and c.reserved == 3 and c.free == 1 and c.blank == 0


def test_a_block_still_referenced_is_not_evictable() -> None:
    c = PrefixCache(4, BS)
    blocks = cached_chain(c, [1, 2])
    shared = c.acquire([1])  # a second sequence shares block 1
    assert shared == [blocks[0]] and blocks[0].ref == 2 and c.used == 2
    c.release(blocks)
    assert list(c.lru) == [2] and blocks[0].ref == 1 and c.used == 1
    # re-acquiring an evictable block takes it out of the LRU
    assert c.acquire([2]) == [blocks[1]] and not c.lru and c.used == 2
    c.release([blocks[1]])
    c.release(shared)
    assert list(c.lru) == [2, 1] and c.used == 0


def test_reserve_takes_exactly_what_is_free_or_raises() -> None:
    c = PrefixCache(4, BS, "CPU")
    c.release(cached_chain(c, [1, 2]))
    c.take_events()
    with pytest.raises(CacheFull, match="need 5 blocks, 4 free"):
        c.reserve(5)
    assert c.events == [] and c.reserved == 0
    c.reserve(4)
    assert c.events == [BlockRemoved([2, 1], "CPU")] and c.reserved == 4 and c.free == 0
    c.unreserve(3)
    assert c.reserved == 1 and c.free == 3
    b = c.take_reserved()
    assert b.key is None and b.ref == 1 and (c.reserved, c.used) == (0, 1)


def test_evictions_after_another_event_start_a_new_removal() -> None:
    c = PrefixCache(3, BS)
    c.release(cached_chain(c, [1, 2]))
    c.reserve(2)  # one blank, evicts 2: after the BlockStored, a new BlockRemoved
    assert c.events[-1] == BlockRemoved([2], "GPU") and len(c.events) == 2


def test_insert_adds_unreferenced_cached_blocks_with_their_chain() -> None:
    c = PrefixCache(6, BS, "CPU")
    n = c.insert([1, 2, 3], None, [toks(1), toks(2), toks(3)])
    assert n == 3 and c.used == 0 and list(c.lru) == [1, 2, 3]
    assert [c.cached[k].tokens for k in (1, 2, 3)] == [toks(1), toks(2), toks(3)]
    assert all(c.cached[k].ref == 0 and c.lru[k] is c.cached[k] for k in (1, 2, 3))
    assert c.events == [BlockStored([1, 2, 3], None, [*toks(1), *toks(2), *toks(3)], BS, None,
                                    "CPU", None)]
    c.take_events()
    # a continuation under a parent: keys already cached are refreshed, the rest added
    assert c.insert([3, 4], 2, [toks(3), toks(4)]) == 2
    assert list(c.lru) == [1, 2, 3, 4]
    assert c.events == [BlockStored([4], 3, list(toks(4)), BS, None, "CPU", None)]
    assert c.acquire([1]) and c.insert([1, 2], None, [toks(1), toks(2)]) == 2
    assert list(c.lru) == [3, 4, 2] and c.cached[1].ref == 1  # a used block stays used


def test_insert_evicts_when_no_block_is_blank_and_stops_when_none_is_free() -> None:
    c = PrefixCache(3, BS)
    c.insert([1, 2], None, [toks(1), toks(2)])
    held = c.acquire([1])
    c.take_events()
    # block 3 takes the blank block, block 4 evicts 2 (the only evictable one), block 5
    # finds nothing free (1, 3 and 4 fill the cache; 3 and 4 are evictable but newer)
    n = c.insert([3, 4], None, [toks(3), toks(4)])
    assert n == 2 and set(c.cached) == {1, 3, 4}
    assert c.events == [BlockStored([3], None, list(toks(3)), BS, None, "GPU", None),
                        BlockRemoved([2], "GPU"),
                        BlockStored([4], 3, list(toks(4)), BS, None, "GPU", None)]
    c.reserve(2)  # nothing is free now
    assert c.free == 0
    assert c.insert([6, 7], None, [toks(6), toks(7)]) == 0 and 6 not in c.cached
    c.release(held)
    assert c.used == 0


def test_insert_uses_the_last_free_block() -> None:
    c = PrefixCache(2, BS)
    c.insert([9], None, [toks(9)])  # another chain's evictable block
    c.reserve(1)
    assert c.free == 1 and c.blank == 0
    assert c.insert([5], None, [toks(5)]) == 1 and set(c.cached) == {5}  # 9 evicted for it


def test_insert_never_evicts_its_own_chain() -> None:
    """Room for one block: the chain's second block would have to evict its first (bug:
    insert evicted it, returned 2 and left block 2 cached without its parent)."""
    c = PrefixCache(2, BS)
    c.reserve(1)
    assert c.insert([1, 2], None, [toks(1), toks(2)]) == 1 and set(c.cached) == {1}
    assert not any(isinstance(ev, BlockRemoved) for ev in c.events)
    # a chain refreshed from the LRU counts as its own, too
    c.take_events()
    assert c.insert([1, 3], None, [toks(1), toks(3)]) == 1 and set(c.cached) == {1}
    assert c.events == []
    # counting the chain's own blocks: two refreshed, or two new, leave no room here
    e = PrefixCache(3, BS)
    e.insert([1, 2], None, [toks(1), toks(2)])
    e.reserve(1)
    assert e.insert([1, 2, 3], None, [toks(1), toks(2), toks(3)]) == 2
    assert set(e.cached) == {1, 2}
    f = PrefixCache(3, BS)
    f.reserve(1)
    assert f.insert([1, 2, 3], None, [toks(1), toks(2), toks(3)]) == 2
    assert set(f.cached) == {1, 2}
    # one refreshed block leaves room when another chain's block can go
    g = PrefixCache(3, BS)
    g.insert([1], None, [toks(1)])
    g.insert([7], None, [toks(7)])
    g.reserve(1)
    assert g.insert([1, 2], None, [toks(1), toks(2)]) == 2 and set(g.cached) == {1, 2}
    # with an older chain's block evictable, the new chain takes that one
    d = PrefixCache(3, BS)
    d.insert([7], None, [toks(7)])
    d.reserve(1)
    assert d.insert([1, 2], None, [toks(1), toks(2)]) == 2 and set(d.cached) == {1, 2}
    assert list(d.lru) == [1, 2]


def test_insert_needs_one_token_list_per_key() -> None:
    c = PrefixCache(4, BS)
    with pytest.raises(ValueError):
        c.insert([1, 2], None, [toks(1)])


def test_clear_forgets_every_cached_block_but_keeps_those_in_use() -> None:
    c = PrefixCache(4, BS)
    blocks = cached_chain(c, [1, 2])
    c.insert([3], 2, [toks(3)])
    c.take_events()
    assert c.clear() == 3
    assert c.cached == {} and not c.lru and c.events == [AllBlocksCleared()]
    assert all(b.key is None for b in blocks) and c.used == 2
    c.release(blocks)  # uncached now: they never reach the LRU
    assert not c.lru and c.used == 0 and c.free == 4
    assert c.match([1, 2]) == 0
