"""Read-only views of one model's runtime: the state and registry reports, the hot
prefixes with their holders, the index digest, the in-flight gauges (copied when
``/metrics`` is read), and the token counters the state report shows.

The registry's ``unique_blocks`` (the cached work only one pod holds) is counted here
with numpy, in chunks, the event loop free in between.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.keytable import KeyMaskTable
from mooncake_conductor.peerload import PeerLoads
from mooncake_conductor.state import ClusterState
from mooncake_conductor.tablehash import SLOTS

from .instances import Instance
from .liveconfig import LiveConfig
from .membership import Membership
from .prefillqueues import PrefillQueues
from .settings import Role

WORD_BITS = 64  # instance ids per uint64 holder mask


@dataclass(slots=True)
class TokenCounters:
    """One runtime's token counters (the gateway adds to them per request)."""

    #: who counts these counters, and since when (wall clock): a client that sees another
    #: id knows the counters started again from zero (replay.py)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    since: float = field(default_factory=time.time)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    engine_cached_tokens: int = 0
    engine_prompt_tokens: int = 0
    prefill_seconds: float = 0.0


class Reports:
    def __init__(self, live: LiveConfig, members: Membership, queues: PrefillQueues,
                 cluster: ClusterState, index: PrefixIndex, decode_index: PrefixIndex,
                 peers: PeerLoads, seed: int, counters: TokenCounters) -> None:
        self.live = live
        self.members = members
        self.queues = queues
        self.cluster = cluster
        self.index = index
        self.decode_index = decode_index
        self.peers = peers
        self.seed = seed
        self.counters = counters

    def publish_gauges(self) -> None:
        """Copy the in-flight counts to their gauges (when ``/metrics`` is read, not on every
        dispatch and completion)."""
        for inst in self.members.prefill + self.members.decode:
            if inst.inflight_gauge is not None and inst.listed:
                inst.inflight_gauge.set(inst.inflight)

    def state(self) -> dict[str, Any]:
        now = self.live.now()
        self.queues.drain(now)
        live, members, tc = self.live, self.members, self.counters
        cfg, conductor = live.cfg, live.conductor

        def inst_view(i: Instance) -> dict[str, Any]:
            v: dict[str, Any] = {
                "id": i.iid, "name": i.name, "url": i.endpoint.url, "routable": i.routable,
                "listed": i.listed, "healthy": i.healthy, "registered": i.registered,
                "draining": i.endpoint.draining, "revision": i.endpoint.revision,
                "pod": i.pod, "inflight": i.inflight,
                "topology": dict(i.endpoint.topology), "place": members.state_of(i).place,
                "engine": {"running": i.stats.running, "waiting": i.stats.waiting,
                           "kv_usage": i.stats.kv_usage, "prefix_hits": i.stats.prefix_hits,
                           "prefix_queries": i.stats.prefix_queries,
                           "block_size": i.stats.block_size,
                           "num_gpu_blocks": i.stats.num_gpu_blocks},
            }
            feeder = members.feeder_of(i.role)
            f = feeder.feed(i.iid)
            sub = i.subscriber
            v.update({
                "index_blocks": feeder.index.size(i.iid),
                "events": {"applied": f.events, "stored_blocks": f.stored_blocks,
                           "removed_blocks": f.removed_blocks, "resets": f.clears,
                           "orphan_blocks": f.orphans, "last_seq": f.last_seq,
                           "block_size_mismatches": f.mismatched_block_size,
                           "gaps_kept": f.gaps_kept, "kept_blocks": f.kept_blocks,
                           "unconfirmed_blocks": feeder.unconfirmed_blocks(i.iid),
                           "gaps": sub.gaps if sub else 0,
                           "replayed": sub.replayed if sub else 0,
                           "lost": sub.lost if sub else 0,
                           "duplicates": sub.duplicates if sub else 0,
                           "restarts": sub.restarts if sub else 0},
            })
            if i.role is Role.PREFILL:
                p = self.cluster.prefill[i.iid]
                v.update({"predicted_wait_s": p.wait_time(now), "queued": len(p.queue),
                          "pending_blocks": feeder.index.pending_size(i.iid),
                          "foreign_work_s": p.foreign_work_s})
            else:
                d = self.cluster.decode[i.iid]
                v.update({"batch": d.batch, "context_tokens": d.context_tokens,
                          "reserved_tokens": d.reserved_tokens, "foreign_batch": d.foreign[0]})
            return v

        return {
            "model": cfg.name,
            "policy": cfg.conductor.policy,
            "calibration": {"prefill_scale": live.cost.prefill_scale,
                            "observed_prefills": conductor.observed_prefills,
                            "decode_scale": live.cost.decode_scale,
                            "observed_decodes": conductor.decode_scale.observed},
            "capabilities": conductor.capabilities.on(),
            "admission": {"on": conductor.capabilities.admission,
                          "rule": cfg.conductor.admission_rule.rule,
                          "ttft_miss_risk": cfg.conductor.admission_rule.ttft_miss_risk,
                          "error_of": conductor.config.admission_rule.error_of,
                          "error": conductor.admission_rule.measured_error()},
            "peers": self.peers.summary(now),
            "block_size": cfg.block_size,
            "namespace_seed": self.seed,
            "prefill": [inst_view(i) for i in members.prefill],
            "decode": [inst_view(i) for i in members.decode],
            "index": {"blocks": len(self.index), "entries": self.index.size(),
                      "events": members.feeder.events_total, "digest": self.index_digest()},
            "decode_index": {"blocks": len(self.decode_index),
                             "entries": self.decode_index.size(),
                             "events": members.decode_feeder.events_total},
            "counters": {"id": tc.id, "since": tc.since},
            "tokens": {
                "prompt": tc.prompt_tokens, "reused_predicted": tc.reused_tokens,
                "hit_ratio_predicted": (tc.reused_tokens / tc.prompt_tokens
                                        if tc.prompt_tokens else 0.0),
                "engine_prompt": tc.engine_prompt_tokens,
                "engine_cached": tc.engine_cached_tokens,
                "prefill_seconds": tc.prefill_seconds,
                "hit_ratio_engine": (tc.engine_cached_tokens / tc.engine_prompt_tokens
                                     if tc.engine_prompt_tokens else 0.0),
            },
        }

    def index_digest(self) -> str:
        """Order-independent digest of (key, holders): equal on replicas that agree."""
        acc = 0
        for k, mask in self.index.holders.items():
            acc = (acc + hash((k, mask))) & ((1 << 64) - 1)
        return f"{acc:016x}"

    def hot_prefixes(self, limit: int, with_tokens: bool = False) -> list[dict[str, Any]]:
        """The tracker's hot prefixes, hottest first: holders as pods with their predicted
        waits, and with ``with_tokens`` the prefix's token ids (``None`` when they were
        not kept: the prefix got hot before the gateway saw it qualify, or the LRU dropped
        it)."""
        now = self.live.now()
        self.queues.drain(now)
        out = []
        for prefix, rate, keys in self.live.conductor.hot.hot(now)[:limit]:
            holders = [
                self.members.prefill[p.iid] for p in self.cluster.prefill
                if p.up and self.index.match(p.iid, keys) == len(keys)
            ]
            entry: dict[str, Any] = {
                "model": self.live.cfg.name, "prefix": f"{prefix:016x}", "blocks": len(keys),
                "tokens": len(keys) * self.live.cfg.block_size, "rate_per_s": rate,
                "rate_per_wall_s": rate / self.live.time_scale,
                "holders": [h.pod for h in holders],
                "holders_predicted_wait_s": {
                    h.pod: self.cluster.prefill[h.iid].wait_time(now) for h in holders},
                "keys": [f"{k:016x}" for k in keys],
            }
            if with_tokens:
                toks = self.live.hot_tokens.tokens(prefix)
                entry["token_ids"] = None if toks is None else toks.tolist()
            out.append(entry)
        return out

    # -- registry --------------------------------------------------------------------------
    async def registry(self, chunk: int) -> dict[str, Any]:
        """What the operator needs per pod: membership, registration, load, and the cached
        work only this pod holds (``unique_blocks``, counted in chunks of ``chunk``
        index entries with the event loop free in between)."""
        unique = {Role.PREFILL: await unique_blocks(self.index, chunk),
                  Role.DECODE: await unique_blocks(self.decode_index, chunk)}
        now = self.live.now()
        self.queues.drain(now)
        instances: list[dict[str, Any]] = []
        for inst in self.members.prefill + self.members.decode:
            if not inst.listed and not inst.inflight:
                continue
            index = self.members.feeder_of(inst.role).index
            v: dict[str, Any] = {
                "pod": inst.pod, "role": inst.role.value, "revision": inst.endpoint.revision,
                "url": inst.endpoint.url, "listed": inst.listed,
                "draining": inst.endpoint.draining, "healthy": inst.healthy,
                "registered": inst.registered, "routable": inst.routable,
                "inflight": inst.inflight, "index_blocks": index.size(inst.iid),
                "unique_blocks": unique[inst.role].get(inst.iid, 0),
                "cache_capacity_blocks": inst.stats.num_gpu_blocks,
            }
            if inst.role is Role.PREFILL:
                v["predicted_wait_s"] = self.cluster.prefill[inst.iid].wait_time(now)
            else:
                v["batch"] = self.cluster.decode[inst.iid].batch
            instances.append(v)
        revisions = sorted({i.endpoint.revision for i in self.members.prefill + self.members.decode
                            if i.listed})
        return {"model": self.live.cfg.name, "source": self.live.source, "revisions": revisions,
                "instances": instances}


