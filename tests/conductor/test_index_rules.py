"""The prefix index's rules on small hand-made cases: match lengths per instance (dict
walk and vectorised mirror alike), eviction order, tiers, removal, pending prefixes, the
instance set and when the vectorised mirror is built, synced and dropped."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mooncake_conductor import index as index_mod
from mooncake_conductor import kernels, keytable
from mooncake_conductor.index import (
    DRAM,
    HBM,
    STORE,
    VECTOR_MIN_KEYS,
    PrefixIndex,
    _bits,
    _matches,
)

DICT, VEC = 10**9, 1  # vector_min_keys: the dict walk, or the mirror from the first key


@pytest.fixture(params=[DICT, VEC], ids=["dict", "vec"])
def vmk(request: pytest.FixtureRequest) -> int:
    value: int = request.param
    return value


def lengths(ix: PrefixIndex, keys: list[int], mask: int,
            pending_mask: int | None = None) -> tuple[dict[int, int], dict[int, int], Any, int]:
    stored, view, best, length = ix.match_lengths(keys, mask, pending_mask)
    assert stored.dtype == np.int64 and view.dtype == np.int64
    return ({i: int(v) for i, v in enumerate(stored) if v},
            {i: int(v) for i, v in enumerate(view) if v}, best, length)


# -- helpers -----------------------------------------------------------------------------------
def test_bits_lowest_first() -> None:
    assert list(_bits(0b1011001)) == [0, 3, 4, 6]
    assert list(_bits(0)) == []
    assert list(_bits(1 << 130 | 2)) == [1, 130]


def test_matches_from_drops() -> None:
    # instance 0 drops at the first key (left out), 1 after two keys, 3 after four;
    # 2 and 5 hold all five
    drops = [(0, 0b101111, 0b101110), (2, 0b101110, 0b101100), (4, 0b101100, 0b100100)]
    got = _matches(drops, 0b100100, 5)
    assert got == {1: 2, 3: 4, 2: 5, 5: 5} and list(got) == [1, 3, 2, 5]
    assert _matches([], 0b11, 3) == {0: 3, 1: 3}
    assert _matches([(0, 0b1, 0)], 0, 4) == {}


# -- instances ---------------------------------------------------------------------------------
def test_capacity_must_be_positive() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"^capacity_blocks must be positive$"):
            PrefixIndex(bad)
    ix = PrefixIndex(5)
    with pytest.raises(ValueError, match=r"^capacity_blocks must be positive$"):
        ix.add_instance(0, 0)
    with pytest.raises(ValueError, match=r"^capacity_blocks must be positive$"):
        ix.add_instance(0, -2)


def test_a_new_index() -> None:
    ix = PrefixIndex(5)
    assert (ix.live_mask, len(ix), ix.evictions, ix.size(), ix.default_capacity) == (0, 0, 0, 0, 5)
    assert ix.vector_min_keys == VECTOR_MIN_KEYS and ix._mirror is None
    assert not ix.has_pending and ix.match_all([1, 2]) == {}
    three = PrefixIndex(7, instances=3)
    assert three.live_mask == 0b111 and [three.capacity(i) for i in range(3)] == [7, 7, 7]
    assert [three.size(i) for i in range(3)] == [0, 0, 0] and three.size() == 0


def test_add_instance_sets_capacity_and_evicts_to_it() -> None:
    ix = PrefixIndex(10)
    ix.add_instance(4, capacity_blocks=3)
    assert ix.live_mask == 1 << 4 and ix.capacity(4) == 3
    assert [ix.capacity(i) for i in range(4)] == [10] * 4  # placeholders, not live
    assert [ix.blocks(i) for i in range(5)] == [set()] * 5 and ix.size() == 0
    ix.store(4, [1, 2, 3])
    ix.add_instance(4)  # again: the default capacity, the blocks kept
    assert ix.capacity(4) == 10 and ix.blocks(4) == {1, 2, 3}
    ix.store(4, [4, 5])  # LRU (oldest first): 3, 2, 1, 5, 4
    ix.add_instance(4, 2)
    assert ix.blocks(4) == {4, 5} and ix.evictions == 3 and len(ix) == 2
    assert ix.live_mask == 1 << 4
    ix.add_instance(1, 5)
    assert ix.live_mask == 0b10010 and ix.size() == 2 and ix.size(1) == 0
    ix.add_instance(2, 2)  # storing keeps an instance's own capacity
    assert ix.store(2, [7, 8, 9]) == [9] and ix.capacity(2) == 2


def test_remove_instance_forgets_it() -> None:
    ix = PrefixIndex(10, instances=3)
    ix.store(0, [1, 2])
    ix.store(1, [1, 3])
    ix.add_pending(0, [7])
    ix.add_pending(2, [7])
    ix.remove_instance(0)
    assert ix.live_mask == 0b110
    assert ix.blocks(0) == set() and ix.size() == 2 and ix.size(0) == 0
    assert ix.holders == {1: 0b10, 3: 0b10}
    assert ix._pending == {7: 0b100} and ix.pending_size(0) == 0
    ix.remove_instance(3)  # never added: nothing happens
    ix.remove_instance(9)
    assert ix.live_mask == 0b110
    ix.store(0, [5])  # back, empty, with the default capacity
    assert ix.live_mask == 0b111 and ix.blocks(0) == {5} and ix.match(0, [5]) == 1


def test_unknown_instances_hold_nothing() -> None:
    ix = PrefixIndex(10, instances=2)
    ix.store(0, [1])
    for inst in (2, 5):
        assert ix.blocks(inst) == set()
        ix.clear(inst)
        ix.remove(inst, [1])
    ix.remove_instance(1)
    assert ix.blocks(1) == set()
    ix.clear(1)
    ix.remove(1, [1])
    assert ix.holders == {1: 1} and ix.size() == 1 and ix.live_mask == 1


# -- storing and the LRU --------------------------------------------------------------------------
def test_store_touch_demote_and_evict() -> None:
    ix = PrefixIndex(4, instances=2)
    assert ix.store(0, [1, 2, 3]) == []  # LRU order (oldest first): 3, 2, 1
    ix.store(1, [1, 2])
    assert ix.store(0, [4, 5]) == [3]  # 3, 2, 1, 5, 4: the prefix's last block goes
    assert ix.evictions == 1 and ix.holders == {1: 0b11, 2: 0b11, 4: 1, 5: 1}
    ix.touch(0, [2, 9])  # 1, 5, 4, 2 (9 is not held: ignored)
    assert ix.store(0, [6]) == [1]
    assert ix.holders[1] == 0b10  # instance 1 still holds it
    ix.demote(0, [6, 4, 9])  # 4, 6, 5, 2
    assert ix.store(0, [7, 8]) == [4, 6]
    assert ix.evictions == 4 and ix.size(0) == 4 and ix.blocks(0) == {5, 2, 7, 8}
    ix.store(0, [2])  # held: just moved to the recent end
    assert ix.store(0, [9]) == [5] and ix.evictions == 5
    assert ix.blocks(1) == {1, 2} and len(ix) == 5 and ix.size() == 6
    ix.touch(0, [8, 7])  # 2, 9, 7, 8: the first key is the most recent
    assert ix.store(0, [10, 11, 12]) == [2, 9, 7]


def test_tiers_keep_the_fastest() -> None:
    ix = PrefixIndex(10, instances=1)
    ix.store(0, [1, 2, 3], DRAM)
    ix.store(0, [1], HBM)  # faster: taken
    ix.store(0, [2], STORE)  # slower: the DRAM copy stays
    assert ix.tier_counts(0, [1, 2, 3, 4]) == {HBM: 1, DRAM: 2}
    assert ix.tier_counts(0, [2, 3, 3]) == {DRAM: 3}
    ix.store(0, [4, 5], STORE)
    assert ix.tier_counts(0, [1, 2, 3, 4, 5]) == {HBM: 1, DRAM: 2, STORE: 2}
    assert ix.tier_counts(0, []) == {}


def test_remove_and_clear_one_instance(vmk: int) -> None:
    ix = PrefixIndex(10, instances=3, vector_min_keys=vmk)
    for inst in range(3):
        ix.store(inst, [1, 2, 3])
    ix.add_pending(1, [4])
    ix.add_pending(1, [4])  # two references
    ix.add_pending(2, [4, 5])
    assert ix.match_all([1, 2, 3, 4, 5], include_pending=True) == {0: 3, 1: 4, 2: 5}
    ix.remove(0, [2, 9])
    assert ix.holders == {1: 0b111, 2: 0b110, 3: 0b111}
    assert ix.match_all([1, 2, 3]) == {0: 1, 1: 3, 2: 3}
    ix.clear(1)  # its blocks and every reference of its pending ones
    assert ix.blocks(1) == set() and ix.holders == {1: 0b101, 2: 0b100, 3: 0b101}
    assert ix._pending == {4: 0b100, 5: 0b100} and ix.pending_size(2) == 2
    assert ix.match_all([1, 2, 3, 4, 5], include_pending=True) == {0: 1, 2: 5}
    assert ix.live_mask == 0b111  # cleared, still there
    ix.remove(2, [1, 2, 3])
    ix.remove(0, [1, 3])
    assert ix.holders == {} and len(ix) == 0 and ix.match_all([1]) == {}


# -- pending -----------------------------------------------------------------------------------
def test_pending_references(vmk: int) -> None:
    ix = PrefixIndex(10, instances=2, vector_min_keys=vmk)
    ix.store(0, [1, 2])
    ix.add_pending(1, [1, 2, 3])
    ix.add_pending(1, [1])
    ix.add_pending(0, [3])
    assert ix.has_pending and ix.pending_size(1) == 3 and ix.pending_size(0) == 1
    assert ix.match(0, [1, 2, 3]) == 2 and ix.match(0, [1, 2, 3], include_pending=True) == 3
    assert ix.match(1, [1, 2, 3]) == 0 and ix.match(1, [1, 2, 3], True) == 3
    assert ix.match(0, [9], True) == 0 and ix.match(1, [9, 1], True) == 0
    assert ix.match_all([1, 2, 3], include_pending=True) == {0: 3, 1: 3}
    assert ix.match_all([1, 2, 3]) == {0: 2}
    ix.remove_pending(1, [1, 2, 9])  # one reference each; 9 was never pending
    assert ix.pending_size(1) == 2 and ix.match(1, [1, 2, 3], True) == 1
    assert ix.match_all([1, 2, 3], include_pending=True) == {0: 3, 1: 1}
    ix.remove_pending(1, [1, 3])
    ix.remove_pending(0, [3])
    assert not ix.has_pending and ix._pending == {} and ix._pending_count == {}
    assert ix.match_all([1, 2, 3], include_pending=True) == {0: 2}


# -- matching ----------------------------------------------------------------------------------
def test_match_all_per_instance(vmk: int) -> None:
    ix = PrefixIndex(100, instances=5, vector_min_keys=vmk)
    ix.store(0, [1, 2, 3, 4, 5, 6])
    ix.store(1, [1, 2])
    ix.store(2, [1, 2, 3, 4, 5, 6])
    ix.store(3, [2, 3])  # not the first block: matches nothing
    ix.store(4, [1, 2, 3, 4])
    keys = [1, 2, 3, 4, 5, 6, 7]
    got = ix.match_all(keys)
    assert got == {1: 2, 4: 4, 0: 6, 2: 6} and list(got) == [1, 4, 0, 2]
    assert ix.match_all(keys[:6]) == {1: 2, 4: 4, 0: 6, 2: 6}
    assert ix.match_all(keys, mask=0b10110) == {1: 2, 4: 4, 2: 6}
    assert ix.match_all(keys, mask=0b1000) == {} and ix.match_all(keys, mask=0) == {}
    assert ix.match_all([]) == {} and ix.match_all(np.array([], dtype=np.uint64)) == {}
    assert ix.match_all(np.array(keys, dtype=np.uint64)) == got
    assert ix.match_all(np.array(keys, dtype=np.int64)) == got
    assert ix.match_all([9, 1]) == {}
    assert [ix.match(i, keys) for i in range(6)] == [6, 2, 6, 0, 4, 0]
    ix.remove_instance(2)
    assert ix.match_all(keys) == {1: 2, 4: 4, 0: 6}


def test_match_all_over_long_runs(vmk: int) -> None:
    # drops after 1, 2, 3, 5, 8, 13 and 21 blocks, one instance each, the rest hold 40
    ix = PrefixIndex(100, instances=9, vector_min_keys=vmk)
    keys = list(range(100, 140))
    ends = [1, 2, 3, 5, 8, 13, 21, 40, 40]
    for inst, end in enumerate(ends):
        ix.store(inst, keys[:end])
    want = dict(enumerate(ends))
    assert ix.match_all(keys) == want
    for n in range(1, 41):
        assert ix.match_all(keys[:n]) == {i: min(e, n) for i, e in enumerate(ends)}
    assert ix.match_all([*keys, 7]) == want


def test_wide_instance_ids(vmk: int) -> None:
    ix = PrefixIndex(100, vector_min_keys=vmk)
    ix.add_instance(3)
    ix.add_instance(70)
    ix.add_instance(127)
    ix.store(3, [1, 2, 3])
    ix.store(70, [1, 2])
    ix.store(127, [1])
    ix.add_pending(70, [3])
    assert ix.match_all([1, 2, 3]) == {127: 1, 70: 2, 3: 3}
    assert ix.match_all([1, 2, 3], include_pending=True) == {127: 1, 3: 3, 70: 3}
    assert ix.match_all([1, 2, 3], mask=1 << 70) == {70: 2}
    assert lengths(ix, [1, 2, 3], -1, -1) == ({3: 3, 70: 2, 127: 1},
                                              {3: 3, 70: 3, 127: 1}, 3, 3)
    if vmk == VEC:  # ids past 63: the tables hold set ids, the sets two-word masks
        mirror = ix._mirror
        assert mirror is not None and mirror.sets is not None
        assert mirror.stored.words == mirror.pending.words == 1 and mirror.sets.words == 2
        # stored {3, 70, 127}, {3, 70}, {3}; pending {70}
        assert len(mirror.sets) == 4


def test_match_lengths_both_views(vmk: int) -> None:
    ix = PrefixIndex(100, instances=3, vector_min_keys=vmk)
    ix.store(0, [1, 2])
    ix.store(1, [1, 2, 3])
    ix.store(2, [1, 2, 3])
    keys = [1, 2, 3, 4]
    # nothing pending: the view is the stored array itself
    for pmask in (None, -1, 0b11):
        stored, view, best, length = ix.match_lengths(keys, -1, pmask)
        assert view is stored and (best, length) == (1, 3)
        assert stored.dtype == np.int64 and len(stored) == 64
        assert stored[:3].tolist() == [2, 3, 3] and not stored[3:].any()
    ix.add_pending(0, [3, 4])
    ix.add_pending(2, [4])
    assert lengths(ix, keys, -1) == ({0: 2, 1: 3, 2: 3}, {0: 2, 1: 3, 2: 3}, 1, 3)
    assert lengths(ix, keys, -1, -1) == ({0: 2, 1: 3, 2: 3}, {0: 4, 1: 3, 2: 4}, 1, 3)
    assert lengths(ix, keys, 0b100, 0b1) == ({2: 3}, {0: 4}, 2, 3)
    assert lengths(ix, keys, 0b1, 0) == ({0: 2}, {}, 0, 2)
    assert lengths(ix, keys, 0, 0b101) == ({}, {0: 4, 2: 4}, None, 0)
    assert lengths(ix, keys, 0, None) == ({}, {}, None, 0)
    assert lengths(ix, [], -1, -1) == ({}, {}, None, 0)
    assert lengths(ix, [9], -1, -1) == ({}, {}, None, 0)
    # every id asked about is covered, held or not
    stored, view, _, _ = ix.match_lengths(keys, 0b11, 1 << 80)
    assert len(stored) >= 81 and len(view) >= 81 and not stored[3:].any()
    stored, view, _, _ = ix.match_lengths(keys, 1 << 90, None)
    assert len(stored) >= 91 and view is stored


def test_a_given_key_array_is_not_converted_again(
    vmk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = PrefixIndex(100, instances=2, vector_min_keys=vmk)  # one-word masks
    wide = PrefixIndex(100, instances=2, vector_min_keys=vmk)  # and two
    wide.add_instance(80)
    wide.store(80, [5])
    for ix in (one, wide):
        ix.store(0, [5, 6, 7])
        ix.add_pending(1, [5, 6])
    keys = [5, 6, 7]
    arr = np.array(keys, dtype=np.uint64)

    def refuse(_: Any) -> Any:
        raise AssertionError("converted again")

    monkeypatch.setattr(index_mod, "as_key_array", refuse)
    assert one.match_all(keys, key_array=arr) == {0: 3}
    assert wide.match_all(keys, key_array=arr) == {80: 1, 0: 3}
    assert lengths_given(one, keys, arr, 0b11, -1) == ({0: 3}, {0: 3, 1: 2}, 0, 3)
    assert lengths_given(one, keys, arr, -1, None) == ({0: 3}, {0: 3}, 0, 3)
    assert lengths_given(wide, keys, arr, 0b11, -1) == ({0: 3}, {0: 3, 1: 2, 80: 1}, 0, 3)
    assert lengths_given(wide, keys, arr, -1, None) == ({0: 3, 80: 1}, {0: 3, 80: 1}, 0, 3)


def lengths_given(ix: PrefixIndex, keys: list[int], arr: Any, mask: int,
                  pending_mask: int | None) -> tuple[dict[int, int], dict[int, int], Any, int]:
    stored, view, best, length = ix.match_lengths(keys, mask, pending_mask, key_array=arr)
    return ({i: int(v) for i, v in enumerate(stored) if v},
            {i: int(v) for i, v in enumerate(view) if v}, best, length)


def test_one_compiled_pass_for_one_word_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernels.walk_lengths

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(index_mod, "walk_lengths", counted)
    ix = PrefixIndex(100, instances=2, vector_min_keys=VEC)
    ix.store(0, [1, 2])
    ix.add_pending(1, [1])
    assert lengths(ix, [1, 2], -1, -1) == ({0: 2}, {0: 2, 1: 1}, 0, 2)
    assert lengths(ix, [1, 2], 0, -1) == ({}, {0: 2, 1: 1}, None, 0)
    assert lengths(ix, [1, 2], 1, None) == ({0: 2}, {0: 2}, 0, 2)
    assert len(calls) == 3
    assert lengths(ix, [1, 2], 0, None) == ({}, {}, None, 0)  # nothing asked: no walk
    assert lengths(ix, [], -1, -1) == ({}, {}, None, 0)
    assert len(calls) == 3
    ix.match_lengths([1, 2], 1 << 64)  # past 64 ids: the per-instance walk
    assert len(calls) == 3
    idle = PrefixIndex(100, instances=2, vector_min_keys=VEC)  # nothing pending
    idle.store(0, [1])
    assert lengths(idle, [1, 2], 0, -1) == ({}, {}, None, 0)  # nothing asked: no walk
    assert len(calls) == 3
    ix.add_instance(64)
    ix.store(64, [1])
    assert lengths(ix, [1, 2], 1, 1) == ({0: 2}, {0: 2}, 0, 2)  # two-word masks
    assert len(calls) == 3


# -- the vectorised mirror -----------------------------------------------------------------------
def test_the_mirror_is_built_at_the_threshold_and_dropped_below_a_quarter() -> None:
    ix = PrefixIndex(100, instances=1, vector_min_keys=8)
    ix.store(0, list(range(1, 8)))
    assert ix.match_all([1, 2]) == {0: 2} and ix._mirror is None
    ix.store(0, [8])  # 8 keys: from here on vectorised
    assert ix.match_all([1, 2]) == {0: 2} and ix._mirror is not None
    ix.remove(0, list(range(3, 9)))  # 2 keys: a quarter of 8, kept
    assert ix.match_all([1, 2, 3]) == {0: 2} and ix._mirror is not None
    ix.remove(0, [2])
    assert ix.match_all([1, 2]) == {0: 1} and ix._mirror is None


def test_sync_brings_the_mirror_up_to_date() -> None:
    flat = PrefixIndex(10, instances=2)
    flat.store(0, [1])
    flat.sync()  # no mirror: nothing to do
    assert flat._mirror is None
    ix = PrefixIndex(10, instances=2, vector_min_keys=VEC)
    ix.store(0, [1, 2])
    assert ix.match_all([1]) == {0: 1}
    mirror = ix._mirror
    assert mirror is not None and not mirror.dirty_stored
    ix.store(1, [2, 3])
    ix.add_pending(1, [4])
    assert mirror.dirty_stored == {2, 3} and mirror.dirty_pending == {4}
    ix.sync()
    assert not mirror.dirty_stored and not mirror.dirty_pending
    assert [mirror.stored.mask_of(k) for k in (1, 2, 3, 4)] == [1, 3, 2, 0]
    assert mirror.pending.mask_of(4) == 2
    ix.remove(0, [2])
    ix.remove_pending(1, [4])
    ix.store(0, [5, 6, 7, 8, 9, 10, 11])  # 8 blocks: within the capacity of 10
    ix.sync()
    assert mirror.stored.mask_of(2) == 2 and mirror.pending.mask_of(4) == 0
    assert len(mirror.pending) == 0 and len(mirror.stored) == len(ix.holders)
    ix.store(0, [12, 13, 14])  # 11 blocks: the oldest is evicted, the mirror told
    ix.sync()
    assert mirror.stored.mask_of(1) == 0 and len(mirror.stored) == len(ix.holders)


def test_the_mirror_starts_from_every_key() -> None:
    ix = PrefixIndex(10, instances=70, vector_min_keys=3)
    ix.store(1, [1, 2])
    ix.add_pending(69, [3])
    ix.store(69, [3])
    assert ix.match_all([1, 2]) == {1: 2}
    mirror = ix._mirror
    assert mirror is not None and not mirror.dirty_stored and not mirror.dirty_pending
    assert mirror.mask_of(mirror.stored, 3) == 1 << 69
    assert mirror.mask_of(mirror.pending, 3) == 1 << 69
    assert mirror.sets is not None and mirror.sets.words == 2  # ids past 63: set ids
    assert mirror.stored.words == 1 and mirror.pending.words == 1


@pytest.mark.parametrize("part", [16, 100])  # parts by numpy, or the compiled upsert
@pytest.mark.parametrize("top", [5, 70, 1000])  # masks of 1, 2 and 16 words
def test_a_large_sync_is_assigned_in_parts(monkeypatch: pytest.MonkeyPatch, part: int,
                                           top: int) -> None:
    monkeypatch.setattr(index_mod, "ASSIGN_PART", part)
    grows: list[int] = []
    real = keytable.KeyMaskTable._grow

    def counted(self: keytable.KeyMaskTable, need: int) -> None:
        grows.append(need)
        real(self, need)

    monkeypatch.setattr(keytable.KeyMaskTable, "_grow", counted)
    ix = PrefixIndex(1000, vector_min_keys=VEC)
    for inst in (0, 3, top):
        ix.add_instance(inst)
    ix.store(0, list(range(1, 301)))
    ix.store(top, list(range(200, 401)))
    ix.store(3, [0, 5, 250])  # the key 0 too
    ix.add_pending(top, [7, 500])
    assert ix.match_all([1, 2]) == {0: 2}  # the mirror of 401 keys, part after part
    mirror = ix._mirror
    # one word a key: the mask itself, or (ids past 63) the id of its holder set
    assert mirror is not None and mirror.stored.words == 1
    assert (mirror.sets is None) == (top < 64)
    assert grows == [401]  # once, to the final size, before the first part
    assert [mirror.mask_of(mirror.stored, k) for k in range(402)] == \
        [ix.holder_mask(k) for k in range(402)]
    assert mirror.mask_of(mirror.pending, 500) == 1 << top and len(mirror.pending) == 2
    ix.remove(top, list(range(391, 401)))  # a sync within one part: no growth
    ix.sync()
    assert [mirror.mask_of(mirror.stored, k) for k in range(402)] == \
        [ix.holder_mask(k) for k in range(402)]
    assert grows == [401] and mirror.stored.words == 1


def test_the_walk_has_room_for_every_key() -> None:
    ix = PrefixIndex(100, instances=1, vector_min_keys=VEC)
    ix.store(0, list(range(1, 11)))
    for n in (3, 4, 4, 9, 2, 10):
        assert ix.match_all(list(range(1, n + 1))) == {0: n}
        assert len(ix._drops) >= n + 1  # the compiled walk writes one row past the keys
