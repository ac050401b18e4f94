"""The key table's rules on small hand-made cases: where a key goes (home slot, overflow
bucket, stash), what the home bucket counts, when the table doubles, and the helpers'
dtypes and shapes. Keys are picked by their buckets (the two multiplicative hashes), so
each case's layout is known in advance."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from mooncake_conductor import kernels, keytable
from mooncake_conductor.keytable import (
    KeyMaskTable,
    _aligned_zeros,
    _rank_within,
    as_key_array,
    mask_to_words,
    masks_to_words,
    words_to_mask,
)

SLOTS = keytable.SLOTS
MASK64 = (1 << 64) - 1
LOG2 = keytable.MIN_BUCKETS_LOG2  # a new table's 16 buckets
BUCKETS = 1 << LOG2


def home(key: int, log2: int = LOG2) -> int:
    return ((key * keytable._H1_INT) & MASK64) >> (64 - log2)


def away(key: int, log2: int = LOG2) -> int:
    return ((key * keytable._H2_INT) & MASK64) >> (64 - log2)


def pick(n: int, ok: Callable[[int], bool], start: int = 1) -> list[int]:
    """The first ``n`` keys from ``start`` on that satisfy ``ok``."""
    out: list[int] = []
    key = start
    while len(out) < n:
        if ok(key):
            out.append(key)
        key += 1
    return out


BIG = 2**63 + 2**60  # keys past 2**53, which a float cannot hold
TOP = 1 << 63  # with a low bit, a mask a float cannot hold


def u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def col(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)[:, None]


def row_keys(table: KeyMaskTable, bucket: int) -> list[int]:
    keys: list[int] = table._rows[bucket, :SLOTS].tolist()
    return keys


def row_masks(table: KeyMaskTable, bucket: int) -> list[int]:
    masks: list[int] = table._rows[bucket, SLOTS:].tolist()
    return masks


@pytest.fixture(params=["numpy", "compiled"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every batch through the numpy assignment, or (one-word masks) the compiled upsert."""
    monkeypatch.setattr(keytable, "COMPILED_MIN_BATCH", 10**9 if request.param == "numpy" else 1)
    yield request.param


# -- helpers -----------------------------------------------------------------------------------
def test_as_key_array_converts_only_what_is_not_uint64() -> None:
    same = u64([1, 2])
    assert as_key_array(same) is same
    signed = np.array([1, 2**40], dtype=np.int64)
    out = as_key_array(signed)
    assert out.dtype == np.uint64 and out.tolist() == [1, 2**40]
    listed = as_key_array([3, 2**63 + 5])
    assert listed.dtype == np.uint64 and listed.shape == (2,)
    assert listed.tolist() == [3, 2**63 + 5]
    empty = as_key_array([])
    assert empty.dtype == np.uint64 and empty.shape == (0,)


def test_mask_words_low_word_first() -> None:
    mask = (4 << 128) | (5 << 64) | 7
    words = mask_to_words(mask, 3)
    assert words.dtype == np.uint64 and words.tolist() == [7, 5, 4]
    assert mask_to_words(mask, 4).tolist() == [7, 5, 4, 0]
    assert mask_to_words(mask, 1).tolist() == [7]  # higher words are cut
    assert mask_to_words(MASK64, 2).tolist() == [MASK64, 0]
    assert words_to_mask(words) == mask
    assert words_to_mask(u64([0, 1 << 63])) == 1 << 127
    assert words_to_mask(u64([])) == 0


@pytest.mark.parametrize("words", [1, 2, 3, 7, 16, 33, 64])
def test_masks_to_words_in_bulk_equals_one_at_a_time(words: int) -> None:
    rng = np.random.default_rng(words)
    bits = 64 * words
    masks = [int.from_bytes(rng.bytes(8 * words), "little") for _ in range(200)]
    masks += [
        0, 1, (1 << bits) - 1,  # nothing, the lowest bit, every bit
        1 << (bits - 1), (1 << (bits - 1)) | 1,  # the top bit of the top word
        *[1 << (64 * w + 63) for w in range(words)],  # each word's high bit
        *[1 << int(b) for b in rng.integers(0, bits, size=20)],  # one holder
        *[(1 << (bits - 1)) | int.from_bytes(rng.bytes(8), "little") for _ in range(20)],
    ]
    want = np.stack([mask_to_words(m, words) for m in masks])
    got = masks_to_words(masks, words)
    assert got.dtype == np.uint64 and got.shape == (len(masks), words)
    assert got.flags.c_contiguous and got.flags.writeable
    assert (got == want).all()
    assert [words_to_mask(row) for row in got] == masks
    # wider than ``words``: higher words are cut, as mask_to_words cuts them
    wider = [m | (1 << (bits + 5)) | (3 << (bits + 64)) for m in masks[:50]]
    assert (masks_to_words(wider, words) == want[:50]).all()
    negative = [-1, -(1 << (bits - 3)), -12345]  # two's complement, as mask_to_words
    assert (masks_to_words(negative, words)
            == np.stack([mask_to_words(m, words) for m in negative])).all()
    assert masks_to_words([], words).shape == (0, words)