async def unique_blocks(index: PrefixIndex, chunk: int) -> dict[int, int]:
    """Per instance id, the blocks of ``index`` that it holds and no other instance does.

    Counted ``chunk`` holder masks at a time with numpy (single-bit masks; the bit's
    position from the float exponent, exact for powers of two), yielding to the event
    loop between chunks. A large index (past the core's ``VECTOR_MIN_KEYS``) is read
    from its vectorised mirror's rows (:meth:`KeyMaskTable.kernel_view`, synced first),
    which costs no Python work per key: ~1M blocks in a few milliseconds of chunks.
    Events applied while it counts may or may not be seen (a snapshot per chunk). A
    smaller index is copied out of the holder dict first (a list of references);
    masks wider than 64 bits (instance ids past 63) are counted in Python."""
    index.sync()
    mirror = getattr(index, "_mirror", None)  # the core keeps it private; read only
    table: KeyMaskTable | None = getattr(mirror, "stored", None)
    # a mirror of holder-set ids (instance ids past 63) is read from the dict below
    if table is not None and table.words == 1 and getattr(mirror, "sets", None) is None:
        return await _unique_in_table(table, chunk)
    masks = list(index.holders.values())
    counts = np.zeros(WORD_BITS, dtype=np.int64)
    wide: dict[int, int] = {}
    for start in range(0, len(masks), chunk):
        part = masks[start : start + chunk]
        try:
            arr = np.fromiter(part, dtype=np.uint64, count=len(part))
        except OverflowError:
            for m in part:
                if m and not m & (m - 1):
                    bit = m.bit_length() - 1
                    wide[bit] = wide.get(bit, 0) + 1
        else:
            counts += _single_bits(arr)
        await asyncio.sleep(0)
    out = _as_dict(counts)
    for bit, n in wide.items():
        out[bit] = out.get(bit, 0) + n
    return out

async def _unique_in_table(table: KeyMaskTable, chunk: int) -> dict[int, int]:
    """:func:`unique_blocks` over a one-word :class:`KeyMaskTable`: its rows (``SLOTS``
    keys, then their masks; key 0 = empty slot), its stash, and the mask of key 0."""
    rows, _overflowed, meta, stash = table.kernel_view()
    counts = _single_bits(stash[:, 1]) + _single_bits(meta[1:])
    step = max(1, chunk // SLOTS)
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        counts += _single_bits(part[:, SLOTS : 2 * SLOTS][part[:, :SLOTS] != 0])
        await asyncio.sleep(0)
    return _as_dict(counts)

def _single_bits(masks: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """How many of ``masks`` have exactly bit *i* set, for i < 64."""
    single = masks[(masks != 0) & ((masks & (masks - np.uint64(1))) == 0)]
    bits = np.frexp(single.astype(np.float64))[1] - 1
    out: npt.NDArray[np.int64] = np.bincount(bits, minlength=WORD_BITS)[:WORD_BITS].astype(
        np.int64)
    return out

def _as_dict(counts: npt.NDArray[np.int64]) -> dict[int, int]:
    return {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
