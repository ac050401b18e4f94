"""Which engines serve one model: its endpoint lists made into instances, their
registration and routability, and their KV-event subscriptions feeding the indexes.

Instance ids are stable: an endpoint that leaves and comes back gets its old id (and an
empty index entry).

Membership: an endpoint that joins (or comes back after being marked down) is checked
at once and *registered* when a health check has passed and, if it publishes KV events,
its subscription is connected and the initial replay is done; only registered, listed,
healthy instances that are not draining are routable. While the routable instances span
more than one engine revision, a prefill instance is routable only when a decode
instance of its revision is, and the Conductor pairs prefill and decode by revision
(the core's instance groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from mooncake_conductor.state import ClusterState, DecodeState, PrefillState
from mooncake_contract.topology import place_values

from .discovery import EndpointSource, source_for
from .events import EngineSubscriber
from .instances import Instance
from .kvindex import IndexFeeder
from .liveconfig import LiveConfig
from .metrics import GatewayMetrics, ModelMetrics
from .settings import Endpoint, GatewaySettings, Role

log = logging.getLogger(__name__)


def _engine(ep: Endpoint) -> tuple[str, str | None, str | None, str, str]:
    """What identifies the engine behind an endpoint: its sockets and its pod (another
    pod at a recycled IP and port is a new engine, registered anew)."""
    return ep.url, ep.kv_events, ep.kv_replay, ep.kv_topic, ep.pod


class Membership:
    def __init__(self, live: LiveConfig, gw: GatewaySettings, metrics: GatewayMetrics,
                 m: ModelMetrics, cluster: ClusterState, feeder: IndexFeeder,
                 decode_feeder: IndexFeeder,
                 on_join: Callable[[Instance], None] | None = None) -> None:
        self.live = live
        self.gw = gw
        self.metrics = metrics
        self.m = m
        #: prefill instance ``i`` is index id ``i`` (and ``cluster.prefill[i]``)
        self.cluster = cluster
        self.feeder = feeder  # KV events -> the prefill engines' index
        # decode engines' caches (what a request sent straight to decode would reuse)
        self.decode_feeder = decode_feeder
        #: called when an instance joins (the gateway checks its health at once)
        self.on_join = on_join
        self.endpoints: EndpointSource | None = None
        self._groups: dict[str, int] = {}  # engine revision -> the core's group id
        self._reported: set[Role] = set()  # roles whose endpoint list has come
        self._changed = asyncio.Event()  # set by refresh()
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self._by_url: dict[tuple[Role, str], Instance] = {}

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
            self.state_of(inst).name = ep.label
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
            st = self.state_of(inst)
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
            self.metrics.routable.labels(self.live.cfg.name, role.value).set(
                sum(1 for i in insts if i.routable and i.listed))

    def _place_of(self, inst: Instance) -> int:
        """The Conductor's id of the instance's place (0: none, the flat model)."""
        keys = [lv.name for lv in self.live.cfg.conductor.topology.levels]
        return self.live.conductor.topology.place_id(place_values(inst.endpoint.topology, keys))

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
        self.metrics.instance_up.labels(self.live.cfg.name, inst.role.value, inst.name).set(
            1 if inst.routable else 0)

    def state_of(self, inst: Instance) -> PrefillState | DecodeState:
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
        m, model, role = self.metrics, self.live.cfg.name, inst.role.value
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

    # -- endpoint source -------------------------------------------------------------------
    async def start(self) -> None:
        """Start following the model's endpoints (its source reports the first lists)."""
        self.endpoints = source_for(self.live.cfg, self.gw.discovery_poll_s)
        await self.endpoints.start(self.set_endpoints)

    async def close(self, keep: Membership | None = None) -> None:
        """Stop the endpoint source and every subscription; drop the model's per-instance
        gauges (a removed model leaves no stale series) except those ``keep`` (the
        membership of the runtime replacing this one) publishes too."""
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
                    self.metrics.routable.remove(self.live.cfg.name, role.value)
        for i in everyone:
            if (i.role, i.name) not in kept:
                self._drop_gauges(i)

    def _drop_gauges(self, inst: Instance) -> None:
        m, name = self.metrics, self.live.cfg.name
        role = inst.role.value
        for family, labels in ((m.instance_up, (name, role, inst.name)),
                               (m.instance_inflight, (name, role, inst.name)),
                               (m.instance_queue_s, (name, inst.name)),
                               (m.instance_prefills, (name, inst.name)),
                               (m.instance_events, (name, role, inst.name)),
                               (m.instance_event_gaps, (name, role, inst.name))):
            with contextlib.suppress(KeyError):
                family.remove(*labels)
