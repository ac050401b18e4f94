"""Leader election on a ``coordination.k8s.io`` Lease, with client-go's rules and timing.

Several operator replicas run at once; exactly one writes. Each replica keeps its watches
warm, so a new leader reconciles at once, and the gateway beside each replica serves
whether or not it leads (readiness never depends on leadership).

Rules, as client-go's ``leaderelection`` package has them:

- **Acquire.** Every ``retry_s`` (2 s) a replica reads the Lease. It takes it when there is
  none, when it has no holder, or when the holder's record has not changed for
  ``lease_s`` (15 s) by the replica's own clock: expiry is judged by when this replica
  last *saw* the record change, never by comparing the holder's timestamps with ours, so
  clock skew between nodes cannot hand the Lease over early.
- **Renew.** The leader writes ``renewTime`` every ``retry_s``. Every write carries the
  Lease's ``resourceVersion``: of two replicas racing, the API server lets one through
  and refuses the other (409), which then is not the leader.
- **Step down at once.** The leader counts as leading only while its last successful
  renewal is less than ``renew_deadline_s`` (10 s) old. A leader that cannot reach the API
  server stops writing at that moment, even if its loop is stuck, and ``lease_s`` is
  longer than that, so the next leader starts only after the old one has stopped.
- **Release.** A leader shutting down (SIGTERM) writes an empty holder and a 1-second
  duration, so another replica takes over at its next try instead of waiting for expiry.

Writes elsewhere in the operator go through :class:`~.kube.Kube`, which refuses every
write but the Lease's while :attr:`LeaderElector.leading` is false.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

from .kube import Kube, KubeError
from .metrics import LEADER
from .observe import parse_time

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]
LEASE = "Lease"
#: a released Lease's duration: another replica may take it at its next try
RELEASED_DURATION_S = 1


def micro_time(seconds: float) -> str:
    """A Kubernetes ``MicroTime``: RFC 3339 with microseconds, UTC."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One replica's side of the election for ``namespace/name``."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *,
                 lease_s: float, renew_deadline_s: float, retry_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        if not retry_s < renew_deadline_s < lease_s:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self.kube = kube
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.retry_s = lease_s, renew_deadline_s, retry_s
        self._clock, self._wall = clock, wall
        self._renewed_at: float | None = None  # our last successful write (clock)
        self._observed: tuple[Any, ...] | None = None  # the last record seen
        self._observed_at = 0.0  # when it was seen to change (clock)
        self.changed = asyncio.Event()  # set on every change of leadership
        self.transitions = 0  # times this replica became the leader

    @property
    def leading(self) -> bool:
        """Whether this replica may write now."""
        return (self._renewed_at is not None
                and self._clock() - self._renewed_at < self.renew_deadline_s)

    def _set(self, renewed_at: float | None) -> None:
        was = self.leading
        self._renewed_at = renewed_at
        if self.leading != was:
            if self.leading:
                self.transitions += 1
            log.info("%s %s the lease %s/%s", self.identity,
                     "holds" if self.leading else "no longer holds", self.namespace, self.name)
            LEADER.set(1 if self.leading else 0)
            self.changed.set()

    def _spec(self, acquire: float, transitions: int) -> JsonDict:
        now = self._wall()
        return {"holderIdentity": self.identity, "leaseDurationSeconds": round(self.lease_s),
                "acquireTime": micro_time(acquire), "renewTime": micro_time(now),
                "leaseTransitions": transitions}

    async def try_acquire_or_renew(self) -> bool:
        """One round: whether this replica holds the Lease afterwards."""
        now = self._clock()
        lease = await self.kube.get(LEASE, self.namespace, self.name)
        if lease is None:
            created = await self.kube.create({
                "apiVersion": "coordination.k8s.io/v1", "kind": LEASE,
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(self._wall(), 0)})
            if created is None:
                return False  # another replica created it first
            self._observe(created["spec"], now)
            self._set(now)
            return True
        spec: JsonDict = lease.get("spec") or {}
        self._observe(spec, now)
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.lease_s)
        if holder and holder != self.identity and self._observed_at + duration > now:
            self._set(None)
            return False
        mine = holder == self.identity
        acquire = (parse_time(spec.get("acquireTime")) if mine else None) or self._wall()
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": self._spec(acquire, transitions)}
        try:
            out = await self.kube.patch(LEASE, self.namespace, self.name, body)
        except KubeError as err:
            if err.status != 409:
                raise
            return False  # another replica wrote first: not ours this round
        if out is None:
            return False
        self._observe(out["spec"], now)
        self._set(now)
        return True

    def _observe(self, spec: JsonDict, now: float) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"),
                  spec.get("leaseDurationSeconds"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now

    async def run(self) -> None:
        """Acquire, then renew, every ``retry_s``, until cancelled."""
        while True:
            try:
                await self.try_acquire_or_renew()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server unreachable: try again
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            if self._renewed_at is not None and not self.leading:
                self._set(None)  # past the renew deadline: step down
            await asyncio.sleep(self.retry_s)

    async def release(self) -> None:
        """Give the Lease up (on shutdown): stop writing, then let another take it now."""
        if not self.leading:
            return
        self._set(None)
        try:
            lease = await self.kube.get(LEASE, self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            await self.kube.patch(LEASE, self.namespace, self.name, {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": RELEASED_DURATION_S,
                         "renewTime": micro_time(self._wall())}})
        except KubeError as exc:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)

