"""Chained 64-bit block keys over fixed-size token blocks.

Rule: key ``i`` identifies block ``i`` *and the whole prefix before it*, like
vLLM's and Mooncake's chained block hashes, and only full blocks get keys.
The chain is namespaced by a 64-bit seed derived from (model, block size, LoRA
name, cache salt), so two deployments that differ in any of these never share
keys — the usual cause of silent zero hit rates is a router hashing with
other settings than the engine (see ``docs/block-keys.md``).

Definition (``P`` odd 64-bit constant, all arithmetic mod 2^64)::

    h_0 = seed
    h_{t+1} = h_t * P + (token_t + 1)           # over the whole prompt
    key_i = mix64(h_{(i+1)*block_size})          # at every full-block boundary

``mix64`` is the SplitMix64 finaliser. The polynomial prefix hash lets
:func:`block_keys` compute every boundary at once with numpy (``h_L = P^L *
(seed + sum_{t<L} (token_t+1) * P^-(t+1))``), which keeps an 8k-token prompt
at block size 16 well under 100 µs; :func:`block_keys_reference` is the
sequential definition, and tests hold both to golden vectors.

Traces give ``hash_ids`` (one per 512-token block, already prefix-identifying);
:func:`trace_block_keys` namespaces them with the same seed and mixer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

MASK64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
P_INV = pow(P, -1, 1 << 64)


def mix64(x: int) -> int:
    """SplitMix64 finaliser (bijective on 64-bit integers)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix64_np(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def namespace_seed(model: str, block_size: int, lora: str = "", salt: str = "") -> int:
    """64-bit chain seed from everything that must separate two caches."""
    text = f"mooncake-block-keys/v1\0{model}\0{block_size}\0{lora}\0{salt}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class _Powers:
    """Cached powers of P^-1 and P (grown on demand)."""

    def __init__(self) -> None:
        self.inv = np.ones(1, dtype=np.uint64)  # inv[t] = P^-t
        self.fwd = np.ones(1, dtype=np.uint64)  # fwd[t] = P^t

    def ensure(self, n: int) -> None:
        have = len(self.inv)
        if have > n:
            return
        size = max(n + 1, 2 * have)
        inv = np.empty(size, dtype=np.uint64)
        fwd = np.empty(size, dtype=np.uint64)
        inv[:have], fwd[:have] = self.inv, self.fwd
        a, b = int(self.inv[-1]), int(self.fwd[-1])
        for t in range(have, size):
            a = (a * P_INV) & MASK64
            b = (b * P) & MASK64
            inv[t], fwd[t] = a, b
        self.inv, self.fwd = inv, fwd


_POW = _Powers()


def block_keys(
    tokens: Sequence[int] | npt.NDArray[np.integer[Any]], block_size: int, seed: int
) -> list[int]:
    """Keys of every full block of ``tokens`` (vectorised; equals :func:`block_keys_reference`)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.asarray(tokens, dtype=np.uint64)
    nblocks = len(arr) // block_size
    if nblocks == 0:
        return []
    length = nblocks * block_size
    _POW.ensure(length)
    with np.errstate(over="ignore"):
        weighted = (arr[:length] + np.uint64(1)) * _POW.inv[1 : length + 1]
        sums = np.cumsum(weighted, dtype=np.uint64)
        ends = np.arange(block_size, length + 1, block_size)
        h = (sums[ends - 1] + np.uint64(seed & MASK64)) * _POW.fwd[ends]
        keys = _mix64_np(h)
    out: list[int] = keys.tolist()
    return out


def block_keys_reference(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Sequential definition of the key chain (slow; for tests and other languages)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = seed & MASK64
    out: list[int] = []
    for t, tok in enumerate(tokens):
        h = (h * P + int(tok) + 1) & MASK64
        if (t + 1) % block_size == 0:
            out.append(mix64(h))
    return out


def trace_block_keys(hash_ids: Sequence[int], seed: int) -> list[int]:
    """Index keys for a trace's ``hash_ids`` (each already identifies its whole prefix)."""
    return [mix64((seed + (int(h) + 1) * P) & MASK64) for h in hash_ids]
