"""Holder sets: ids interned per distinct mask, counted by the keys that use them, freed
and reused; a mirror of set ids stays equal to the index's dicts under churn."""

from __future__ import annotations

import random

import numpy as np
import pytest
from mooncake_conductor import index as index_mod
from mooncake_conductor.holdersets import HolderSets
from mooncake_conductor.index import PrefixIndex


def test_ids_are_interned_counted_freed_and_reused() -> None:
    sets = HolderSets()
    a, b = 1 << 70, (1 << 70) | 1
    ids = sets.intern([a, b, a, 0])
    assert ids[0] == ids[2] and ids[3] == 0 and len({*ids.tolist()}) == 3
    assert sets.words == 2 and sets.mask(int(ids[1])) == b
    assert sets.rows[int(ids[0])].tolist() == [0, 1 << 6]
    sets.release(np.zeros(4, dtype=np.uint64), ids)  # four keys now use them
    assert len(sets) == 2
    sets.release(ids[:1], np.zeros(1, dtype=np.uint64))  # one key of a leaves
    assert len(sets) == 2  # another still uses a
    sets.release(ids[2:3], np.zeros(1, dtype=np.uint64))
    assert len(sets) == 1 and sets.rows[int(ids[0])].tolist() == [0, 0]
    again = sets.intern([1 << 200])
    assert again[0] == ids[0]  # the freed id, reused, its row as wide as needed
    assert sets.words == 4 and sets.mask(int(again[0])) == 1 << 200
    many = sets.intern([1 << i for i in range(100)])  # more ids than rows: they grow
    assert len(set(many.tolist())) == 100 and sets.rows.shape[0] >= 102


def test_equal_masks_get_one_id_whatever_their_objects() -> None:
    """Interning finds a mask by its object first: equal masks held in separate objects
    still get one set, new or known."""
    sets = HolderSets()
    low = int("3")  # made at run time: the masks below are separate objects
    c1, c2 = (1 << 80) | low, (1 << 80) | low
    assert c1 == c2 and c1 is not c2
    ids = sets.intern([c1, c2, c1]).tolist()
    assert ids[0] == ids[1] == ids[2] != 0 and len(sets) == 1
    c3 = (1 << 80) | low
    assert sets.intern([c3, 0, c2, 1 << 90]).tolist()[:3] == [ids[0], 0, ids[0]]
    assert len(sets) == 2


def test_a_mirror_of_set_ids_follows_the_dicts_under_churn() -> None:
    r = random.Random(23)
    ix = PrefixIndex(60, vector_min_keys=1)
    ids = r.sample(range(500), 30)
    for i in ids:
        ix.add_instance(i)
    chains = [[r.getrandbits(64) for _ in range(30)] for _ in range(6)]
    ix.store(max(ids), chains[0][:3])  # an id past 63 holds blocks: set ids from the start
    for step in range(300):
        i, chain = r.choice(ids), r.choice(chains)
        cut = r.randint(1, 30)
        kind = r.random()
        if kind < 0.5:
            ix.store(i, chain[:cut])  # the LRU evicts past 60 blocks
        elif kind < 0.65:
            ix.remove(i, chain[:cut])
        elif kind < 0.85:
            ix.add_pending(i, chain[:cut])
        else:
            ix.remove_pending(i, chain[:cut])
        if step % 7 == 0:
            ix.match_all(chain[:5])  # the mirror syncs
            mirror = ix._mirror
            assert mirror is not None and mirror.sets is not None
            keys = {k for c in chains for k in c}
            assert all(mirror.mask_of(mirror.stored, k) == ix.holder_mask(k) for k in keys)
            pend = ix._pending
            assert all(mirror.mask_of(mirror.pending, k) == pend.get(k, 0) for k in keys)
            used = {m for m in ix.holders.values()} | {m for m in pend.values()}
            assert len(mirror.sets) == len(used)  # unused sets are freed


def test_wide_masks_are_one_object_per_distinct_holder_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys with the same holders past id 63 share one mask int (a mask as wide as the
    fleet is kept once, not per key); masks no key holds any more are forgotten."""
    monkeypatch.setattr(index_mod, "SHARED_MIN", 4)
    ix = PrefixIndex(1000)
    chain = list(range(1, 201))
    ix.store(100, chain)
    ix.store(900, chain[:150])
    ix.add_pending(700, chain[:10])
    masks = [ix.holders[k] for k in chain]
    assert masks[0] == (1 << 100) | (1 << 900)
    assert all(m is masks[0] for m in masks[:150])  # one object, 150 keys
    assert all(m is masks[150] for m in masks[150:])
    pend = [ix._pending[k] for k in chain[:10]]
    assert all(m is pend[0] for m in pend)
    for i in range(10):  # many distinct masks come and go: the table is pruned
        ix.store(200 + i, chain[:1])
        ix.remove(200 + i, chain[:1])
    assert len(ix._shared) <= 2 * 4 + 3
    assert all(ix.holders[k] == m for k, m in zip(chain, masks, strict=True))
    small = PrefixIndex(10)
    small.store(3, [1, 2])
    assert not small._shared  # one-word masks are left as they are
