"""Interned holder sets: the mirror of a large fleet's index stores a set id per key.

Rule: every distinct holder mask (which instances hold a block) gets a small integer id,
its mask kept once as a row of 64-bit words (row 0: the empty set); the index's
vectorised mirror then maps each key to the id of its holders' set instead of to the
mask itself, so a table row holds a key in one word whatever the number of instances,
and a walk whose keys keep the same holders (a prefix held by the same instances, the
common case) reads no mask at all until the set changes
(:func:`~mooncake_conductor.kernels.walk_lengths_sets`). Sets are reference-counted
by the keys that use them (in the stored and the pending table alike) and their ids
reused once unused.

Why: a mask per key grows with the highest instance id (16 words at 1,024 instances,
64 at 4,096), so the mirror's rows, its memory and every lookup's cache misses grew with
the fleet. Holder sets are few: along a chain of blocks the holders only shrink, so a
chain has as many sets as points where an instance's copy ends.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .keytable import WORD_BITS, masks_to_words

U64Array = npt.NDArray[np.uint64]
_MIN_ROWS = 16


class HolderSets:
    """Set id ↔ holder mask, with the masks as word rows the compiled walk reads."""

    def __init__(self) -> None:
        self._id_of: dict[int, int] = {0: 0}
        self._mask_of: list[int] = [0]
        self._free: list[int] = []
        self.refs = np.zeros(_MIN_ROWS, dtype=np.int64)
        self.rows: U64Array = np.zeros((_MIN_ROWS, 1), dtype=np.uint64)

    @property
    def words(self) -> int:
        return int(self.rows.shape[1])

    def __len__(self) -> int:
        """Sets in use (the empty set not counted)."""
        return len(self._id_of) - 1

    def ensure_words(self, words: int) -> None:
        """Rows at least ``words`` words wide (ids past the widest mask read as 0)."""
        if words > self.words:
            wide = np.zeros((len(self.rows), words), dtype=np.uint64)
            wide[:, : self.words] = self.rows
            self.rows = wide

    def intern(self, masks: list[int]) -> U64Array:
        """The id of each mask's set, new sets made as needed (mask 0: id 0)."""
        get = self._id_of.get
        # keys with the same holders mostly share one mask object (the index interns wide
        # masks): each object's mask is hashed once, found by the object's identity
        # (stable while ``masks`` holds it)
        by_object: dict[int, int] = {}
        ids = [by_object[k] if (k := id(m)) in by_object
               else by_object.setdefault(k, get(m, -1)) for m in masks]
        if -1 in ids:
            fresh = {k: m for m in masks if by_object[k := id(m)] < 0}
            made = self._make(list(dict.fromkeys(fresh.values())))
            for k, m in fresh.items():
                by_object[k] = made[m]
            ids = [by_object[id(m)] for m in masks]
        return np.array(ids, dtype=np.uint64)

    def _make(self, masks: list[int]) -> dict[int, int]:
        """New ids for distinct new ``masks``, their rows written in bulk."""
        ids: list[int] = []
        for m in masks:
            if self._free:
                i = self._free.pop()
                self._mask_of[i] = m
            else:
                i = len(self._mask_of)
                self._mask_of.append(m)
            self._id_of[m] = i
            ids.append(i)
        top = max(ids) + 1
        if top > len(self.rows):  # room for ids, doubling
            size = max(top, 2 * len(self.rows))
            rows = np.zeros((size, self.words), dtype=np.uint64)
            rows[: len(self.rows)] = self.rows
            self.rows = rows
            refs = np.zeros(size, dtype=np.int64)
            refs[: len(self.refs)] = self.refs
            self.refs = refs
        need = max(1, -(-max(m.bit_length() for m in masks) // WORD_BITS))
        self.ensure_words(need)
        self.rows[ids] = masks_to_words(masks, self.words)
        return dict(zip(masks, ids, strict=True))

    def release(self, old: U64Array, new: U64Array) -> None:
        """Keys moved from the sets ``old`` to the sets ``new`` (element-wise; 0: none):
        the counts follow, and sets no key uses any more are freed."""
        np.add.at(self.refs, new.astype(np.intp), 1)
        np.subtract.at(self.refs, old.astype(np.intp), 1)
        self.refs[0] = 0
        gone = np.unique(old[self.refs[old.astype(np.intp)] <= 0])
        for i in gone.tolist():
            if i:
                del self._id_of[self._mask_of[i]]
                self._mask_of[i] = 0
                self._free.append(i)
                self.rows[i] = 0
                self.refs[i] = 0

    def mask(self, set_id: int) -> int:
        return self._mask_of[set_id]
