"""The prefill queues this gateway keeps for one model: every prefill it placed and has
not seen answered, the queued work draining over modelled time, late binding's turns and
the Conductor's steals between instances, and the prefill calibration on each answer.

Prefill work drains at one modelled second per modelled second from the front of each
queue, so a queue's predicted wait falls while its requests run, then the response
retires them.

Late binding (opt-in, ``prefill_dispatch_depth`` >= 1, with the Conductor's work
stealing on): the gateway sends each prefill engine at most that many prefills at a time
and holds the rest of that instance's queue itself, in the Conductor's queue order. An
instance whose engine answers with nothing left here may take a prompt held for another
instance (:mod:`mooncake_conductor.stealing`): the queues, the pending prefixes and the
policy's books move with it, and the held request is sent to its new instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import insort
from dataclasses import dataclass, field

from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.policies.base import Placement
from mooncake_conductor.state import ClusterState, RequestInfo

from .instances import Instance
from .liveconfig import LiveConfig
from .membership import Membership
from .metrics import GatewayMetrics, ModelMetrics
from .settings import GatewaySettings

log = logging.getLogger(__name__)

#: wall seconds between a held prefill's own checks of its turn (a safety net: turns are
#: handed out when an engine answers, or when a steal moves the prefill)
TURN_RECHECK_S = 1.0


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


class PrefillQueues:
    def __init__(self, live: LiveConfig, gw: GatewaySettings, metrics: GatewayMetrics,
                 m: ModelMetrics, members: Membership, cluster: ClusterState,
                 index: PrefixIndex) -> None:
        self.live = live
        self.gw = gw
        self.metrics = metrics
        self.m = m
        self.members = members
        self.cluster = cluster
        self.index = index
        self._drained_at = live.now()
        # late binding: every placed, unanswered prefill by request id; per instance the
        # ones held here (queue order) and the count sent to its engine
        self._prefills: dict[int, QueuedPrefill] = {}
        self._held: dict[int, list[tuple[float, int, int]]] = {}
        self._sent: dict[int, int] = {}
        self._prefill_seq = 0
        self.steals = 0

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
        est = self.live.conductor.overrun
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

    @property
    def late_binding(self) -> bool:
        """Whether prefills wait in the gateway for their turn: work stealing on, which the
        gateway's Conductor has only where it can hold prefills
        (:func:`.liveconfig.conductor_config`)."""
        return self.live.conductor.stealing is not None

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
        if not self.members.prefill[q.iid].routable or not self.late_binding:
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
        inst = self.members.prefill[iid]
        if not inst.routable:
            return
        now = self.live.now()
        self.drain(now)
        idle = self.cluster.prefill[iid]

        def movable(rid: int) -> bool:
            # the prefill's engine revision stays that of its decode instance (P/D pairs
            # within a group while a rollout runs several)
            q = self._prefills.get(rid)
            return (q is not None and q.held and q.placement is not None
                    and not q.placement.cpp_group
                    and self.cluster.prefill[q.iid].group == idle.group)

        steal = self.live.conductor.steal(idle, self.cluster, self._request_of, now, movable)
        if steal is None:
            return
        q = self._prefills[steal.rid]
        assert q.placement is not None  # movable() asked for one
        victim = q.iid
        self._held[victim].remove(q.key)
        self.live.conductor.take(steal, q.req, q.placement, self.cluster)
        self.index.sync()
        self.members.prefill[victim].inflight -= 1
        inst.inflight += 1
        q.iid, q.placement = iid, steal.placement
        q.work_s, q.overdue = steal.placement.prefill_s + steal.placement.transfer_s, None
        insort(self._held.setdefault(iid, []), q.key)
        self.steals += 1
        self.m.steals.inc()
        log.debug("%s: prefill %d moved from %s to %s (predicted gain %.3f s)", self.live.cfg.name,
                  steal.rid, self.members.prefill[victim].name, inst.name, steal.gain_s)
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
            inst = self.members.prefill[q.iid]
            sent = q.sent
            if sent:
                self._sent[q.iid] -= 1
            elif q.held:
                self._held[q.iid].remove(q.key)
        p = self.cluster.prefill[inst.iid]
        if predicted_s is not None:
            self.metrics.instance_prefills.labels(self.live.cfg.name, inst.name).inc()
        if predicted_s is not None and predicted_s > 0:
            # the core's one path for an observed prefill (the simulator's too): the
            # calibration of the cost model's prefill scale, the overrun estimate and the
            # admission margin's measured error
            self.live.conductor.observe_prefill(predicted_s, elapsed_s)
        with contextlib.suppress(StopIteration):
            p.pop(req.rid)
        self.index.remove_pending(inst.iid, req.keys)
        self.index.sync()
        inst.inflight -= 1
        if sent:  # one abandoned while held here never reached the engine
            p.observe_prefill(elapsed_s)  # the core's one average (the simulator's too)
        self._hand_turn(inst.iid)
