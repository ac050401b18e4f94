"""The vectorised key → mask table against a plain dict."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mooncake_conductor import keytable
from mooncake_conductor.keytable import KeyMaskTable, mask_to_words, masks_to_words


def _check(table: KeyMaskTable, truth: dict[int, int], probe: list[int]) -> None:
    assert [table.mask_of(k) for k in probe] == [truth.get(k, 0) for k in probe]
    assert len(table) == len(truth)
    # every bucket counts exactly the keys homed there that live elsewhere
    keys = table._rows[:, : keytable.SLOTS]
    where = np.repeat(np.arange(len(keys)), keytable.SLOTS)[keys.reshape(-1) != 0]
    stored = keys.reshape(-1)[keys.reshape(-1) != 0]
    away = table._home(stored) != where
    want = np.bincount(table._home(stored[away]), minlength=len(keys))
    stash = np.array(list(table._stash), dtype=np.uint64)
    want += np.bincount(table._home(stash), minlength=len(keys))
    assert (table._overflowed == want).all()
    # the walks' sorted copy of the stash, patched batch after batch, equals a fresh one
    view = table.kernel_view()[3]
    assert view.tolist() == sorted([k, *m.tolist()] for k, m in table._stash.items())


#: rounds of random batches; fewer under mutation testing (``MUTANT_UNDER_TEST`` set), where
#: this is a backstop to test_keytable_rules.py and every surviving mutant runs it in full
ROUNDS = 12 if os.environ.get("MUTANT_UNDER_TEST") else 40


def _assign(table: KeyMaskTable, truth: dict[int, int], keys: np.ndarray,
            masks: np.ndarray) -> None:
    """The same assignment to the table and to the dict it must equal (0 deletes)."""
    table.assign(keys, masks[:, None])
    for k, m in zip(keys.tolist(), masks.tolist(), strict=True):
        if m:
            truth[k] = m
        else:
            truth.pop(k, None)


@pytest.mark.parametrize("batch_min", [keytable.COMPILED_MIN_BATCH, 10**9])
@pytest.mark.parametrize("max_load", [keytable.MAX_LOAD, 0.95])
def test_matches_a_dict_through_growth_deletes_and_overflow(
    monkeypatch: pytest.MonkeyPatch, batch_min: int, max_load: float
) -> None:
    # a high load forces full buckets (overflow buckets and the stash); batches go
    # through the compiled upsert, or (batch_min huge) the numpy assignment
    monkeypatch.setattr(keytable, "MAX_LOAD", max_load)
    monkeypatch.setattr(keytable, "COMPILED_MIN_BATCH", batch_min)
    rng = np.random.default_rng(7)
    table = KeyMaskTable()
    truth: dict[int, int] = {}
    overflowed = stashed = rewrote = False
    for _ in range(ROUNDS):
        keys = np.unique(rng.integers(0, 2**64 - 1, size=int(rng.integers(1, 3000)),
                                      dtype=np.uint64))
        if truth and rng.random() < 0.5:  # also rewrite and delete existing keys
            old = np.array(list(truth)[: len(keys)], dtype=np.uint64)
            keys = np.unique(np.concatenate([keys, old]))
        masks = rng.integers(0, 4, size=len(keys), dtype=np.uint64)  # 0 deletes
        _assign(table, truth, keys, masks)
        overflowed |= bool(table._overflowed.any())
        stashed |= bool(table._stash)
        if table._stash and not rewrote:
            # rewrite and delete what sits in the stash, in one batch with other keys
            stash = list(table._stash)
            batch = np.array(stash + [k for k in list(truth)[:200] if k not in table._stash],
                             dtype=np.uint64)
            flip = np.where(np.arange(len(batch)) % 2, 7, 0).astype(np.uint64)
            _assign(table, truth, batch, flip)
            rewrote = True
        probe = list(truth)[:4000] + rng.integers(0, 2**64 - 1, size=200,
                                                  dtype=np.uint64).tolist()
        _check(table, truth, probe)
    assert overflowed
    if max_load > 0.9:
        assert stashed and rewrote


@pytest.mark.parametrize("batch_min", [keytable.COMPILED_MIN_BATCH, 10**9])
@pytest.mark.parametrize("max_load", [keytable.MAX_LOAD, 0.95])
def test_wide_masks_match_a_dict_through_growth_deletes_and_overflow(
    monkeypatch: pytest.MonkeyPatch, batch_min: int, max_load: float
) -> None:
    # the same for masks of three words (instance ids up to 191): batches through the
    # compiled wide upsert, or the numpy assignment; a few masks one word wide only
    monkeypatch.setattr(keytable, "MAX_LOAD", max_load)
    monkeypatch.setattr(keytable, "COMPILED_MIN_BATCH", batch_min)
    rng = np.random.default_rng(11)
    table = KeyMaskTable()
    truth: dict[int, int] = {}
    stashed = False
    for r in range(ROUNDS // 2):
        keys = np.unique(rng.integers(0, 2**64 - 1, size=int(rng.integers(1, 3000)),
                                      dtype=np.uint64))
        if truth and rng.random() < 0.5:
            old = np.array(list(truth)[: len(keys)], dtype=np.uint64)
            keys = np.unique(np.concatenate([keys, old]))
        # a quarter deleted, the rest one to three holders among 192 ids
        masks = [0 if rng.random() < 0.25 else
                 sum(1 << b for b in set(rng.integers(0, 192 if r else 64, size=3).tolist()))
                 for _ in range(len(keys))]
        words = 1 if r == 0 else 3  # the first batch one word wide: then widened
        table.assign(keys, masks_to_words(masks, words))
        for k, m in zip(keys.tolist(), masks, strict=True):
            if m:
                truth[k] = m
            else:
                truth.pop(k, None)
        stashed |= bool(table._stash)
        probe = list(truth)[:3000] + rng.integers(0, 2**64 - 1, size=200,
                                                  dtype=np.uint64).tolist()
        _check(table, truth, probe)
    assert table.words == 3 and table._overflowed.any()
    if max_load > 0.9:
        assert stashed


def test_small_and_zero_keys_and_wide_masks() -> None:
    table = KeyMaskTable()
    truth = {0: 1 << 130, 1: 5, 2: (1 << 64) | 1, 3: 1 << 63}  # small ints: the hash spreads them
    keys = np.array(list(truth), dtype=np.uint64)
    table.assign(keys, np.stack([mask_to_words(m, 3) for m in truth.values()]))
    assert table.words == 3
    _check(table, truth, [0, 1, 2, 3, 4])
    table.assign(np.array([0, 2], dtype=np.uint64), np.zeros((2, 1), dtype=np.uint64))
    del truth[0], truth[2]
    _check(table, truth, [0, 1, 2, 3])
    assert table.mask_of(3) == 1 << 63
