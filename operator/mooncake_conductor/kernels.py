"""Compiled (numba) inner loops: prefix matching over a large index, block keys of
long prompts.

**Block keys** (:func:`chain_keys`): the same chain as
:func:`mooncake_conductor.blockkeys.block_keys_reference`, one block at a time
(``S = sum_j (token_j + 1) * P^(B-1-j)``, ``h = h * P^B + S``, key = ``mix64(h)``)
in one pass: ~8 µs for 8k tokens at block size 16 against ~18 µs for the
numpy formulation, which stays in use for shorter prompts (no compile, no numba
import in processes that never see a long prompt).

**Prefix matching** (:func:`walk_keys`):

Rule: walk a request's keys in order, look each one up in its home bucket of
one or two :class:`~mooncake_conductor.keytable.KeyMaskTable` s (holders, and
pending blocks when they count), AND its mask into the running set of
instances still matching, record every drop (position, set before, set after)
and stop as soon as the set is empty. Only the keys up to the end of the
longest match are touched, each with one cache line, and no Python object is
made per key — about 7 µs for an 8k-token prompt against a million-block
index, where a numpy formulation pays ~30 array operations (~60 µs) and a
Python dict walk a dependent cache miss per key.

A key whose home bucket does not hold it but has overflowed (its mask may be in
the overflow bucket or the stash), and the key 0 (kept beside the table), are
handed back to Python (:data:`STOP_RESOLVE`), which finds the mask and calls
again from the next key. Masks are one 64-bit word here (up to 64 instance
ids); wider tables use the numpy path.

numba is imported on first use only: a process whose index never grows past
:data:`mooncake_conductor.index.VECTOR_MIN_KEYS` and never hashes a long prompt
never compiles anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .keytable import SLOTS, U64Array

STOP_DONE = 0  #: every key walked, or the running set became empty
STOP_RESOLVE = 1  #: the key at the returned position needs a Python lookup

_kernel: Callable[..., tuple[int, int, int, int]] | None = None


def _compile() -> Callable[..., tuple[int, int, int, int]]:
    from numba import njit  # heavy import, deferred to the first large index

    from .keytable import _H1

    h1 = np.uint64(_H1)
    slots = SLOTS

    @njit(cache=True, nogil=True)
    def walk(
        rows1: Any, over1: Any, shift1: Any, rows2: Any, over2: Any, shift2: Any,
        two: bool, keys: Any, begin: int, acc: Any,
        drop_at: Any, drop_before: Any, drop_after: Any,
    ) -> tuple[int, int, int, int]:
        dropped = 0
        i = begin
        n = keys.shape[0]
        while i < n:
            key = keys[i]
            if key == 0:
                return i, acc, dropped, 1
            mask = np.uint64(0)
            b = (key * h1) >> shift1
            found = False
            for j in range(slots):
                if rows1[b, j] == key:
                    mask = rows1[b, slots + j]
                    found = True
                    break
            if not found and over1[b]:
                return i, acc, dropped, 1
            if two:
                b = (key * h1) >> shift2
                found = False
                for j in range(slots):
                    if rows2[b, j] == key:
                        mask |= rows2[b, slots + j]
                        found = True
                        break
                if not found and over2[b]:
                    return i, acc, dropped, 1
            new = acc & mask
            if new != acc:
                drop_at[dropped] = i
                drop_before[dropped] = acc
                drop_after[dropped] = new
                dropped += 1
                acc = new
                if acc == 0:
                    return i, acc, dropped, 0
            i += 1
        return n, acc, dropped, 0

    return walk


def walk_keys(
    tables: list[tuple[U64Array, Any, Any]],
    keys: U64Array,
    begin: int,
    acc: int,
    drops: tuple[Any, Any, Any],
) -> tuple[int, int, int, int]:
    """Run the compiled walk from ``begin`` with running set ``acc`` over one or two
    tables ``(rows, overflowed, shift)``; returns ``(position, acc, drops recorded,
    stop reason)`` with the drops written into ``drops`` (positions, before, after)."""
    global _kernel
    if _kernel is None:
        _kernel = _compile()
    rows1, over1, shift1 = tables[0]
    rows2, over2, shift2 = tables[1] if len(tables) > 1 else tables[0]
    end, left, dropped, stop = _kernel(
        rows1, over1, shift1, rows2, over2, shift2, len(tables) > 1, keys, begin,
        np.uint64(acc), drops[0], drops[1], drops[2],
    )
    return int(end), int(left), int(dropped), int(stop)


_chain: Callable[..., U64Array] | None = None


def _compile_chain() -> Callable[..., U64Array]:
    from numba import njit

    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)

    @njit(cache=True, nogil=True)
    def chain(tokens: Any, block: int, weights: Any, ones: Any, q: Any, seed: Any) -> Any:
        blocks = tokens.shape[0] // block
        out = np.empty(blocks, np.uint64)
        h = seed
        for i in range(blocks):
            s = ones
            base = i * block
            for j in range(block):
                s += np.uint64(tokens[base + j]) * weights[j]
            h = h * q + s
            x = h ^ (h >> s30)
            x *= m1
            x ^= x >> s27
            x *= m2
            out[i] = x ^ (x >> s31)
        return out

    return chain


def chain_keys(
    tokens: U64Array, block_size: int, weights: U64Array, ones: np.uint64, q: int, seed: int
) -> U64Array:
    """Block keys of ``tokens`` (uint64) by the compiled chain; ``weights[j] =
    P^(B-1-j)``, ``ones = sum(weights)``, ``q = P^B``."""
    global _chain
    if _chain is None:
        _chain = _compile_chain()
    return _chain(tokens, block_size, weights, ones, np.uint64(q), np.uint64(seed))
