"""Prefix-index memory and KV-event update cost as the fleet and the index grow.

    python benchmarks/index_scale.py [--instances 64] [--blocks 1000000] [--batches 300]
        [--batch 512] [--json OUT.json]

Builds a :class:`~mooncake_conductor.index.PrefixIndex` as
``benchmarks/gateway_decision.py`` does: ``--blocks`` keys in chained prefixes of 512
blocks, every tenth chain held by 3 random instances and the others by 1, each instance's
LRU holding twice its share (``2 * blocks / instances`` blocks). The keys are random
64-bit integers: a block key's value does not change what the index costs, and no token
ids are kept. Then it reports:

- **memory**: the process's resident set (``VmRSS`` in ``/proc/self/status``) before the
  build, after it (the Python dicts: ``holders`` and the per-instance LRUs, with their key
  and mask ints) and after the vectorised mirror is built (the
  :class:`~mooncake_conductor.keytable.KeyMaskTable` the large-index matching reads),
  as bytes per distinct block; the mirror's arrays are also counted exactly
  (``nbytes``), and the peak resident set (``VmHWM``) is printed;
- **build time**: storing every chain, then building the mirror (the first query past
  ``VECTOR_MIN_KEYS``);
- **one KV-event batch**: ``--batch`` new keys stored on one instance (whose LRU is full,
  so as many old ones are evicted) + ``index.sync()`` (the mirror brought up to date, as
  the gateway does after every batch); then removing ``--batch`` keys from one
  instance (its oldest, as an engine's own eviction reports them) + ``sync()``; p50 and
  p99 over ``--batches`` batches of each, after a few untimed ones (the compiled upsert is
  loaded then); the share of ``sync()`` is reported apart, and a fixed pure-Python task
  timed between batches shows how much of the tail is the machine.

Up to instance id 63 the mirror maps each key to its holder mask (one 64-bit word); past
it, to the id of its interned holder set (:mod:`mooncake_conductor.holdersets`), whose
masks are kept once each and counted with the mirror's arrays. The dicts' holder masks
are Python ints as wide as the highest id, so their bytes per block still grow with the
fleet. The compiled
kernels are loaded before the first reading (numba's memory is not the index's). Run one
size per process: the resident-set deltas are only meaningful in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mooncake_conductor.index import VECTOR_MIN_KEYS, PrefixIndex
from mooncake_conductor.keytable import KeyMaskTable

CHAIN_BLOCKS = 512
SHARE_EVERY = 10
SHARED_BY = 3
WARM_BATCHES = 5
MICRO = 1e6
FIXED_TASK_STEPS = 2000  # ~100 µs of pure-Python arithmetic


def _fixed_task() -> int:
    """The same CPU work every time: its p99/p50 in the run is the machine's own noise."""
    total = 0
    for i in range(FIXED_TASK_STEPS):
        total += i * i
    return total


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return status_kib("VmRSS") * 1024


def table_bytes(table: KeyMaskTable) -> int:
    """What one mirror table's arrays hold (rows, overflow counts, stash)."""
    rows, over, meta, stash = table.kernel_view()
    return int(rows.nbytes + over.nbytes + meta.nbytes + stash.nbytes
               + sum(m.nbytes for m in table._stash.values()))


def new_keys(rng: np.random.Generator, n: int) -> list[int]:
    out: list[int] = rng.integers(1, 2**64 - 1, size=n, dtype=np.uint64).tolist()
    return out