def test_rank_within_counts_earlier_equal_elements() -> None:
    rank = _rank_within(np.array([3, 1, 3, 3, 1, 0], dtype=np.intp))
    assert rank.dtype == np.intp and rank.tolist() == [0, 0, 1, 2, 1, 0]
    assert _rank_within(np.array([], dtype=np.intp)).tolist() == []
    # a long input (where an unstable sort would reorder equal elements)
    groups = np.random.default_rng(3).integers(0, 5, size=3000).astype(np.intp)
    seen: dict[int, int] = {}
    want = []
    for g in groups.tolist():
        want.append(seen.get(g, 0))
        seen[g] = seen.get(g, 0) + 1
    assert _rank_within(groups).tolist() == want


def test_aligned_zeros_start_on_a_cache_line() -> None:
    kept = []
    for rows in range(1, 60):
        for cols in (8, 12, 16):
            a = _aligned_zeros(rows, cols)
            kept.append(a)
            assert a.shape == (rows, cols) and a.dtype == np.uint64 and not a.any()
            assert a.ctypes.data % 64 == 0


# -- a new table ---------------------------------------------------------------------------
def test_a_new_table() -> None:
    t = KeyMaskTable()
    assert (t.words, t.count, len(t), t.capacity) == (1, 0, 0, BUCKETS * SLOTS)
    assert t._rows.shape == (BUCKETS, SLOTS * 2) and not t._rows.any()
    assert t._rows.ctypes.data % 64 == 0
    rows, over, meta, stash = t.kernel_view()
    assert rows is t._rows
    assert over.dtype == np.uint32 and over.shape == (BUCKETS,) and not over.any()
    assert meta.dtype == np.uint64 and meta.tolist() == [64 - LOG2, 0]
    assert stash.dtype == np.uint64 and stash.shape == (0, 2)
    assert t._stash_max == keytable.MIN_STASH
    assert t.mask_of(0) == 0 and t.mask_of(12345) == 0
    assert KeyMaskTable(words=0).words == 1
    wide = KeyMaskTable(words=3)
    assert wide._rows.shape == (BUCKETS, SLOTS * 4) and wide._zero.tolist() == [0, 0, 0]
    assert wide.kernel_view()[3].shape == (0, 4)
    assert KeyMaskTable(buckets_log2=2).capacity == BUCKETS * SLOTS  # never below the minimum
    big = KeyMaskTable(buckets_log2=17)
    assert big.capacity == SLOTS << 17
    assert big._stash_max == (SLOTS << 17) >> keytable.STASH_SHIFT
    assert big.kernel_view()[2].tolist() == [64 - 17, 0]


def test_key_zero_is_kept_aside(path: str) -> None:
    t = KeyMaskTable()
    t.assign(u64([0, 9]), col([6, 3]))
    assert t.mask_of(0) == 6 and len(t) == 2 and t.count == 1
    assert 0 not in t._entries()[0].tolist()
    assert t.kernel_view()[2].tolist() == [64 - LOG2, 6]
    t.assign(u64([0]), col([5]))
    assert t.kernel_view()[2].tolist() == [64 - LOG2, 5]  # the walk's copy follows
    t.assign(u64([0]), col([0]))
    assert t.mask_of(0) == 0 and len(t) == 1 and t.mask_of(9) == 3
    assert t.kernel_view()[2].tolist() == [64 - LOG2, 0]
    t.assign(u64([]), np.zeros((0, 3), dtype=np.uint64))  # nothing to do, not even widen
    assert len(t) == 1 and t.words == 1


