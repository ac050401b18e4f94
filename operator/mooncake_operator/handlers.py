"""kopf handlers: thin. Every decision lives in the pure modules; these only wire events.

- one daemon per MooncakeCluster runs :func:`~.runtime.run_cluster` (reconcile + the
  Conductor controller);
- kopf indexes every kind the operator creates (:mod:`.cache`); reconciles read their
  children and pods from there, not from the API;
- an event on any of those, or on a MooncakeCluster, wakes that cluster's daemon (watch
  events, not list calls; no handler state is persisted, so kopf writes nothing of its own
  but its finalizer, which every replica adds alike);
- every replica watches; only the holder of the leader Lease reconciles and writes
  (``leader.py``, :meth:`~.runtime.OperatorState.follow_leadership`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from mooncake_contract import conventions as c

from . import cache, crd
from .kube import api_client_from_env
from .runtime import OperatorState, run_cluster
from .settings import OperatorSettings

log = logging.getLogger(__name__)
STATE: OperatorState | None = None
#: this replica's part in the leader election (OperatorState.follow_leadership)
ELECTION: asyncio.Task[None] | None = None
OUR_LABELS = {c.LABEL_MANAGED_BY: c.MANAGED_BY}
#: seconds kopf gives a daemon to see its stop flag and return before cancelling it
DAEMON_STOP_GRACE_S = 5.0
#: seconds kopf then waits for the cancelled daemon
DAEMON_CANCELLATION_S = 10.0


def _state() -> OperatorState:
    if STATE is None:
        raise kopf.TemporaryError("operator not started yet", delay=1)
    return STATE


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """Through the ``kubernetes`` client, as :func:`.kube.api_client_from_env`: the pod's
    service account at ``KUBERNETES_SERVICE_HOST``/``_PORT`` (kopf's own service-account
    helper assumes ``kubernetes.default.svc:443``, which a cluster without DNS or a non-root
    service proxy does not serve), else the current kubeconfig. kopf calls it again on a
    401, so a rotated token is read afresh."""
    return kopf.login_via_client(**kwargs)


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """kopf's settings for this operator.

    Watching some namespaces (``operator run -n NS``, the chart's default), kopf's
    scanning is off: it would list namespaces and watch CRDs, both cluster-scoped, and
    only warn when forbidden. The chart's namespaced Role grants neither
    (:mod:`.permissions`); the CRD is found through API discovery, open to every
    authenticated user. Serving every namespace, kopf keeps scanning on, to notice a
    CRD installed or upgraded after it started."""
    settings.persistence.finalizer = ours.finalizer
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ours.annotation_prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ours.annotation_prefix)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.scanning.disabled = not settings.peering.clusterwide


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    global STATE
    ours = OperatorSettings()
    configure_kopf(settings, ours)
    if ours.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(ours.metrics_port, addr=ours.metrics_host)
    # kopf's live indexes (empty now; filled before any daemon starts)
    indexes = {kind: kwargs[cache.index_id(kind)] for kind in cache.INDEXED}
    STATE = OperatorState.create(ours, api_client_from_env(), indexes)
    global ELECTION
    ELECTION = asyncio.get_running_loop().create_task(STATE.follow_leadership())
    log.info("mooncake-operator started; gateway at %s", ours.gateway_url)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    global STATE, ELECTION
    if ELECTION is not None:
        ELECTION.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ELECTION
        ELECTION = None
    if STATE is not None:
        await STATE.close()
        STATE = None


def _emitter(body: Mapping[str, Any]) -> Any:
    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)  # type: ignore[arg-type]

    return emit


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_backoff=DAEMON_STOP_GRACE_S,
             cancellation_timeout=DAEMON_CANCELLATION_S)
async def cluster_daemon(body: kopf.Body, meta: kopf.Meta, stopped: kopf.DaemonStopped,
                         **_: Any) -> None:
    state = _state()
    key = f"{meta.get('namespace')}/{meta.get('name')}"

    async def on_stop() -> None:  # the loop sleeps on its wake-up event: wake it to exit
        await stopped.wait()
        state.stop(key)

    watcher = asyncio.create_task(on_stop())
    try:
        await run_cluster(state, body, stopped, _emitter)
    finally:
        watcher.cancel()


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
def cluster_changed(name: str | None, namespace: str | None, **_: Any) -> None:
    if STATE is not None:
        STATE.wake(namespace, name)


def child_changed(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    """A child changed (a pod became ready, someone deleted the store Service, ...):
    reconcile its cluster now rather than at the next resync."""
    if STATE is not None:
        STATE.wake(namespace, labels.get(c.LABEL_CLUSTER))


def index_children(body: Mapping[str, Any], **_: Any) -> dict[cache.IndexKey, dict[str, Any]]:
    """kopf's index of one kind: each object under its name and its cluster (kopf drops it
    when it is deleted or loses the operator's labels)."""
    return cache.entries(body)


for _kind, (_group, _version, _plural) in cache.INDEXED.items():
    kopf.index(_group, _version, _plural, id=cache.index_id(_kind),
               labels=OUR_LABELS)(index_children)
    kopf.on.event(_group, _version, _plural, id=f"wake_on_{_plural}",
                  labels=OUR_LABELS)(child_changed)
