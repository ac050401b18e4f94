"""The per-cluster loop the kopf daemon runs, and the state the handlers share.

One asyncio task per MooncakeCluster: reconcile, then (on its own interval) a Conductor
controller round, then sleep until a pod or cluster event wakes it, or the busy/resync
interval passes. One task per cluster means one writer per cluster: the reconcile and the
controller never race on the same object.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncake_contract import conventions as c

from . import hotprefix, names, observe, status
from .cache import IndexedReader, IndexView, Reader
from .gatewayclient import GatewayClient
from .kube import Kube, KubeError, NotLeader
from .leader import LeaderElector
from .metrics import (
    CLUSTERS,
    ERRORS,
    FAILURES_IN_A_ROW,
    HOT_PREFIXES,
    REPLICA_PATCHES,
    forget_cluster,
)
from .names import ClusterRef
from .reconcile import Emit, Outcome, Reconciler, cluster_ref
from .settings import OperatorSettings

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]
#: longest back-off between failed reconciles
MAX_BACKOFF_S = 60.0


class Stopped(Protocol):
    """A stop flag: truthy once the daemon must exit."""

    def __bool__(self) -> bool: ...


@dataclass
class OperatorState:
    settings: OperatorSettings
    kube: Kube
    gateway: GatewayClient | None
    reconciler: Reconciler
    #: the election this replica takes part in (None: it always writes)
    leader: LeaderElector | None = None
    wakeups: dict[str, asyncio.Event] = field(default_factory=dict)
    #: per cluster: the (prefix, pods) pairs last written to status.hotPrefixes
    hot_written: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = field(
        default_factory=dict)

    @classmethod
    def create(cls, settings: OperatorSettings, api_client: Any,
               indexes: Mapping[str, IndexView] | None = None) -> OperatorState:
        """The state of one operator process; ``indexes`` (kind -> kopf index,
        :mod:`.cache`) serve the reconciler's reads when given."""
        kube = Kube(api_client, settings.field_manager)
        reader: Reader = kube
        if indexes is not None:
            reader = IndexedReader(indexes, kube, settings.index_audit_interval_s)
            kube.on_written = reader.written
        gateway = GatewayClient(settings.gateway_url, settings.gateway_timeout_s,
                                settings.gateway_admin_keys_dir, settings.gateway_public_url)
        leader = None
        if settings.leader_election:
            leader = LeaderElector(
                kube, settings.lease_namespace or os.environ.get("POD_NAMESPACE") or "default",
                settings.lease_name, settings.identity or os.environ.get("POD_NAME")
                or f"{socket.gethostname()}-{os.getpid()}",
                lease_s=settings.lease_duration_s, renew_deadline_s=settings.renew_deadline_s,
                retry_s=settings.lease_retry_s)
            kube.may_write = lambda: leader.leading
        return cls(settings, kube, gateway, Reconciler(kube, gateway, settings, reader=reader),
                   leader)

    @property
    def leading(self) -> bool:
        """Whether this replica may write (and so reconcile) now."""
        return self.leader is None or self.leader.leading

    async def follow_leadership(self) -> None:
        """Take part in the election until cancelled; wake every cluster's loop when this
        replica starts or stops leading."""
        if self.leader is None:
            return
        election = asyncio.get_running_loop().create_task(self.leader.run())
        try:
            while True:
                await self.leader.changed.wait()
                self.leader.changed.clear()
                for ev in self.wakeups.values():
                    ev.set()
        finally:
            election.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await election

    def stop(self, key: str) -> None:
        """Wake a cluster's loop to see its stop flag."""
        ev = self.wakeups.get(key)
        if ev is not None:
            ev.set()

    def wake(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            ev = self.wakeups.get(f"{namespace}/{name}")
            if ev is not None:
                ev.set()

    async def close(self) -> None:
        if self.leader is not None:
            await self.leader.release()
        if self.gateway is not None:
            await self.gateway.close()


async def _sleep(wake: asyncio.Event, seconds: float, debounce: float) -> None:
    """Until ``wake`` is set (an event, or the stop: the caller sets it then too) or
    ``seconds`` pass."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), timeout=seconds)
    if wake.is_set() and debounce > 0:
        await asyncio.sleep(debounce)  # let a burst of pod events arrive first


async def controller_round(state: OperatorState, ref: ClusterRef, outcome: Outcome,
                           emit: Emit) -> None:
    """One Conductor-controller round for a cluster whose reconcile just ran."""
    spec = outcome.spec
    gw = state.gateway
    if spec is None or gw is None or not spec.gateway.enabled:
        return
    hp = spec.conductor.hot_prefixes
    model = spec.model.served
    data = await gw.hot_prefixes(model, limit=max(16, 4 * hp.max_replicas))
    reg_data = await gw.registry(model)
    if data is None or reg_data is None:
        return  # gateway unknown: change nothing
    registry = observe.registry_from_json(reg_data, model, ref.namespace)
    raw = await state.reconciler.reader.list("Pod", ref.namespace,
                                             names.selector_string(ref.name, c.ROLE_PREFILL))
    pods = [v for p in raw if (v := observe.pod_view(p)) is not None]
    hot = hotprefix.parse_hot(data) if hp.enabled else []
    plan = hotprefix.plan(pods, registry, hot, hp, store=spec.store.enabled)
    patches = REPLICA_PATCHES.labels(ref.key)  # exported from 0, before the first patch
    for name, value in plan.patches.items():
        await state.kube.patch("Pod", ref.namespace, name,
                               {"metadata": {"annotations": {c.ANNOTATION_REPLICAS: value}}})
        patches.inc()
    for prefix, pod in plan.added:
        emit("Normal", "ReplicaAssigned", f"hot prefix {prefix} -> {pod}")
    for prefix, pod in plan.removed:
        emit("Normal", "ReplicaRemoved", f"hot prefix {prefix} released by {pod} (cooled)")
    HOT_PREFIXES.labels(ref.key).set(len(plan.status))
    shape = tuple((h.prefix, tuple(h.pods)) for h in plan.status)
    if state.hot_written.get(ref.key) != shape:
        await state.reconciler.write_hot_prefixes(ref, plan.status)
        state.hot_written[ref.key] = shape


async def _report_forbidden(state: OperatorState, body: JsonDict, exc: Exception,
                            emit: Emit) -> bool:
    """A 403 becomes ``Degraded``/``Forbidden`` in the cluster's status, with an Event
    (the operator keeps running and retries with back-off). False when ``exc`` is not a
    403 or the status cannot be written either."""
    if not isinstance(exc, KubeError) or exc.status != 403:
        return False
    try:
        await state.reconciler.report(body, status.forbidden_problem(exc.message, exc.request),
                                      emit)
    except Exception as err:  # e.g. the status patch is forbidden too
        log.warning("cannot report %s on %s: %s", exc, body["metadata"].get("name"), err)
        return False
    return True


def _conflict(exc: Exception) -> bool:
    """A write refused because its object changed since it was read (HTTP 409 on a
    resourceVersion precondition)."""
    return isinstance(exc, KubeError) and exc.status == 409


def _only_leading(state: OperatorState, emit: Emit) -> Emit:
    """Events are writes too: none from a replica that stopped leading mid-reconcile."""
    def gated(kind: str, reason: str, message: str) -> None:
        if state.leading:
            emit(kind, reason, message)

    return gated


async def run_cluster(state: OperatorState, body: Mapping[str, Any], stopped: Stopped,
                      emit_for: Callable[[Mapping[str, Any]], Emit],
                      clock: Callable[[], float] = time.monotonic) -> None:
    """Reconcile one cluster until ``stopped`` (whoever sets it also sets the cluster's
    wake-up event, :meth:`OperatorState.stop`, so the loop does not sleep through it)."""
    snapshot: JsonDict = copy.deepcopy(dict(body))
    ref = cluster_ref(snapshot)
    wake = state.wakeups.setdefault(ref.key, asyncio.Event())
    CLUSTERS.set(len(state.wakeups))
    s = state.settings
    next_controller = 0.0
    failures = 0
    last_error = ""
    try:
        while not stopped:
            wake.clear()
            if not state.leading:  # another replica writes; ours keeps its watches warm
                await _sleep(wake, s.resync_interval_s, 0.0)
                continue
            snapshot = copy.deepcopy(dict(body))
            emit = _only_leading(state, emit_for(body))
            interval = s.resync_interval_s
            try:
                outcome = await state.reconciler.reconcile(snapshot, emit)
                failures, last_error = 0, ""
                FAILURES_IN_A_ROW.labels(ref.key).set(0)
                if outcome.progressing:
                    interval = s.busy_interval_s
                spec = outcome.spec
                if spec is not None and clock() >= next_controller:
                    next_controller = clock() + spec.conductor.hot_prefixes.interval_seconds
                    await controller_round(state, ref, outcome, emit)
            except asyncio.CancelledError:
                raise
            except NotLeader:
                continue  # leadership lost mid-reconcile: wait for it, as a follower
            except Exception as exc:  # the API server restarts, a patch conflicts, ...
                if _conflict(exc) and not failures:
                    # the cluster changed after it was read (a spec edit, a status write
                    # whose watch event had not arrived): read it again, no Event
                    ERRORS.labels("Conflict").inc()
                    log.info("reconcile of %s: %s; reconciling again", ref.key, exc)
                    failures = 1
                    await _sleep(wake, s.event_debounce_s, 0.0)
                    continue
                failures += 1
                ERRORS.labels(type(exc).__name__).inc()
                FAILURES_IN_A_ROW.labels(ref.key).set(failures)
                interval = min(MAX_BACKOFF_S, s.busy_interval_s * 2 ** failures)
                message = f"{type(exc).__name__}: {exc}"
                log.warning("reconcile of %s failed (%d in a row): %s", ref.key, failures,
                            message)
                if message != last_error:  # one Event per new error, not per retry
                    last_error = message
                    if not await _report_forbidden(state, snapshot, exc, emit):
                        emit("Warning", "ReconcileError", message[:1000])
            if next_controller > 0:  # wake up for the controller's next round too
                interval = max(0.0, min(interval, next_controller - clock()))
            await _sleep(wake, interval, s.event_debounce_s)
    finally:
        state.wakeups.pop(ref.key, None)
        state.hot_written.pop(ref.key, None)
        CLUSTERS.set(len(state.wakeups))
        forget_cluster(ref.key)