# -- placement ---------------------------------------------------------------------------------
def test_home_slots_then_the_overflow_bucket(path: str) -> None:
    b = 5
    k = pick(7, lambda key: home(key) == b and away(key) != b, start=BIG)
    a5 = away(k[4])
    t = KeyMaskTable()
    t.assign(u64(k[:5]), col([1, 2, 3, 4, 5]))
    # four fill the home row in order, the fifth goes to its overflow bucket
    assert row_keys(t, b) == k[:4] and row_masks(t, b) == [1, 2, 3, 4]
    assert row_keys(t, a5)[0] == k[4] and row_masks(t, a5)[0] == 5
    assert t._overflowed.tolist() == [int(i == b) for i in range(BUCKETS)]
    assert (t.count, len(t)) == (5, 5)
    assert [t.mask_of(x) for x in k] == [1, 2, 3, 4, 5, 0, 0]
    # a rewrite stays in place
    t.assign(u64([k[4], k[1]]), col([9, 8]))
    assert row_masks(t, b) == [1, 8, 3, 4] and row_masks(t, a5)[0] == 9
    assert t._overflowed[b] == 1 and t.count == 5
    # deleting from the overflow bucket: the home counts one fewer
    t.assign(u64([k[4]]), col([0]))
    assert row_keys(t, a5)[0] == 0 and row_masks(t, a5)[0] == 0
    assert not t._overflowed.any() and (t.count, len(t)) == (4, 4)
    assert t.mask_of(k[4]) == 0
    # deleting at home empties the slot (key and mask)
    t.assign(u64([k[1], k[3]]), col([0, 0]))
    assert row_keys(t, b) == [k[0], 0, k[2], 0] and row_masks(t, b) == [1, 0, 3, 0]
    assert (t.count, len(t)) == (2, 2)
    # new keys of one bucket take its free slots in order
    t.assign(u64([k[5], k[6]]), col([6, 7]))
    assert row_keys(t, b) == [k[0], k[5], k[2], k[6]] and row_masks(t, b) == [1, 6, 3, 7]
    assert not t._overflowed.any() and t.count == 4
    # deleting an absent key changes nothing
    t.assign(u64([k[1]]), col([0]))
    assert row_keys(t, b) == [k[0], k[5], k[2], k[6]] and t.count == 4


def test_a_miss_at_home_is_final_unless_the_home_sent_keys_away() -> None:
    b = 9
    k = pick(5, lambda key: home(key) == b and away(key) != b)
    t = KeyMaskTable()
    t.assign(u64(k[:4]), col([1, 1, 1, 1]))
    a = away(k[4])
    # a key written into k[4]'s overflow bucket by hand is not found while the home
    # bucket has sent nothing away
    t._rows[a, 0], t._rows[a, SLOTS] = k[4], 3
    assert t.mask_of(k[4]) == 0
    t._overflowed[b] = 1
    assert t.mask_of(k[4]) == 3
    bucket, slot, hit = t._find(u64([k[4], k[0], k[3]]))
    assert hit.tolist() == [True, True, True]
    assert bucket.tolist() == [a, b, b] and slot.tolist() == [0, 0, 3]


def stash_case() -> tuple[int, int, list[int], list[int], list[int]]:
    """Buckets b and a, four keys homed at each (overflowing elsewhere), and keys homed at
    b whose overflow bucket is a."""
    b, a = 3, 11
    at_b = pick(4, lambda key: home(key) == b and away(key) not in (a, b), start=BIG)
    at_a = pick(4, lambda key: home(key) == a and away(key) not in (a, b), start=BIG)
    both = pick(3, lambda key: home(key) == b and away(key) == a, start=BIG)
    return b, a, at_b, at_a, both


def test_keys_whose_buckets_are_full_wait_in_the_stash(path: str) -> None:
    b, a, at_b, at_a, s = stash_case()
    t = KeyMaskTable()
    t.assign(u64(at_b + at_a), col([1] * 8))
    assert not t._overflowed.any() and not t._stash
    t.assign(u64([s[1]]), col([5]))
    if path == "compiled":  # the walk's sorted copy is made here, not in the next match
        assert t._stash_view is not None and t._stash_view.tolist() == [[s[1], 5]]
    assert set(t._stash) == {s[1]} and t._stash[s[1]].tolist() == [5]
    assert t._overflowed.tolist() == [int(i == b) for i in range(BUCKETS)]
    assert (t.count, len(t)) == (8, 9)
    assert t.mask_of(s[1]) == 5 and t.mask_of(s[2]) == 0
    assert t.kernel_view()[3].tolist() == [[s[1], 5]]
    t.assign(u64([s[0], s[2]]), col([6, 7]))
    assert t._overflowed[b] == 3 and (t.count, len(t)) == (8, 11)
    view = t.kernel_view()[3]
    assert view.dtype == np.uint64 and view.tolist() == sorted([[s[0], 6], [s[1], 5], [s[2], 7]])
    # rewriting and deleting stashed keys, in a batch with stored ones
    t.assign(u64([s[1], at_b[0], s[0]]), col([9, 2, 0]))
    assert set(t._stash) == {s[1], s[2]} and t.mask_of(s[1]) == 9 and t.mask_of(s[0]) == 0
    assert t.mask_of(at_b[0]) == 2 and t._overflowed[b] == 2
    assert t.kernel_view()[3].tolist() == sorted([[s[1], 9], [s[2], 7]])
    t.assign(u64([s[1], s[2]]), col([0, 0]))
    assert not t._stash and not t._overflowed.any() and len(t) == 8
    assert t.kernel_view()[3].shape == (0, 2)
    # with room again, a key homed at b goes to its overflow bucket
    t.assign(u64([at_a[2]]), col([0]))
    t.assign(u64([s[2]]), col([4]))
    assert s[2] in row_keys(t, a) and t._overflowed[b] == 1 and not t._stash


