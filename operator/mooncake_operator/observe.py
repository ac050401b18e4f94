"""What the operator sees, as small typed views (pure): engine pods, the gateway's registry,
the store's objects. Built from plain API dicts and the gateway's JSON."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from mooncake_contract import conventions as c

from . import names

JsonDict = dict[str, Any]
#: Annotation the operator sets with the drain start (epoch seconds) beside the drain flag.
DRAIN_SINCE_ANNOTATION = f"{c.DOMAIN}/drain-since"


def parse_time(value: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time as the API writes it (``None`` if
    absent, not a string or unreadable)."""
    if not value or not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class PodView:
    """One engine pod as the reconcile needs it."""

    name: str
    uid: str
    role: str
    revision: str
    ordinal: int
    phase: str = "Pending"
    ready: bool = False
    terminating: bool = False
    draining: bool = False
    drain_since: float | None = None
    unschedulable: str | None = None  # the scheduler's message, when it could not place it
    restarts: int = 0
    crash_looping: bool = False  # a container waits in CrashLoopBackOff now
    last_crash_at: float | None = None  # the latest container termination's finishedAt
    node: str = ""
    replicas_annotation: str | None = None
    topology_annotation: str | None = None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def pod_view(pod: JsonDict) -> PodView | None:
    """The view of an engine pod (``None`` for pods that are not ours or not engines)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(c.LABEL_ROLE)
    if role not in (c.ROLE_PREFILL, c.ROLE_DECODE):
        return None
    parsed = names.parse_pod_name(meta.get("name", ""))
    revision = labels.get(c.LABEL_REVISION, parsed[2] if parsed else "")
    ordinal = parsed[3] if parsed else 0
    status = pod.get("status") or {}
    conditions = {cond.get("type"): cond for cond in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    sched = conditions.get("PodScheduled") or {}
    unschedulable = None
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        unschedulable = str(sched.get("message") or "unschedulable")
    restarts = 0
    crash = False
    last_crash: float | None = None
    for cs in status.get("containerStatuses") or []:
        restarts = max(restarts, int(cs.get("restartCount") or 0))
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            crash = True
        ended = parse_time(((cs.get("lastState") or {}).get("terminated") or {})
                           .get("finishedAt"))
        if ended is not None and (last_crash is None or ended > last_crash):
            last_crash = ended
    ann = meta.get("annotations") or {}
    since = ann.get(DRAIN_SINCE_ANNOTATION)
    try:
        drain_since = float(since) if since else None
    except ValueError:
        drain_since = None
    return PodView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), role=role, revision=revision,
        ordinal=ordinal, phase=status.get("phase") or "Pending", ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        draining=ann.get(c.ANNOTATION_DRAIN) == "true", drain_since=drain_since,
        unschedulable=unschedulable, restarts=restarts, crash_looping=crash,
        last_crash_at=last_crash,
        node=(pod.get("spec") or {}).get("nodeName") or "",
        replicas_annotation=ann.get(c.ANNOTATION_REPLICAS),
        topology_annotation=ann.get(c.ANNOTATION_TOPOLOGY),
    )


@dataclass(frozen=True, slots=True)
class GatewayPod:
    """What the gateway says about one pod (``/conductor/registry``)."""

    pod: str  # namespace/name
    role: str
    registered: bool = False
    routable: bool = False
    listed: bool = False
    inflight: int = 0
    unique_blocks: int = 0
    index_blocks: int = 0
    predicted_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Registry:
    """The gateway's registry for one model."""

    model: str
    pods: dict[str, GatewayPod] = field(default_factory=dict)  # by pod name (no namespace)
    source: str = ""

    def get(self, name: str) -> GatewayPod | None:
        return self.pods.get(name)


def registry_from_json(data: JsonDict, model: str, namespace: str) -> Registry | None:
    """Our model's entry of ``GET /conductor/registry`` (``None`` when the gateway does not
    serve it)."""
    models = data.get("models") if isinstance(data.get("models"), list) else [data]
    for entry in models or []:
        if not isinstance(entry, dict) or entry.get("model") != model:
            continue
        pods: dict[str, GatewayPod] = {}
        for inst in entry.get("instances") or []:
            full = str(inst.get("pod") or inst.get("name") or "")
            ns, _, name = full.rpartition("/")
            if not name or (ns and ns != namespace):
                continue
            pods[name] = GatewayPod(
                pod=full, role=str(inst.get("role", "")),
                registered=bool(inst.get("registered")), routable=bool(inst.get("routable")),
                listed=bool(inst.get("listed")), inflight=int(inst.get("inflight") or 0),
                unique_blocks=int(inst.get("unique_blocks") or 0),
                index_blocks=int(inst.get("index_blocks") or 0),
                predicted_wait_s=float(inst.get("predicted_wait_s") or 0.0),
            )
        return Registry(model=model, pods=pods, source=str(entry.get("source") or ""))
    return None


@dataclass(frozen=True, slots=True)
class StoreView:
    """The store's objects: master Deployment and its pods, the node DaemonSet."""

    enabled: bool
    master_ready: bool = False
    master_problem: str | None = None  # unschedulable / crash-looping master pod
    nodes_desired: int = 0
    nodes_ready: int = 0
    nodes_problem: str | None = None

    @property
    def ready(self) -> bool:
        return not self.enabled or (self.master_ready and self.nodes_desired > 0
                                    and self.nodes_ready >= self.nodes_desired)


def store_view(enabled: bool, deployment: JsonDict | None, daemonset: JsonDict | None,
               master_pods: list[JsonDict], node_pods: list[JsonDict]) -> StoreView:
    if not enabled:
        return StoreView(enabled=False)
    dep_status = (deployment or {}).get("status") or {}
    ds_status = (daemonset or {}).get("status") or {}

    def problem(pods: list[JsonDict]) -> str | None:
        for p in pods:
            status = p.get("status") or {}
            for cond in status.get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                    return f"{p['metadata']['name']}: {cond.get('message', 'unschedulable')}"
            for cs in status.get("containerStatuses") or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") == "CrashLoopBackOff":
                    return f"{p['metadata']['name']}: crash-looping"
        return None

    return StoreView(
        enabled=True,
        master_ready=int(dep_status.get("readyReplicas") or 0) >= 1,
        master_problem=problem(master_pods),
        nodes_desired=int(ds_status.get("desiredNumberScheduled") or 0),
        nodes_ready=int(ds_status.get("numberReady") or 0),
        nodes_problem=problem(node_pods),
    )