def warm_kernels() -> None:
    """Load every compiled kernel the index uses (one- and several-word masks) before the
    first resident-set reading, so that numba's own memory is not counted as the index's."""
    small = PrefixIndex(1 << 10, instances=2, vector_min_keys=1)
    for inst in (0, 1, 64 + 1):
        small.store(inst, list(range(1, 200)))
        small.sync()
        small.match_all(list(range(1, 10)))
        small.match_lengths(list(range(1, 10)), -1, -1)
        small.remove(inst, list(range(1, 200, 2)))
        small.sync()


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile, in µs."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * MICRO


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=300, help="timed batches of each kind")
    ap.add_argument("--batch", type=int, default=512, help="keys per KV-event batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here as JSON")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    prng = random.Random(a.seed)
    n_inst = a.instances

    warm_kernels()
    gc.collect()
    gc.disable()  # no collections of a growing heap mid-build (the gateway freezes it)
    rss0 = rss_bytes()
    index = PrefixIndex(max(1, 2 * a.blocks // n_inst), instances=n_inst)
    t0 = time.perf_counter()
    stored = chains = 0
    while stored < a.blocks:
        keys = new_keys(rng, CHAIN_BLOCKS)
        holders = prng.sample(range(n_inst), SHARED_BY if chains % SHARE_EVERY == 0 else 1)
        for h in holders:
            index.store(h, keys)
        chains += 1
        stored += len(keys)
    build_s = time.perf_counter() - t0
    del keys
    gc.collect()
    rss1 = rss_bytes()
    distinct, entries = len(index), index.size()

    t0 = time.perf_counter()
    index.match_all(new_keys(rng, 1))  # past VECTOR_MIN_KEYS the first query builds it
    mirror_s = time.perf_counter() - t0
    rss2 = rss_bytes()
    mirror = index._mirror
    words = mirror.stored.words if mirror is not None else 0
    mirror_nbytes = table_bytes(mirror.stored) + table_bytes(mirror.pending) if mirror else 0
    sets = mirror.sets if mirror is not None else None
    if sets is not None:  # the holder sets' mask rows and counts
        mirror_nbytes += sets.rows.nbytes + sets.refs.nbytes
    gc.collect()
    gc.freeze()  # as the gateway does once set up
    gc.enable()

    capacity = index.capacity(0)
    lat_store: list[float] = []
    lat_remove: list[float] = []
    sync_store: list[float] = []  # the mirror's share of each (index.sync())
    sync_remove: list[float] = []
    lat_fixed: list[float] = []
    evicted = removed = 0
    for i in range(WARM_BATCHES + a.batches):
        # one full instance at random (else the fullest): the store evicts as many
        sizes = [index.size(j) for j in range(n_inst)]
        full = [j for j, s in enumerate(sizes) if s >= capacity]
        inst = prng.choice(full) if full else max(range(n_inst), key=sizes.__getitem__)
        keys = new_keys(rng, a.batch)
        t = time.perf_counter()
        out = index.store(inst, keys)
        ts = time.perf_counter()
        index.sync()
        te = time.perf_counter()
        if i >= WARM_BATCHES:
            lat_store.append(te - t)
            sync_store.append(te - ts)
            evicted += len(out)
        tf = time.perf_counter()
        _fixed_task()
        lat_fixed.append(time.perf_counter() - tf)
    for i in range(WARM_BATCHES + a.batches):
        held = [j for j in range(n_inst) if index.size(j) >= a.batch]
        inst = prng.choice(held) if held else max(range(n_inst), key=index.size)
        lru = index._lru[inst]
        assert lru is not None
        keys = [k for k, _ in zip(lru, range(a.batch), strict=False)]  # its oldest
        t = time.perf_counter()
        index.remove(inst, keys)
        ts = time.perf_counter()
        index.sync()
        te = time.perf_counter()
        if i >= WARM_BATCHES:
            lat_remove.append(te - t)
            sync_remove.append(te - ts)
            removed += len(keys)

    dicts = rss1 - rss0
    mirror_rss = rss2 - rss1
    res: dict[str, Any] = {
        "instances": n_inst, "blocks": a.blocks, "distinct_blocks": distinct,
        "entries": entries, "capacity_per_instance": capacity, "mask_words": words,
        "holder_sets": len(sets) if sets is not None else None,
        "vectorised": mirror is not None, "vector_min_keys": VECTOR_MIN_KEYS,
        "rss_before_mib": rss0 / 2**20, "rss_after_dicts_mib": rss1 / 2**20,
        "rss_after_mirror_mib": rss2 / 2**20, "peak_rss_mib": status_kib("VmHWM") / 1024,
        "bytes_per_block": (rss2 - rss0) / distinct,
        "bytes_per_block_dicts": dicts / distinct,
        "bytes_per_block_mirror": mirror_rss / distinct,
        "bytes_per_block_mirror_arrays": mirror_nbytes / distinct,
        "build_dicts_s": build_s, "build_mirror_s": mirror_s,
        "batch": a.batch, "batches": a.batches,
        "store_p50_us": pct(lat_store, 0.5), "store_p99_us": pct(lat_store, 0.99),
        "store_sync_p50_us": pct(sync_store, 0.5), "store_sync_p99_us": pct(sync_store, 0.99),
        "store_evicted_per_batch": evicted / max(1, len(lat_store)),
        "remove_p50_us": pct(lat_remove, 0.5), "remove_p99_us": pct(lat_remove, 0.99),
        "remove_sync_p50_us": pct(sync_remove, 0.5),
        "remove_sync_p99_us": pct(sync_remove, 0.99),
        "removed_per_batch": removed / max(1, len(lat_remove)),
        "fixed_task_p50_us": pct(lat_fixed, 0.5), "fixed_task_p99_us": pct(lat_fixed, 0.99),
    }
    print(f"index: {distinct:,} distinct blocks, {entries:,} entries on {n_inst} instances "
          f"({capacity:,} blocks each); mirror: "
          + (f"holder-set ids, {len(sets):,} sets of {sets.words} word(s)" if sets is not None
             else f"masks of {words} word(s)"))
    print(f"memory   : {res['bytes_per_block']:6.0f} B/block  (dicts + LRUs "
          f"{res['bytes_per_block_dicts']:.0f}, mirror {res['bytes_per_block_mirror']:.0f}"
          f" by RSS, {res['bytes_per_block_mirror_arrays']:.0f} by its arrays); RSS "
          f"{rss0 / 2**20:.0f} → {rss1 / 2**20:.0f} → {rss2 / 2**20:.0f} MiB, peak "
          f"{res['peak_rss_mib']:.0f} MiB")
    print(f"build    : dicts + LRUs {build_s:6.1f} s, vectorised mirror {mirror_s:6.1f} s")
    print(f"store    : p50 {res['store_p50_us']:8.1f} µs  p99 {res['store_p99_us']:8.1f} µs"
          f"  ({a.batch} new keys on one instance, {res['store_evicted_per_batch']:.0f} "
          f"evicted, + sync; {a.batches} batches)")
    print(f"  of it sync: p50 {res['store_sync_p50_us']:8.1f} µs  p99 "
          f"{res['store_sync_p99_us']:8.1f} µs  (the mirror; the rest is the dicts and LRUs)")
    print(f"remove   : p50 {res['remove_p50_us']:8.1f} µs  p99 {res['remove_p99_us']:8.1f} µs"
          f"  ({res['removed_per_batch']:.0f} oldest keys of one instance + sync)")
    print(f"  of it sync: p50 {res['remove_sync_p50_us']:8.1f} µs  p99 "
          f"{res['remove_sync_p99_us']:8.1f} µs")
    print(f"fixed CPU task: p50 {res['fixed_task_p50_us']:6.1f} µs  p99 "
          f"{res['fixed_task_p99_us']:6.1f} µs  (the same work every time: p99/p50 "
          f"{res['fixed_task_p99_us'] / res['fixed_task_p50_us']:.2f} is this machine's noise)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