@pytest.mark.parametrize(("max_load", "log2"), [(keytable.MAX_LOAD, 7), (0.5, 6)])
def test_a_full_stash_doubles_the_table(monkeypatch: pytest.MonkeyPatch, path: str,
                                        max_load: float, log2: int) -> None:
    monkeypatch.setattr(keytable, "MIN_STASH", 1)
    monkeypatch.setattr(keytable, "MAX_LOAD", max_load)
    _, _, at_b, at_a, s = stash_case()
    t = KeyMaskTable()
    assert t._stash_max == 1
    t.assign(u64(at_b + at_a), col(list(range(1, 9))))
    t.assign(u64([s[0]]), col([20]))
    assert t.capacity == BUCKETS * SLOTS and set(t._stash) == {s[0]}
    t.assign(u64([s[1]]), col([21]))
    # twice the capacity (128 keys) must fit under the load limit
    assert t.capacity == SLOTS << log2 and t._stash_max == 1
    keys = at_b + at_a + s[:2]
    assert [t.mask_of(x) for x in keys] == [*range(1, 9), 20, 21]
    assert (t.count + len(t._stash), len(t)) == (10, 10)
    assert_counts_exact(t)


def test_growth_keeps_the_load_under_the_limit(monkeypatch: pytest.MonkeyPatch,
                                               path: str) -> None:
    monkeypatch.setattr(keytable, "MAX_LOAD", 0.5)
    keys = pick(33, lambda key: True)
    t = KeyMaskTable()
    t.assign(u64(keys[:32]), col([7] * 32))  # exactly half of 64 slots: no growth
    assert t.capacity == 64 and t.count == 32 and not t._stash
    t.assign(u64(keys[32:]), col([8]))
    assert t.capacity == 128  # 33 keys: one doubling is enough
    assert [t.mask_of(x) for x in keys] == [7] * 32 + [8] and len(t) == 33
    assert_counts_exact(t)
    fresh = KeyMaskTable()
    fresh.assign(u64(pick(64, lambda key: True)), col([1] * 64))
    assert fresh.capacity == 128  # 64 keys fill exactly half of 128 slots
    assert len(fresh) == 64


def test_growth_by_more_than_one_doubling(path: str) -> None:
    keys = pick(64, lambda key: True)
    t = KeyMaskTable()
    t.assign(u64(keys), col([3] * 64))
    # 64 keys over 0.4 of the slots: 160 slots at least, so 256
    assert t.capacity == 256 and t.kernel_view()[2].tolist() == [64 - 6, 0]
    assert t._rows.shape == (64, SLOTS * 2) and t._overflowed.shape == (64,)
    assert [t.mask_of(x) for x in keys] == [3] * 64 and t.count + len(t._stash) == 64
    assert_counts_exact(t)


@pytest.mark.parametrize("n", [25, 26, 51, 52, 53, 102, 103, 205, 206])
def test_growth_picks_the_smallest_table_under_the_load_limit(path: str, n: int) -> None:
    keys = pick(n, lambda key: True, start=BIG)
    t = KeyMaskTable()
    t.assign(u64(keys), col([1] * n))
    want = BUCKETS * SLOTS  # 64 slots, doubled while n keys are over 0.4 of them
    while n > keytable.MAX_LOAD * want:
        want *= 2
    assert t.capacity == want and t.count + len(t._stash) == n
    assert [t.mask_of(x) for x in keys] == [1] * n


def assert_counts_exact(t: KeyMaskTable) -> None:
    """Every bucket counts exactly the keys homed there that live elsewhere."""
    log2 = int(np.log2(len(t._rows)))
    want = [0] * len(t._rows)
    for bucket in range(len(t._rows)):
        for key in row_keys(t, bucket):
            if key and home(key, log2) != bucket:
                want[home(key, log2)] += 1
    for key in t._stash:
        want[home(key, log2)] += 1
    assert t._overflowed.tolist() == want


