"""What the gateway knows about one model's engines, and the in-flight accounting.

One :class:`ModelRuntime` per served model holds the Conductor, a
:class:`~mooncake_conductor.state.ClusterState` (prefill instance ``i`` is index id
``i``), the KV-event subscriptions feeding the index, and the instances' health and
scraped metrics. Instance ids are stable: an endpoint that leaves and comes back gets
its old id (and an empty index entry).

Membership: an endpoint that joins (or comes back after being marked down) is checked
at once and *registered* when a health check has passed and, if it publishes KV events,
its subscription is connected and the initial replay is done; only registered, listed,
healthy instances that are not draining are routable. While the routable instances span
more than one engine revision, a prefill instance is routable only when a decode
instance of its revision is, and the Conductor pairs prefill and decode by revision
(the core's instance groups).

Late binding (opt-in, ``prefill_dispatch_depth`` >= 1, with the Conductor's work
stealing on): the gateway sends each prefill engine at most that many prefills at a time
and holds the rest of that instance's queue itself, in the Conductor's queue order. An
instance whose engine answers with nothing left here may take a prompt held for another
instance (:mod:`mooncake_conductor.stealing`): the queues, the pending prefixes and the
policy's books move with it, and the held request is sent to its new instance.

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
import uuid
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_conductor.blockkeys import namespace_seed
from mooncake_conductor.engine import Conductor
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.keytable import SLOTS, KeyMaskTable
from mooncake_conductor.peerload import LoadReport, PeerLoads, own_report
from mooncake_conductor.policies.base import Placement
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo
from mooncake_contract.topology import place_values
from prometheus_client import Gauge

from .discovery import EndpointSource, source_for
from .events import EngineSubscriber
from .handshake import handshake
from .hottokens import HotPrefixTokens
from .kvindex import IndexFeeder
from .metrics import GatewayMetrics, ModelMetrics
from .settings import Endpoint, GatewaySettings, ModelSettings, Role
from .slo import SloCounter, request_tbt

log = logging.getLogger(__name__)

WORD_BITS = 64  # instance ids per uint64 holder mask

#: weight of the newest measurement in moving averages of prefill time
EWMA_ALPHA = 0.2
#: wall seconds between a held prefill's own checks of its turn (a safety net: turns are
#: handed out when an engine answers, or when a steal moves the prefill)
TURN_RECHECK_S = 1.0


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


@dataclass(slots=True, eq=False)
class QueuedPrefill:
    """A prefill this gateway placed and has not seen answered: on which instance it is
    queued now (a steal moves it), with which placement, and whether it was sent."""

    req: RequestInfo
    iid: int
    placement: Placement | None
    priority: float
    seq: int
    held: bool = False  # queued in the gateway (late binding) until its turn
    sent: bool = False
    turn: asyncio.Event = field(default_factory=asyncio.Event)
    work_s: float = 0.0  # its predicted work where it is queued (modelled seconds)
    #: once that work ran out with no answer: (predicted seconds, when it ran out)
    overdue: tuple[float, float] | None = None

    @property
    def key(self) -> tuple[float, int, int]:
        """Its place in its instance's queue order (the Conductor's: priority, then
        arrival at the queue)."""
        return (self.priority, self.seq, self.req.rid)


@dataclass(slots=True)
class Instance:
    role: Role
    iid: int
    endpoint: Endpoint
    listed: bool = True  # present in the latest endpoint list
    healthy: bool = False  # a health check passed since it joined, and it is not down
    down: bool = False  # marked down by failed checks (a passing check: it came back)
    synced: bool = False  # KV events subscribed and replayed (True without KV events)
    registered: bool = False  # healthy and synced once since it joined or came back
    routable: bool = False  # requests may go there (kept by ModelRuntime.refresh)
    failures: int = 0
    inflight: int = 0
    stats: EngineStats = field(default_factory=EngineStats)
    subscriber: EngineSubscriber | None = None
    task: asyncio.Task[None] | None = None
    inflight_gauge: Gauge | None = None  # its labelled child, looked up once
    #: resolved when the instance is marked down (calls waiting on it give up then)
    _went_down: asyncio.Future[None] | None = None

    def went_down(self) -> asyncio.Future[None]:
        """A future that resolves the next time this instance is marked down."""
        if self._went_down is None or self._went_down.done():
            self._went_down = asyncio.get_running_loop().create_future()
        return self._went_down

    def mark_down(self) -> None:
        self.down = True
        if self._went_down is not None and not self._went_down.done():
            self._went_down.set_result(None)

    @property
    def eligible(self) -> bool:
        """Routable unless revision pairing rules it out."""
        return (self.listed and self.registered and self.healthy
                and not self.endpoint.draining)

    @property
    def name(self) -> str:
        return self.endpoint.label

    @property
    def pod(self) -> str:
        """The pod (namespace/name) when known, else the display name."""
        return self.endpoint.pod or self.endpoint.label


def _engine(ep: Endpoint) -> tuple[str, str | None, str | None, str, str]:
    """What identifies the engine behind an endpoint: its sockets and its pod (another
    pod at a recycled IP and port is a new engine, registered anew)."""
    return ep.url, ep.kv_events, ep.kv_replay, ep.kv_topic, ep.pod


#: settings of a model that can change without a new runtime (index, keys, membership
#: untouched): the Conductor is rebuilt, the rest is read per request
SWAPPABLE_FIELDS = frozenset({"conductor", "direct", "max_model_len", "default_max_tokens"})


class ModelRuntime:
    def __init__(self, cfg: ModelSettings, gw: GatewaySettings, metrics: GatewayMetrics,
                 source: str | None = None) -> None:
        self.cfg = cfg
        self.gw = gw
        #: who counts this runtime's token counters, and since when (wall clock): a client
        #: that sees another id knows the counters started again from zero (replay.py)
        self.counters_id = uuid.uuid4().hex
        self.counters_since = time.time()
        #: wall seconds per modelled second of this model's engines
        self.time_scale = cfg.time_scale or gw.time_scale
        self.metrics = metrics
        #: where the model's settings come from: a ConfigMap (namespace/name), or None
        #: for the gateway's own settings
        self.source = source
        self.m = ModelMetrics(metrics, cfg.name)
        for role in Role:  # 0 until instances register
            metrics.routable.labels(cfg.name, role.value).set(0)
        self.conductor = Conductor(cfg.conductor)
        self.cost = self.conductor.cost
        self.slo = SloCounter(metrics.slo_requests, cfg.name, cfg.conductor.slo.ttft_s,
                              cfg.conductor.slo.tbt_s, self.time_scale)
        #: set (and replaced) whenever a decode request ends: held requests wait on it
        self._decode_room: asyncio.Event | None = None  # made by the first waiter
        self.hot_tokens = self._hot_tokens()
        self.conductor.hot = self.hot_tokens  # the tracker that also keeps tokens
        #: called when an instance joins (the gateway checks its health at once)
        self.on_join: Callable[[Instance], None] | None = None
        self.endpoints: EndpointSource | None = None
        self._groups: dict[str, int] = {}  # engine revision -> the core's group id
        self._reported: set[Role] = set()  # roles whose endpoint list has come
        self._changed = asyncio.Event()  # set by refresh()
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
        # late binding: every placed, unanswered prefill by request id; per instance the
        # ones held here (queue order) and the count sent to its engine
        self._prefills: dict[int, QueuedPrefill] = {}
        self._held: dict[int, list[tuple[float, int, int]]] = {}
        self._sent: dict[int, int] = {}
        self._prefill_seq = 0
        self.steals = 0
        #: the other gateway replicas' in-flight load on these engines (peers.py)
        self.peers = PeerLoads(gw.peers.stale_s)

    # -- clock -----------------------------------------------------------------------------
    def now(self) -> float:
        """The Conductor's clock: modelled seconds (wall / time_scale)."""
        return time.monotonic() / self.time_scale

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    # -- membership ------------------------------------------------------------------------
    def feeder_of(self, role: Role) -> IndexFeeder:
        return self.feeder if role is Role.PREFILL else self.decode_feeder

    def instances(self, role: Role) -> list[Instance]:
        return self.prefill if role is Role.PREFILL else self.decode

    def set_endpoints(self, role: Role, endpoints: list[Endpoint]) -> None:
        """Make ``endpoints`` the listed set of ``role`` (new ones join, missing leave;
        a changed name, revision or drain flag is taken as is)."""
        self._reported.add(role)
        wanted = {e.url: e for e in endpoints}
        for inst in self.instances(role):
            if inst.endpoint.url not in wanted and inst.listed:
                self._leave(inst)
        for url, ep in wanted.items():
            inst_or_none = self._by_url.get((role, url))
            if inst_or_none is None:
                insts = self.instances(role)
                inst = Instance(role, len(insts), ep)
                insts.append(inst)
                self._by_url[(role, url)] = inst
                if role is Role.PREFILL:  # its group: set by refresh() when it matters
                    self.cluster.prefill.append(
                        PrefillState(iid=inst.iid, name=ep.label, up=False))
                else:
                    self.cluster.decode.append(DecodeState(iid=inst.iid, name=ep.label, up=False))
                self._join(inst)
                continue
            inst = inst_or_none
            if inst.endpoint == ep and inst.listed:
                continue
            if inst.listed and _engine(inst.endpoint) != _engine(ep):
                self._leave(inst)  # other sockets or another pod behind the URL
            renamed = inst.endpoint.label != ep.label
            if renamed:
                self._drop_gauges(inst)
                inst.inflight_gauge = self.m.inflight(role.value, ep.label)
            inst.endpoint = ep
            if renamed:
                self._publish_up(inst)
            self._state(inst).name = ep.label
            if not inst.listed:
                self._join(inst)
        self.refresh()

    def _join(self, inst: Instance) -> None:
        """A new engine behind the endpoint: unregistered until it passed a health check
        and its KV events are replayed."""
        log.info("%s %s joined (revision %r)", inst.role.value, inst.name,
                 inst.endpoint.revision)
        inst.listed = True
        inst.healthy = inst.down = inst.registered = False
        inst.failures = 0
        inst.inflight_gauge = self.m.inflight(inst.role.value, inst.name)
        self._publish_up(inst)
        inst.synced = inst.endpoint.kv_events is None
        self.feeder_of(inst.role).index.add_instance(inst.iid)
        self._start_events(inst)
        if self.on_join is not None:
            self.on_join(inst)

    def _leave(self, inst: Instance) -> None:
        log.info("%s %s left", inst.role.value, inst.name)
        inst.listed = inst.registered = False
        self._stop_events(inst)
        self.feeder_of(inst.role).reset(inst.iid)
        # a pod that is gone is not exported as down (a scale to zero is no outage); its
        # requests still in flight finish uncounted
        self._drop_gauges(inst)

    def group_of(self, revision: str) -> int:
        """The core's group id of an engine revision while revisions are mixed (ids from
        1 in order of first sight; 0 is everyone's while one revision serves)."""
        group = self._groups.get(revision)
        if group is None:
            group = self._groups[revision] = len(self._groups) + 1
        return group

    def refresh(self) -> None:
        """Recompute every instance's ``routable`` (and its state's ``up`` and group).

        While the eligible instances span more than one revision, a prefill instance is
        routable only if a decode instance of its revision is eligible (a request needs
        both of one revision). States are written only when they change: a write
        invalidates the pool board's cached live mask."""
        self._changed.set()
        everyone = self.prefill + self.decode
        revisions = {i.endpoint.revision for i in everyone if i.eligible}
        decode_revisions = {i.endpoint.revision for i in self.decode if i.eligible}
        paired = len(revisions) > 1
        for inst in everyone:
            up = inst.eligible and (not paired or inst.role is Role.DECODE
                                    or inst.endpoint.revision in decode_revisions)
            st = self._state(inst)
            # one revision serving: everything in group 0, the core's fast path
            group = self.group_of(inst.endpoint.revision) if paired else 0
            if st.group != group:
                st.group = group
            place = self._place_of(inst)
            if st.place != place:
                st.place = place
            if inst.routable != up or st.up != up:
                inst.routable = up
                st.up = up
                self._publish_up(inst)
        for role, insts in ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode)):
            self.metrics.routable.labels(self.cfg.name, role.value).set(
                sum(1 for i in insts if i.routable and i.listed))

    def _place_of(self, inst: Instance) -> int:
        """The Conductor's id of the instance's place (0: none, the flat model)."""
        keys = [lv.name for lv in self.cfg.conductor.topology.levels]
        return self.conductor.topology.place_id(place_values(inst.endpoint.topology, keys))

    def settled(self) -> bool:
        """Both endpoint lists have come and every listed instance is registered or has
        failed a health check."""
        return len(self._reported) == len(Role) and all(
            i.registered or i.failures for i in self.prefill + self.decode if i.listed)

    async def wait_settled(self, timeout_s: float) -> bool:
        """Wait until :meth:`settled` (``False``: not within ``timeout_s``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.settled():
                    self._changed.clear()
                    await self._changed.wait()
        return self.settled()

    def _publish_up(self, inst: Instance) -> None:
        if not inst.listed:
            return  # left: its series were dropped
        self.metrics.instance_up.labels(self.cfg.name, inst.role.value, inst.name).set(
            1 if inst.routable else 0)

    def _state(self, inst: Instance) -> PrefillState | DecodeState:
        if inst.role is Role.PREFILL:
            return self.cluster.prefill[inst.iid]
        return self.cluster.decode[inst.iid]

    def _maybe_register(self, inst: Instance) -> None:
        if inst.listed and inst.healthy and inst.synced and not inst.registered:
            inst.registered = True
            log.info("%s %s registered", inst.role.value, inst.name)
            self.refresh()

    def mark_health(self, inst: Instance, ok: bool) -> None:
        if not inst.listed:
            return  # a check that ended after the instance left
        if ok:
            inst.failures = 0
            if not inst.healthy:
                inst.healthy = True
                if inst.down:  # came back: replay its events again before routing to it
                    log.info("%s %s is back", inst.role.value, inst.name)
                    inst.down = False
                    if inst.endpoint.kv_events is not None:
                        self._stop_events(inst)
                        self.feeder_of(inst.role).reset(inst.iid)
                        inst.synced = False
                        self._start_events(inst)
            self._maybe_register(inst)
            return
        inst.failures += 1
        self._changed.set()
        if inst.healthy and inst.failures >= self.gw.unhealthy_after:
            log.warning("%s %s is down", inst.role.value, inst.name)
            inst.healthy = inst.registered = False
            inst.mark_down()  # prefills waiting on it go elsewhere
            self.feeder_of(inst.role).reset(inst.iid)
            self.refresh()

    # -- KV events -------------------------------------------------------------------------
    def _start_events(self, inst: Instance) -> None:
        ep = inst.endpoint
        if ep.kv_events is None or inst.task is not None:
            return
        iid = inst.iid
        events = self.m.events
        m, model, role = self.metrics, self.cfg.name, inst.role.value
        m.instance_events.labels(model, role, inst.name)  # 0 until the first batch
        m.instance_event_gaps.labels(model, role, inst.name)
        feeder = self.feeder_of(inst.role)

        # per-instance series by the instance's current name (a rename drops the old ones)
        def on_batch(seq: int, batch: Any) -> None:
            before = feeder.events_total
            feeder.apply(iid, seq, batch)
            applied = feeder.events_total - before
            events.inc(applied)
            m.instance_events.labels(model, role, inst.name).inc(applied)

        def on_lost() -> None:  # its entries are kept, to age out (kvindex's rule)
            m.instance_event_gaps.labels(model, role, inst.name).inc()
            feeder.gap(iid)

        sub = EngineSubscriber(
            ep.kv_events, on_batch, ep.kv_replay, ep.kv_topic.encode(),
            self.gw.replay_timeout_s,
            on_reset=lambda: feeder.reset(iid),
            on_lost=on_lost,
        )
        inst.subscriber = sub
        inst.task = asyncio.get_running_loop().create_task(self._run_events(inst, sub))

    async def _run_events(self, inst: Instance, sub: EngineSubscriber) -> None:
        try:
            while True:
                try:
                    sub.connect()
                    await asyncio.sleep(0)
                    await sub.sync()
                    if not inst.synced:  # the initial replay is in: it may register
                        inst.synced = True
                        self._maybe_register(inst)
                    await sub.run()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a broken socket must not end the subscription
                    log.exception("KV events from %s failed; resubscribing", inst.name)
                    self.feeder_of(inst.role).reset(inst.iid)
                    sub.close()
                    sub.next_seq = 0
                    await asyncio.sleep(self.gw.health_interval_s)
        finally:
            sub.close()  # cancelled before run() took the socket over

    def _stop_events(self, inst: Instance) -> None:
        if inst.task is not None:
            inst.task.cancel()
        inst.task = None
        inst.subscriber = None

    async def start(self) -> None:
        """Start following the model's endpoints (its source reports the first lists)."""
        self.endpoints = source_for(self.cfg, self.gw.discovery_poll_s)
        await self.endpoints.start(self.set_endpoints)

    async def close(self, keep: ModelRuntime | None = None) -> None:
        """Stop the endpoint source and every subscription; drop the model's per-instance
        gauges (a removed model leaves no stale series) except those ``keep`` (the runtime
        replacing this one) publishes too."""
        if self.endpoints is not None:
            await self.endpoints.stop()
            self.endpoints = None
        everyone = self.prefill + self.decode
        tasks = [i.task for i in everyone if i.task is not None]
        for i in everyone:
            self._stop_events(i)
            i.listed = i.registered = i.routable = False
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        kept = set() if keep is None else {(i.role, i.name) for i in keep.prefill + keep.decode}
        if keep is None:  # the model is no longer served
            for role in Role:
                with contextlib.suppress(KeyError):
                    self.metrics.routable.remove(self.cfg.name, role.value)
        for i in everyone:
            if (i.role, i.name) not in kept:
                self._drop_gauges(i)

    def _drop_gauges(self, inst: Instance) -> None:
        m, name = self.metrics, self.cfg.name
        role = inst.role.value
        for family, labels in ((m.instance_up, (name, role, inst.name)),
                               (m.instance_inflight, (name, role, inst.name)),
                               (m.instance_queue_s, (name, inst.name)),
                               (m.instance_prefills, (name, inst.name)),
                               (m.instance_events, (name, role, inst.name)),
                               (m.instance_event_gaps, (name, role, inst.name))):
            with contextlib.suppress(KeyError):
                family.remove(*labels)

    def _hot_tokens(self) -> HotPrefixTokens:
        gw = self.gw
        return HotPrefixTokens(self.cfg.conductor.replication, self.cfg.block_size,
                               gw.hot_tokens_rate_share, gw.hot_tokens_prefixes,
                               gw.hot_tokens_max)

    def can_swap(self, cfg: ModelSettings) -> bool:
        """Whether ``cfg`` differs from the current settings only in what
        :meth:`reconfigure` swaps in place."""
        old, new = self.cfg.model_dump(), cfg.model_dump()
        return all(old[k] == new[k] for k in old if k not in SWAPPABLE_FIELDS)

    def reconfigure(self, cfg: ModelSettings) -> None:
        """New policy, SLOs, direct rule or limits: a new Conductor over the same state
        (index, instances, queues, calibration); the hot-prefix history is kept when the
        replication settings are unchanged."""
        old = self.conductor
        self.cfg = cfg
        self.conductor = Conductor(cfg.conductor)
        self.cost = self.conductor.cost
        if old.config.replication != cfg.conductor.replication:
            self.hot_tokens = self._hot_tokens()
        self.conductor.hot = self.hot_tokens
        self.refresh()  # places are the new Conductor's (its topology may differ)

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
    def drain(self, now: float) -> None:
        """Retire ``now - last`` modelled seconds of prefill work from each queue's front
        (queued work is priced by the calibrated cost model, so a second drains a second:
        :meth:`prefill_done`). With the Conductor's overrun re-estimation on, a
        prefill whose work ran out with no answer yet keeps the work it is now expected
        to take (:mod:`mooncake_conductor.overrun`) instead of none; the time past its
        predicted end still drains the prefills behind it (a worker answers once its KV
        is in the store, so the engine may have moved on: docs/gateway.md)."""
        elapsed = now - self._drained_at
        self._drained_at = now
        if elapsed <= 0:
            return
        est = self.conductor.overrun
        for p in self.cluster.prefill:
            own = p.own_work_s
            if not p.queue or (own <= 0 and est is None):
                continue
            # the engine serves the other replicas' work too: ours drains at our share
            left = elapsed * own / (own + p.foreign_work_s) if own > 0 else elapsed
            for item in sorted(p.queue):
                if left <= 0:
                    break
                take = min(item.work_s, left)
                item.work_s -= take
                left -= take
                q = self._prefills.get(item.rid)
                if item.work_s <= 0 and est is not None and q is not None and q.overdue is None:
                    # predicted done when its work ran out, and no answer came
                    q.overdue = (q.work_s, now - left)
            if est is not None:
                # a prefill past its predicted end is not done (mooncake_conductor.overrun)
                for item in p.queue:
                    q = self._prefills.get(item.rid)
                    if q is not None and q.overdue is not None:
                        predicted, ran_out = q.overdue
                        until = est.busy_until(now, ran_out - predicted, predicted)
                        item.work_s = until - now
            p.queued_work_s = sum(q.work_s for q in p.queue) + p.foreign_work_s

    # -- replicas ----------------------------------------------------------------------------
    def load_report(self) -> LoadReport:
        """This replica's own in-flight load, for the other replicas (peers.py)."""
        self.drain(self.now())
        return own_report(self.cluster)

    def peer_gone(self, peer: str) -> None:
        """A peer is gone: its load leaves the view at once, not when it turns stale."""
        self.peers.forget(peer)
        self.apply_peers()

    def apply_peers(self) -> None:
        """Fold the fresh peers' load into the cluster state (stale reports count 0)."""
        now = self.now()
        self.drain(now)
        self.peers.apply(self.cluster, now)

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

    @property
    def late_binding(self) -> bool:
        """Whether prefills wait in the gateway for their turn (work stealing on and a
        dispatch depth set). Never with a handshake that sends both halves at once: the
        decode engine is already waiting for the prefill engine it was told of."""
        return (self.gw.prefill_dispatch_depth > 0 and self.conductor.stealing is not None
                and not handshake(self.cfg.handshake).concurrent)

    def prefill_started(self, inst: Instance, req: RequestInfo, work_s: float,
                        priority: float, placement: Placement | None = None) -> None:
        """Queue ``req``'s prefill on ``inst`` (sent at once, or when
        :meth:`prefill_turn` says so)."""
        p = self.cluster.prefill[inst.iid]
        p.enqueue(req.rid, priority, work_s, len(req.keys), req.input_tokens)
        self.index.add_pending(inst.iid, req.keys)
        self.index.sync()
        inst.inflight += 1
        self._prefill_seq += 1
        q = QueuedPrefill(req, inst.iid, placement, priority, self._prefill_seq,
                          held=self.late_binding, work_s=work_s)
        self._prefills[req.rid] = q
        if q.held:
            insort(self._held.setdefault(inst.iid, []), q.key)

    async def prefill_turn(self, req: RequestInfo) -> QueuedPrefill:
        """Wait until ``req``'s prefill may be sent (at once without late binding): it is
        first in its instance's queue order here and the engine has fewer than
        ``prefill_dispatch_depth`` of ours. Its instance and placement may have changed
        meanwhile (a steal). An instance that is not routable any more sends at once: the
        call fails over as any other."""
        q = self._prefills[req.rid]
        if q.sent:
            return q
        if q.held:
            while not self._may_send(q):
                q.turn.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(q.turn.wait(), TURN_RECHECK_S)
            self._held[q.iid].remove(q.key)
            q.held = False
        q.sent = True
        self._sent[q.iid] = self._sent.get(q.iid, 0) + 1
        self._hand_turn(q.iid)  # a depth above 1 may let the next one go too
        return q

    def _may_send(self, q: QueuedPrefill) -> bool:
        if not self.prefill[q.iid].routable or not self.late_binding:
            return True
        if self._sent.get(q.iid, 0) >= self.gw.prefill_dispatch_depth:
            return False
        held = self._held.get(q.iid)
        return not held or held[0] == q.key

    def _hand_turn(self, iid: int) -> None:
        """A slot of ``iid``'s engine may be free: wake its first held prefill, or, when it
        has nothing queued at all, let it steal one held for another instance."""
        if not self.late_binding or self._sent.get(iid, 0) >= self.gw.prefill_dispatch_depth:
            return
        held = self._held.get(iid)
        if held:
            self._prefills[held[0][2]].turn.set()
        elif not self._sent.get(iid, 0):
            self._steal_for(iid)

    def _steal_for(self, iid: int) -> None:
        """Instance ``iid`` went idle: move the held prefill the Conductor picks to it."""
        inst = self.prefill[iid]
        if not inst.routable:
            return
        now = self.now()
        self.drain(now)
        idle = self.cluster.prefill[iid]

        def movable(rid: int) -> bool:
            # the prefill's engine revision stays that of its decode instance (P/D pairs
            # within a group while a rollout runs several)
            q = self._prefills.get(rid)
            return (q is not None and q.held and q.placement is not None
                    and not q.placement.cpp_group
                    and self.cluster.prefill[q.iid].group == idle.group)

        steal = self.conductor.steal(idle, self.cluster, self._request_of, now, movable)
        if steal is None:
            return
        q = self._prefills[steal.rid]
        assert q.placement is not None  # movable() asked for one
        victim = q.iid
        self._held[victim].remove(q.key)
        self.conductor.take(steal, q.req, q.placement, self.cluster)
        self.index.sync()
        self.prefill[victim].inflight -= 1
        inst.inflight += 1
        q.iid, q.placement = iid, steal.placement
        q.work_s, q.overdue = steal.placement.prefill_s + steal.placement.transfer_s, None
        insort(self._held.setdefault(iid, []), q.key)
        self.steals += 1
        self.m.steals.inc()
        log.debug("%s: prefill %d moved from %s to %s (predicted gain %.3f s)", self.cfg.name,
                  steal.rid, self.prefill[victim].name, inst.name, steal.gain_s)
        q.turn.set()

    def _request_of(self, rid: int) -> RequestInfo:
        return self._prefills[rid].req

    def prefill_done(self, inst: Instance, req: RequestInfo, elapsed_s: float,
                     predicted_s: float | None = None) -> None:
        """Retire a prefill (answered, failed, or abandoned before it was sent); ``elapsed_s``
        modelled seconds from placement to answer, ``predicted_s`` what the placement
        predicted for that (``None``: no answer). ``inst`` is where it was placed; where a
        steal moved it is known here."""
        q = self._prefills.pop(req.rid, None)
        sent = True
        if q is not None:
            inst = self.prefill[q.iid]
            sent = q.sent
            if sent:
                self._sent[q.iid] -= 1
            elif q.held:
                self._held[q.iid].remove(q.key)
        p = self.cluster.prefill[inst.iid]
        if predicted_s is not None:
            self.metrics.instance_prefills.labels(self.cfg.name, inst.name).inc()
        if predicted_s is not None and predicted_s > 0:
            # the core's one path for an observed prefill (the simulator's too): the
            # calibration of the cost model's prefill scale, the overrun estimate and the
            # admission margin's measured error
            self.conductor.observe_prefill(predicted_s, elapsed_s)
        with contextlib.suppress(StopIteration):
            p.pop(req.rid)
        self.index.remove_pending(inst.iid, req.keys)
        self.index.sync()
        inst.inflight -= 1
        if sent:  # one abandoned while held here never reached the engine
            p.completed += 1
            p.avg_prefill_s = (
                elapsed_s if p.completed == 1
                else (1 - EWMA_ALPHA) * p.avg_prefill_s + EWMA_ALPHA * elapsed_s
            )
        self._hand_turn(inst.iid)

    def decode_observed(self, predicted_tbt_s: float, intervals_wall_s: list[float]) -> None:
        """A stream relayed to its end: its TBT (the mean of its longest tenth of token
        intervals, in modelled seconds) against the decode selector's prediction, for the
        Conductor's decode calibration (:mod:`mooncake_conductor.calibration`)."""
        if predicted_tbt_s <= 0 or not intervals_wall_s:
            return
        observed = request_tbt(intervals_wall_s) / self.time_scale
        self.conductor.observe_decode(predicted_tbt_s, observed, len(intervals_wall_s))

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
        room, self._decode_room = self._decode_room, None
        if room is not None:
            room.set()  # every request held for room tries again, oldest first

    async def wait_decode_room(self, timeout_s: float) -> bool:
        """Wait until a decode request ends (then ``True``) or ``timeout_s`` wall seconds
        pass (``False``)."""
        room = self._decode_room
        if room is None:
            room = self._decode_room = asyncio.Event()
        try:
            await asyncio.wait_for(room.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def publish_gauges(self) -> None:
        """Copy the in-flight counts to their gauges (when ``/metrics`` is read, not on every
        dispatch and completion)."""
        for inst in self.prefill + self.decode:
            if inst.inflight_gauge is not None and inst.listed:
                inst.inflight_gauge.set(inst.inflight)

    # -- reports ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        now = self.now()
        self.drain(now)

        def inst_view(i: Instance) -> dict[str, Any]:
            v: dict[str, Any] = {
                "id": i.iid, "name": i.name, "url": i.endpoint.url, "routable": i.routable,
                "listed": i.listed, "healthy": i.healthy, "registered": i.registered,
                "draining": i.endpoint.draining, "revision": i.endpoint.revision,
                "pod": i.pod, "inflight": i.inflight,
                "topology": dict(i.endpoint.topology), "place": self._state(i).place,
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
            "model": self.cfg.name,
            "policy": self.cfg.conductor.policy,
            "calibration": {"prefill_scale": self.cost.prefill_scale,
                            "observed_prefills": self.conductor.observed_prefills,
                            "decode_scale": self.cost.decode_scale,
                            "observed_decodes": self.conductor.decode_scale.observed},
            "admission": {"on": self.conductor.admission,
                          "rule": self.cfg.conductor.admission_rule.rule,
                          "ttft_miss_risk": self.cfg.conductor.admission_rule.ttft_miss_risk},
            "peers": self.peers.summary(now),
            "block_size": self.cfg.block_size,
            "namespace_seed": self.seed,
            "prefill": [inst_view(i) for i in self.prefill],
            "decode": [inst_view(i) for i in self.decode],
            "index": {"blocks": len(self.index), "entries": self.index.size(),
                      "events": self.feeder.events_total, "digest": self.index_digest()},
            "decode_index": {"blocks": len(self.decode_index),
                             "entries": self.decode_index.size(),
                             "events": self.decode_feeder.events_total},
            "counters": {"id": self.counters_id, "since": self.counters_since},
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

    def hot_prefixes(self, limit: int, with_tokens: bool = False) -> list[dict[str, Any]]:
        """The tracker's hot prefixes, hottest first: holders as pods with their predicted
        waits, and with ``with_tokens`` the prefix's token ids (``None`` when they were
        not kept: the prefix got hot before the gateway saw it qualify, or the LRU dropped
        it)."""
        now = self.now()
        self.drain(now)
        out = []
        for prefix, rate, keys in self.conductor.hot.hot(now)[:limit]:
            holders = [
                self.prefill[p.iid] for p in self.cluster.prefill
                if p.up and self.index.match(p.iid, keys) == len(keys)
            ]
            entry: dict[str, Any] = {
                "model": self.cfg.name, "prefix": f"{prefix:016x}", "blocks": len(keys),
                "tokens": len(keys) * self.cfg.block_size, "rate_per_s": rate,
                "rate_per_wall_s": rate / self.time_scale,
                "holders": [h.pod for h in holders],
                "holders_predicted_wait_s": {
                    h.pod: self.cluster.prefill[h.iid].wait_time(now) for h in holders},
                "keys": [f"{k:016x}" for k in keys],
            }
            if with_tokens:
                toks = self.hot_tokens.tokens(prefix)
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
        now = self.now()
        self.drain(now)
        instances: list[dict[str, Any]] = []
        for inst in self.prefill + self.decode:
            if not inst.listed and not inst.inflight:
                continue
            index = self.feeder_of(inst.role).index
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
        revisions = sorted({i.endpoint.revision for i in self.prefill + self.decode
                            if i.listed})
        return {"model": self.cfg.name, "source": self.source, "revisions": revisions,
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
