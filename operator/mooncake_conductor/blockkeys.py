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
:func:`block_keys_array` compute every boundary at once with numpy (one
integer matrix product for the blocks, one cumulative sum for the chain; see
its docstring), about 20 µs for an 8k-token prompt at block size 16 (from
:data:`COMPILED_MIN_TOKENS` tokens on, a compiled loop does it in ~8 µs);
:func:`block_keys_reference` is the sequential definition, and tests hold both to golden vectors.

Traces give ``hash_ids`` (one per 512-token block, already prefix-identifying);
:func:`trace_block_keys` namespaces them with the same seed and mixer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .blockkeys_kernel import chain_keys, chain_loaded

MASK64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
P_INV = pow(P, -1, 1 << 64)
#: prompts from this many tokens are hashed by the compiled chain (:mod:`.kernels`);
#: once it is compiled (a long prompt, or a server's warm-up) it hashes every prompt
COMPILED_MIN_TOKENS = 4096
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: int) -> int:
    """SplitMix64 finaliser (bijective on 64-bit integers)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix64_np(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """:func:`mix64` of every element, in place."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def namespace_seed(model: str, block_size: int, lora: str = "", salt: str = "") -> int:
    """64-bit chain seed from everything that must separate two caches."""
    text = f"mooncake-block-keys/v1\0{model}\0{block_size}\0{lora}\0{salt}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class _BlockPowers:
    """Per block size ``B``: the weights ``P^(B-1-j)`` of a block's tokens, their sum
    (the ``+1`` of every token), and cached powers of ``Q = P^B`` and ``Q^-1``."""

    def __init__(self, block_size: int) -> None:
        self.weights = np.array(
            [pow(P, block_size - 1 - j, 1 << 64) for j in range(block_size)], dtype=np.uint64
        )
        self.ones = np.uint64(sum(int(w) for w in self.weights.tolist()) & MASK64)
        self.q = pow(P, block_size, 1 << 64)
        self.q_inv = pow(self.q, -1, 1 << 64)
        self.fwd = np.ones(1, dtype=np.uint64)  # fwd[k] = Q^k
        self.inv = np.ones(1, dtype=np.uint64)  # inv[k] = Q^-k

    def ensure(self, n: int) -> None:
        have = len(self.fwd)
        if have > n:
            return
        size = max(n + 1, 2 * have)
        fwd = np.empty(size, dtype=np.uint64)
        inv = np.empty(size, dtype=np.uint64)
        fwd[:have], inv[:have] = self.fwd, self.inv
        a, b = int(self.fwd[-1]), int(self.inv[-1])
        for k in range(have, size):
            a = (a * self.q) & MASK64
            b = (b * self.q_inv) & MASK64
            fwd[k], inv[k] = a, b
        self.fwd, self.inv = fwd, inv


_POWERS: dict[int, _BlockPowers] = {}


def block_keys_array(
    tokens: Sequence[int] | npt.NDArray[np.integer[Any]], block_size: int, seed: int
) -> npt.NDArray[np.uint64]:
    """Keys of every full block of ``tokens`` as a uint64 array (vectorised).

    Per block ``i``: ``S_i = sum_j (token_ij + 1) * P^(B-1-j)`` (one integer matrix
    product), so ``h_(i+1)B = h_iB * Q + S_i`` with ``Q = P^B``, i.e.
    ``h_kB = Q^k * (seed + sum_(i<k) S_i * Q^-(i+1))``: one cumulative sum."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.asarray(tokens)
    arr = arr.view(np.uint64) if arr.dtype == np.int64 else arr.astype(np.uint64)
    nblocks = len(arr) // block_size
    if nblocks == 0:
        return np.zeros(0, dtype=np.uint64)
    pw = _POWERS.get(block_size)
    if pw is None:
        pw = _POWERS[block_size] = _BlockPowers(block_size)
    if len(arr) >= COMPILED_MIN_TOKENS or chain_loaded():
        return chain_keys(arr, block_size, pw.weights, pw.ones, pw.q, seed & MASK64)
    pw.ensure(nblocks)
    sums = arr[: nblocks * block_size].reshape(nblocks, block_size) @ pw.weights
    sums += pw.ones
    sums *= pw.inv[1 : nblocks + 1]
    h = np.cumsum(sums, dtype=np.uint64)
    h += np.uint64(seed & MASK64)
    h *= pw.fwd[1 : nblocks + 1]
    return _mix64_np(h)


def block_keys(
    tokens: Sequence[int] | npt.NDArray[np.integer[Any]], block_size: int, seed: int
) -> list[int]:
    """Keys of every full block of ``tokens`` as ints (equals :func:`block_keys_reference`)."""
    out: list[int] = block_keys_array(tokens, block_size, seed).tolist()
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


def trace_block_keys_many(hash_ids: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
    """:func:`trace_block_keys` of every request of a trace in one numpy pass (a whole
    trace's hundreds of thousands of ids; numpy's unsigned arithmetic wraps modulo 2**64
    as the Python one masks). Ids outside ``[0, 2**64)`` take the Python path."""
    lengths = [len(ids) for ids in hash_ids]
    try:
        flat = np.fromiter((h for ids in hash_ids for h in ids), dtype=np.uint64,
                           count=sum(lengths))
    except OverflowError:
        return [trace_block_keys(ids, seed) for ids in hash_ids]
    flat += np.uint64(1)
    flat *= np.uint64(P)
    flat += np.uint64(seed & MASK64)
    keys: list[int] = _mix64_np(flat).tolist()
    out: list[list[int]] = []
    at = 0
    for n in lengths:
        out.append(keys[at:at + n])
        at += n
    return out