# -- words ---------------------------------------------------------------------------------
def test_wider_masks_rebuild_the_table_in_place(path: str) -> None:
    _, _, at_b, at_a, s = stash_case()
    t = KeyMaskTable()
    t.assign(u64([*at_b, *at_a, s[0], 0]), col([*range(1, 9), TOP | 30, 40]))
    assert set(t._stash) == {s[0]}
    rows = t._rows
    t.ensure_words(1)  # as wide already: untouched
    assert t._rows is rows
    t.assign(u64([at_b[1], s[1]]), np.stack([mask_to_words(1 << 100 | 2, 2),
                                             mask_to_words(1 << 65, 2)]))
    assert t.words == 2 and t.capacity == BUCKETS * SLOTS
    assert t._rows.shape == (BUCKETS, SLOTS * 3) and t._zero.tolist() == [40, 0]
    assert t.kernel_view()[2].tolist() == [64 - LOG2, 40, 0]
    assert [t.mask_of(x) for x in [*at_b, *at_a]] == [1, 1 << 100 | 2, *range(3, 9)]
    assert t.mask_of(s[0]) == TOP | 30 and t.mask_of(s[1]) == 1 << 65 and t.mask_of(0) == 40
    assert (t.count, len(t)) == (8, 11) and set(t._stash) == {s[0], s[1]}
    assert t.kernel_view()[3].tolist() == sorted([[s[0], TOP | 30, 0], [s[1], 0, 2]])
    assert_counts_exact(t)
    rows = t._rows
    t.ensure_words(1)  # narrower: untouched
    assert t._rows is rows and t.words == 2
    # narrower masks are padded
    t.assign(u64([at_a[0], s[2]]), col([TOP | 11, TOP | 12]))
    assert t.mask_of(at_a[0]) == TOP | 11 and t.words == 2
    assert t._stash[s[2]].tolist() == [TOP | 12, 0]
    assert t.kernel_view()[3].tolist() == sorted([[s[0], TOP | 30, 0], [s[1], 0, 2],
                                                  [s[2], TOP | 12, 0]])
    t.ensure_words(3)
    assert t._zero.tolist() == [40, 0, 0] and t.kernel_view()[3].shape == (3, 4)
    assert t.mask_of(s[1]) == 1 << 65 and t.mask_of(at_a[0]) == TOP | 11 and len(t) == 12


def test_wide_masks_in_an_overflow_bucket() -> None:
    b, a = 6, 13
    at_b = pick(4, lambda key: home(key) == b and away(key) != a, start=BIG)
    moved = pick(3, lambda key: home(key) == b and away(key) == a, start=BIG)
    masks = [1 << 64 | 1, 2 << 64 | 2, 3 << 64 | 3, 4 << 64 | 4, 5 << 64, 6, 7 << 64 | 7]
    t = KeyMaskTable(words=2)
    t.assign(u64(at_b + moved), np.stack([mask_to_words(m, 2) for m in masks]))
    assert row_keys(t, a) == [*moved, 0] and t._overflowed[b] == 3
    assert row_masks(t, a) == [0, 5, 6, 0, 7, 7, 0, 0]
    assert [t.mask_of(x) for x in at_b + moved] == masks
    t.ensure_words(3)  # rebuilt from every slot
    assert [t.mask_of(x) for x in at_b + moved] == masks and t.count == 7
    assert_counts_exact(t)


def test_batches_from_the_compiled_minimum_use_the_compiled_upsert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = kernels.upsert_keys

    def counted(*args: Any) -> Any:
        calls.append(len(args[4]))
        return real(*args)

    monkeypatch.setattr(keytable, "upsert_keys", counted)
    n = keytable.COMPILED_MIN_BATCH
    keys = pick(3 * n, lambda key: True, start=BIG)
    t = KeyMaskTable()
    t.assign(u64(keys[: n - 1]), col([1] * (n - 1)))
    assert calls == []
    t.assign(u64(keys[n - 1 : 2 * n - 1]), col([2] * n))
    assert calls == [n]
    assert [t.mask_of(x) for x in keys[: 2 * n]] == [1] * (n - 1) + [2] * n + [0]
    wide = KeyMaskTable(words=2)  # several words: numpy, whatever the batch
    masks = [(5 << 64) | 3] * n
    wide.assign(u64(keys[:n]), masks_to_words(masks, 2))
    assert calls == [n]
    assert [wide.mask_of(x) for x in keys[: n + 1]] == [(5 << 64) | 3] * n + [0]
    assert_counts_exact(wide)
