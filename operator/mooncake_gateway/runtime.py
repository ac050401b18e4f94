"""What the gateway knows about one model's engines, and the in-flight accounting.

One :class:`ModelRuntime` per served model holds the Conductor, a
:class:`~mooncake_conductor.state.ClusterState` (prefill instance ``i`` is index id
``i``), the KV-event subscriptions feeding the index, and the instances' health and
scraped metrics. Instance ids are stable: an endpoint that leaves and comes back gets
its old id (and an empty index entry).

Load = this gateway's own in-flight accounting (prefill queue / decode batch updated on
dispatch and completion) plus what the engines' ``/metrics`` say (waiting requests,
KV capacity, prefix-cache hits). Prefill work drains at one modelled second per
modelled second from the front of each queue, so a queue's predicted wait falls while
its requests run, then the response retires them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_conductor.blockkeys import namespace_seed
from mooncake_conductor.engine import Conductor
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo
from prometheus_client import Gauge

from .events import EngineSubscriber
from .kvindex import IndexFeeder
from .metrics import GatewayMetrics, ModelMetrics
from .settings import Endpoint, GatewaySettings, ModelSettings, Role

log = logging.getLogger(__name__)

#: weight of the newest measurement in moving averages of prefill time
EWMA_ALPHA = 0.2
#: bounds of an instance's measured slowdown (actual / predicted prefill seconds)
SLOWDOWN_MIN = 0.1
SLOWDOWN_MAX = 100.0


@dataclass(slots=True)
class EngineStats:
    """What the last ``/metrics`` scrape said (vLLM names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    scraped_at: float = 0.0


@dataclass(slots=True)
class Instance:
    role: Role
    iid: int
    endpoint: Endpoint
    listed: bool = True  # present in the latest endpoint list
    healthy: bool = True
    failures: int = 0
    inflight: int = 0
    stats: EngineStats = field(default_factory=EngineStats)
    subscriber: EngineSubscriber | None = None
    task: asyncio.Task[None] | None = None
    inflight_gauge: Gauge | None = None  # its labelled child, looked up once

    @property
    def routable(self) -> bool:
        return self.listed and self.healthy

    @property
    def name(self) -> str:
        return self.endpoint.label


class ModelRuntime:
    def __init__(self, cfg: ModelSettings, gw: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.gw = gw
        self.metrics = metrics
        self.m = ModelMetrics(metrics, cfg.name)
        self.conductor = Conductor(cfg.conductor)
        self.cost = self.conductor.cost
        self.seed = namespace_seed(cfg.name, cfg.block_size, cfg.lora_name, cfg.cache_salt)
        self.index = PrefixIndex(cfg.index_capacity_blocks)
        self.cluster = ClusterState(prefill=[], decode=[], index=self.index)
        self.feeder = IndexFeeder(self.index, cfg.block_size, self.seed)
        # decode engines' caches (what a request sent straight to decode would reuse)
        self.decode_index = PrefixIndex(cfg.index_capacity_blocks)
        self.decode_feeder = IndexFeeder(self.decode_index, cfg.block_size, self.seed)
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self._by_url: dict[tuple[Role, str], Instance] = {}
        self.decisions: deque[dict[str, Any]] = deque(maxlen=gw.decisions_kept)
        self._drained_at = self.now()
        self._rid = 0
        self.reused_tokens = 0
        self.prompt_tokens = 0
        self.engine_cached_tokens = 0
        self.engine_prompt_tokens = 0
        self.prefill_seconds = 0.0
        # per prefill instance: EWMA of actual and of predicted seconds (dispatch → answer)
        self._actual_s: dict[int, float] = {}
        self._predicted_s: dict[int, float] = {}

    # -- clock -----------------------------------------------------------------------------
    def now(self) -> float:
        """The Conductor's clock: modelled seconds (wall / time_scale)."""
        return time.monotonic() / self.gw.time_scale

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    # -- membership ------------------------------------------------------------------------
    def feeder_of(self, role: Role) -> IndexFeeder:
        return self.feeder if role is Role.PREFILL else self.decode_feeder

    def instances(self, role: Role) -> list[Instance]:
        return self.prefill if role is Role.PREFILL else self.decode

    def set_endpoints(self, role: Role, endpoints: list[Endpoint]) -> None:
        """Make ``endpoints`` the routable set of ``role`` (new ones join, missing leave)."""
        wanted = {e.url: e for e in endpoints}
        for inst in self.instances(role):
            if inst.endpoint.url not in wanted and inst.listed:
                inst.listed = False
                self._set_up(inst)
                self._stop_events(inst)
                self.feeder_of(role).reset(inst.iid)
        for url, ep in wanted.items():
            known = self._by_url.get((role, url))
            if known is None:
                insts = self.instances(role)
                inst = Instance(role, len(insts), ep)
                inst.inflight_gauge = self.m.inflight(role.value, inst.name)
                insts.append(inst)
                self._by_url[(role, url)] = inst
                if role is Role.PREFILL:
                    self.cluster.prefill.append(PrefillState(iid=inst.iid, name=ep.label))
                else:
                    self.cluster.decode.append(DecodeState(iid=inst.iid, name=ep.label))
                self.feeder_of(role).index.add_instance(inst.iid)
            else:
                inst = known
                if inst.listed and inst.endpoint == ep:
                    self._set_up(inst)
                    continue
                self._stop_events(inst)
                inst.endpoint = ep
                inst.inflight_gauge = self.m.inflight(role.value, inst.name)
                inst.listed = True
                inst.healthy = True
                inst.failures = 0
                self.feeder_of(role).index.add_instance(inst.iid)
            self._set_up(inst)
            self._start_events(inst)

    def _state(self, inst: Instance) -> PrefillState | DecodeState:
        if inst.role is Role.PREFILL:
            return self.cluster.prefill[inst.iid]
        return self.cluster.decode[inst.iid]

    def _set_up(self, inst: Instance) -> None:
        self._state(inst).up = inst.routable
        self.metrics.instance_up.labels(self.cfg.name, inst.role.value, inst.name).set(
            1 if inst.routable else 0)

    def mark_health(self, inst: Instance, ok: bool) -> None:
        if ok:
            inst.failures = 0
            if not inst.healthy:
                log.info("%s %s is back", inst.role.value, inst.name)
                inst.healthy = True
                self._set_up(inst)
                if inst.subscriber is not None:
                    self.feeder_of(inst.role).reset(inst.iid)
                    asyncio.get_running_loop().create_task(self._resync(inst))
            return
        inst.failures += 1
        if inst.healthy and inst.failures >= self.gw.unhealthy_after:
            log.warning("%s %s is down", inst.role.value, inst.name)
            inst.healthy = False
            self._set_up(inst)
            self.feeder_of(inst.role).reset(inst.iid)

    # -- KV events -------------------------------------------------------------------------
    def _start_events(self, inst: Instance) -> None:
        ep = inst.endpoint
        if ep.kv_events is None or inst.task is not None:
            return
        iid = inst.iid
        events = self.m.events
        feeder = self.feeder_of(inst.role)

        def on_batch(seq: int, batch: Any) -> None:
            before = feeder.events_total
            feeder.apply(iid, seq, batch)
            events.inc(feeder.events_total - before)

        sub = EngineSubscriber(
            ep.kv_events, on_batch, ep.kv_replay, ep.kv_topic.encode(),
            self.gw.replay_timeout_s,
            on_reset=lambda: feeder.reset(iid),
            on_lost=lambda: feeder.reset(iid),
        )
        inst.subscriber = sub
        inst.task = asyncio.get_running_loop().create_task(self._run_events(inst, sub))

    async def _run_events(self, inst: Instance, sub: EngineSubscriber) -> None:
        while True:
            try:
                sub.connect()
                await asyncio.sleep(0)
                await sub.sync()
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken socket must not end the subscription
                log.exception("KV events from %s failed; resubscribing", inst.name)
                self.feeder_of(inst.role).reset(inst.iid)
                sub.next_seq = 0
                await asyncio.sleep(self.gw.health_interval_s)

    async def _resync(self, inst: Instance) -> None:
        sub = inst.subscriber
        if sub is None:
            return
        sub.next_seq = 0
        with contextlib.suppress(Exception):
            await sub.sync()

    def _stop_events(self, inst: Instance) -> None:
        if inst.task is not None:
            inst.task.cancel()
        inst.task = None
        inst.subscriber = None

    async def close(self) -> None:
        everyone = self.prefill + self.decode
        tasks = [i.task for i in everyone if i.task is not None]
        for i in everyone:
            self._stop_events(i)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # -- scraped metrics -------------------------------------------------------------------
    def apply_stats(self, inst: Instance, stats: EngineStats) -> None:
        inst.stats = stats
        if stats.block_size is not None and stats.block_size != self.cfg.block_size:
            log.warning("%s reports block size %s, configured %s: the index cannot match",
                        inst.name, stats.block_size, self.cfg.block_size)
        if inst.role is Role.PREFILL:
            if stats.num_gpu_blocks:
                p = self.cluster.prefill[inst.iid]
                p.cache_capacity_tokens = stats.num_gpu_blocks * self.cfg.block_size
                if self.index.capacity(inst.iid) != stats.num_gpu_blocks:
                    self.index.add_instance(inst.iid, stats.num_gpu_blocks)
        else:
            d = self.cluster.decode[inst.iid]
            d.waiting = int(stats.waiting)
            if stats.num_gpu_blocks and self.decode_index.capacity(inst.iid) != \
                    stats.num_gpu_blocks:
                self.decode_index.add_instance(inst.iid, stats.num_gpu_blocks)
            if stats.num_gpu_blocks:
                d.capacity_tokens = stats.num_gpu_blocks * self.cfg.block_size

    # -- in-flight accounting --------------------------------------------------------------
    def slowdown(self, iid: int) -> float:
        """How much longer than predicted this instance's prefills take (1: as modelled).

        Measured per instance as EWMA(actual) / EWMA(predicted) of dispatch → answer times,
        so an engine slower than the cost model (other hardware, CPU contention) drains its
        predicted queue more slowly and its predicted wait stays truthful."""
        pred = self._predicted_s.get(iid, 0.0)
        if pred <= 0:
            return 1.0
        return min(SLOWDOWN_MAX, max(SLOWDOWN_MIN, self._actual_s[iid] / pred))

    def drain(self, now: float) -> None:
        """Retire ``now - last`` modelled seconds (over the instance's slowdown) of prefill
        work from each queue's front."""
        elapsed = now - self._drained_at
        self._drained_at = now
        if elapsed <= 0:
            return
        for p in self.cluster.prefill:
            if not p.queue or p.queued_work_s <= 0:
                continue
            left = elapsed / self.slowdown(p.iid)
            for item in sorted(p.queue):
                if left <= 0:
                    break
                take = min(item.work_s, left)
                item.work_s -= take
                left -= take
            p.queued_work_s = sum(q.work_s for q in p.queue)

    def request_info(
        self, n_tokens: int, keys: npt.NDArray[np.uint64], max_tokens: int
    ) -> RequestInfo:
        """The scheduler's view of a request; ``keys`` as
        :func:`~mooncake_conductor.blockkeys.block_keys_array` gives them (matching
        uses the array as is)."""
        return RequestInfo(
            rid=self.next_rid(), arrival=self.now(), input_tokens=n_tokens,
            output_tokens=max_tokens, keys=keys.tolist(), block_tokens=self.cfg.block_size,
            key_array=keys,
        )

    def prefill_started(self, inst: Instance, req: RequestInfo, work_s: float,
                        priority: float) -> None:
        p = self.cluster.prefill[inst.iid]
        p.enqueue(req.rid, priority, work_s, len(req.keys), req.input_tokens)
        self.index.add_pending(inst.iid, req.keys)
        self.index.sync()
        inst.inflight += 1

    def prefill_done(self, inst: Instance, req: RequestInfo, elapsed_s: float,
                     predicted_s: float | None = None) -> None:
        """Retire a prefill; ``elapsed_s`` modelled seconds from dispatch to answer,
        ``predicted_s`` what the placement predicted for that (``None``: failed call)."""
        p = self.cluster.prefill[inst.iid]
        if predicted_s is not None and predicted_s > 0:
            iid = inst.iid
            if iid in self._actual_s:
                a = EWMA_ALPHA
                self._actual_s[iid] = (1 - a) * self._actual_s[iid] + a * elapsed_s
                self._predicted_s[iid] = (1 - a) * self._predicted_s[iid] + a * predicted_s
            else:
                self._actual_s[iid], self._predicted_s[iid] = elapsed_s, predicted_s
        with contextlib.suppress(StopIteration):
            p.pop(req.rid)
        self.index.remove_pending(inst.iid, req.keys)
        self.index.sync()
        inst.inflight -= 1
        p.completed += 1
        p.avg_prefill_s = (
            elapsed_s if p.completed == 1
            else (1 - EWMA_ALPHA) * p.avg_prefill_s + EWMA_ALPHA * elapsed_s
        )

    def decode_started(self, inst: Instance, req: RequestInfo) -> None:
        d = self.cluster.decode[inst.iid]
        d.batch += 1
        d.context_tokens += req.input_tokens
        d.reserved_tokens += req.output_tokens
        inst.inflight += 1

    def decode_done(self, inst: Instance, req: RequestInfo) -> None:
        d = self.cluster.decode[inst.iid]
        d.batch = max(0, d.batch - 1)
        d.context_tokens = max(0, d.context_tokens - req.input_tokens)
        d.reserved_tokens = max(0, d.reserved_tokens - req.output_tokens)
        inst.inflight -= 1

    def publish_gauges(self) -> None:
        """Copy the in-flight counts to their gauges (when ``/metrics`` is read, not on every
        dispatch and completion)."""
        for inst in self.prefill + self.decode:
            if inst.inflight_gauge is not None:
                inst.inflight_gauge.set(inst.inflight)

    # -- reports ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        now = self.now()
        self.drain(now)

        def inst_view(i: Instance) -> dict[str, Any]:
            v: dict[str, Any] = {
                "id": i.iid, "name": i.name, "url": i.endpoint.url, "routable": i.routable,
                "listed": i.listed, "healthy": i.healthy, "inflight": i.inflight,
                "engine": {"running": i.stats.running, "waiting": i.stats.waiting,
                           "kv_usage": i.stats.kv_usage, "prefix_hits": i.stats.prefix_hits,
                           "prefix_queries": i.stats.prefix_queries,
                           "block_size": i.stats.block_size,
                           "num_gpu_blocks": i.stats.num_gpu_blocks},
            }
            feeder = self.feeder_of(i.role)
            f = feeder.feed(i.iid)
            sub = i.subscriber
            v.update({
                "index_blocks": feeder.index.size(i.iid),
                "events": {"applied": f.events, "stored_blocks": f.stored_blocks,
                           "removed_blocks": f.removed_blocks, "resets": f.clears,
                           "orphan_blocks": f.orphans, "last_seq": f.last_seq,
                           "block_size_mismatches": f.mismatched_block_size,
                           "gaps": sub.gaps if sub else 0,
                           "replayed": sub.replayed if sub else 0,
                           "lost": sub.lost if sub else 0,
                           "restarts": sub.restarts if sub else 0},
            })
            if i.role is Role.PREFILL:
                p = self.cluster.prefill[i.iid]
                v.update({"predicted_wait_s": p.wait_time(now), "queued": len(p.queue),
                          "slowdown": self.slowdown(i.iid)})
            else:
                d = self.cluster.decode[i.iid]
                v.update({"batch": d.batch, "context_tokens": d.context_tokens,
                          "reserved_tokens": d.reserved_tokens})
            return v

        return {
            "model": self.cfg.name,
            "policy": self.cfg.conductor.policy,
            "block_size": self.cfg.block_size,
            "namespace_seed": self.seed,
            "prefill": [inst_view(i) for i in self.prefill],
            "decode": [inst_view(i) for i in self.decode],
            "index": {"blocks": len(self.index), "entries": self.index.size(),
                      "events": self.feeder.events_total, "digest": self.index_digest()},
            "decode_index": {"blocks": len(self.decode_index),
                             "entries": self.decode_index.size(),
                             "events": self.decode_feeder.events_total},
            "tokens": {
                "prompt": self.prompt_tokens, "reused_predicted": self.reused_tokens,
                "hit_ratio_predicted": (self.reused_tokens / self.prompt_tokens
                                        if self.prompt_tokens else 0.0),
                "engine_prompt": self.engine_prompt_tokens,
                "engine_cached": self.engine_cached_tokens,
                "prefill_seconds": self.prefill_seconds,
                "hit_ratio_engine": (self.engine_cached_tokens / self.engine_prompt_tokens
                                     if self.engine_prompt_tokens else 0.0),
            },
        }

    def index_digest(self) -> str:
        """Order-independent digest of (key, holders): equal on replicas that agree."""
        acc = 0
        for k, mask in self.index.holders.items():
            acc = (acc + hash((k, mask))) & ((1 << 64) - 1)
        return f"{acc:016x}"

    def hot_prefixes(self, limit: int) -> list[dict[str, Any]]:
        now = self.now()
        out = []
        for prefix, rate, keys in self.conductor.hot.hot(now)[:limit]:
            holders = [
                self.prefill[p.iid].name for p in self.cluster.prefill
                if p.up and self.index.match(p.iid, keys) == len(keys)
            ]
            out.append({
                "model": self.cfg.name, "prefix": f"{prefix:016x}", "blocks": len(keys),
                "tokens": len(keys) * self.cfg.block_size, "rate_per_s": rate,
                "rate_per_wall_s": rate / self.gw.time_scale, "holders": holders,
                "keys": [f"{k:016x}" for k in keys],
            })
        return out
