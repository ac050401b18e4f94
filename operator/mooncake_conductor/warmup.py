"""Compile every kernel of the core ahead of need (:data:`KERNEL_MODULES`).

:func:`warm_up` runs each compiled loop once on a tiny input (block keys of a long
prompt, a small key table's upsert, walks and look-ups, both rankings), so numba
compiles it or loads it from its cache now: a server calls it before serving (the
gateway does, with ``warm_kernels``) and its first large index or long prompt does not
pay for the compilation mid-request.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from . import blockkeys_kernel, candidates_kernel, decode_kernel, kernels, scoring_kernel
from .blockkeys import COMPILED_MIN_TOKENS, block_keys_array
from .candidates_kernel import decode_pick, decode_touch, order_update, prefill_candidates
from .decode_kernel import DECODE_FIELDS, rank_decode
from .kernels import lookup_values, walk_keys, walk_lengths, walk_lengths_sets
from .keytable import KeyMaskTable
from .scoring_kernel import COST_FIELDS, POOL_FIELDS, rank_fifo

#: every module of the core with compiled loops
KERNEL_MODULES: tuple[ModuleType, ...] = (kernels, blockkeys_kernel, scoring_kernel,
                                          decode_kernel, candidates_kernel)


def warm_block_keys() -> None:
    """Compile (or load) the block-key loop alone: what a worker, which keys prompts but
    keeps no index, needs before its first long prompt."""
    block_keys_array(np.arange(COMPILED_MIN_TOKENS, dtype=np.int64), 16, 1)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel now, so that the first large
    index or long prompt of a server does not pay for it mid-request."""
    warm_block_keys()
    table = KeyMaskTable()
    keys = np.arange(1, 1 << 7, dtype=np.uint64)
    table.assign(keys, np.ones((len(keys), 1), dtype=np.uint64))
    drops = np.empty((len(keys) + 1, 3), dtype=np.uint64)
    walk_keys([table.kernel_view()], keys, 1, drops)
    walk_lengths(table.kernel_view(), table.kernel_view(), keys, 1, 1,
                 np.zeros(64, dtype=np.int64), np.zeros(64, dtype=np.int64))
    sets = np.zeros((2, 2), dtype=np.uint64)
    sets[1] = 1
    walk_lengths_sets(table.kernel_view(), table.kernel_view(), sets, keys,
                      np.ones(2, dtype=np.uint64), np.ones(2, dtype=np.uint64),
                      np.zeros(128, dtype=np.int64), np.zeros(128, dtype=np.int64))
    lookup_values(table.kernel_view(), keys)
    one_f, one_i = np.zeros(1), np.zeros(1, dtype=np.int64)
    rank_fifo(np.ones(len(COST_FIELDS)), 0.0, 1, 1, 0, -1, 1.0, 1.0, 1.0, 1.0, True, 0.0, 0.0,
              np.ones(1, dtype=np.bool_), one_f, one_f, one_i, one_i, one_i, np.zeros(1),
              np.zeros(1, dtype=np.bool_), one_i.copy())
    order_keys, rows = np.zeros((2, 1)), np.zeros((2, 1), dtype=np.int64)
    sizes = np.zeros(2, dtype=np.int64)
    order_update(order_keys, rows, np.full((2, 1), np.nan), sizes, 0, 1.0, 1.0)
    prefill_candidates(np.zeros((3, 1)), np.zeros((3, 1), dtype=np.int64),
                       np.full((3, 1), np.nan), np.zeros(3, dtype=np.int64), one_f, one_f, 0.0,
                       True, 1, np.zeros(2), np.zeros(2, dtype=np.int64), one_i, one_i,
                       np.ones(1, dtype=np.bool_), 1, one_i.copy(), one_i.copy(),
                       np.zeros(1, dtype=np.bool_), np.zeros(3, dtype=np.int64),
                       np.zeros(POOL_FIELDS))
    decode_touch(order_keys, rows, np.full((2, 1), np.nan), sizes, np.ones(1, dtype=np.bool_),
                 one_i, one_i, one_i.copy(), one_i.copy(), 1.0, 1.0, 0, 1, 1)
    decode_pick(order_keys, rows, sizes, one_i, one_i, one_i, one_i, one_i, one_i,
                np.ones(len(DECODE_FIELDS)), 1, 1, 1,
                (np.zeros(1, dtype=np.bool_), np.zeros(1), one_i.copy(),
                 np.zeros(1, dtype=np.bool_)), one_i.copy())
    rank_decode(np.ones(len(DECODE_FIELDS)), 1, 1, 1.0, 0.0, 0.0, np.ones(1, dtype=np.bool_),
                one_i, one_i, one_i, one_i, np.zeros(1), one_i.copy())
