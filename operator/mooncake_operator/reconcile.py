"""One reconcile of one MooncakeCluster: read, plan (pure), write only what differs.

Level-based: it looks at what exists (children, pods, the gateway's registry) and moves it
one step toward the spec, whatever happened before; create, resume, spec change, pod
event and periodic resync all run the same function. A reconcile with nothing to change
writes nothing (the write counter in :class:`~.kube.Kube` proves it in a test).

A spec the API server accepted but the operator cannot honour (unknown policy parameters;
an engine release or combination it does not support) ends here as ``Degraded`` with the
reason ``InvalidSpec`` or ``UnsupportedEngine`` and an Event; the children are left as
they are, so a bad edit never takes a serving cluster down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_conductor.engine import ConductorConfig
from mooncake_contract import conventions as c
from pydantic import ValidationError

from . import builders, engines, names, observe, placement, rollout, status
from .cache import CHILD_KINDS, Reader
from .crashes import CrashHistory
from .gatewayclient import GatewayClient
from .kube import Kube
from .metrics import ERRORS, READY_PODS, RECONCILE_SECONDS, RECONCILES, publish_conditions
from .names import ClusterRef
from .settings import OperatorSettings
from .spec import EngineKind, HotPrefixStatus, MooncakeClusterSpec, MooncakeClusterStatus

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]
#: emit(type "Normal"|"Warning", reason, message): a Kubernetes Event on the cluster
Emit = Callable[[str, str, str], None]
#: Degraded reason: a real engine release or combination the builders do not make pods for
UNSUPPORTED_ENGINE = "UnsupportedEngine"


@dataclass(frozen=True, slots=True)
class Outcome:
    progressing: bool
    status: MooncakeClusterStatus
    spec: MooncakeClusterSpec | None


def cluster_ref(body: JsonDict) -> ClusterRef:
    meta = body["metadata"]
    return ClusterRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                      generation=int(meta.get("generation") or 0))


def parse_status(body: JsonDict) -> MooncakeClusterStatus:
    try:
        return MooncakeClusterStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return MooncakeClusterStatus()


def parse_spec(body: JsonDict) -> tuple[MooncakeClusterSpec | None, status.Problem | None]:
    """The spec, or why the operator cannot honour it."""
    try:
        spec = MooncakeClusterSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return None, status.Problem("InvalidSpec", _first_error(exc))
    if spec.engine.kind is not EngineKind.SIMULATED:
        try:
            engines.release_of(spec)
        except engines.UnsupportedEngine as exc:
            return None, status.Problem(UNSUPPORTED_ENGINE, str(exc))
    try:
        conductor_config(spec)
    except ValidationError as exc:
        return None, status.Problem("InvalidSpec", "spec.conductor: " + _first_error(exc))
    return spec, None


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors()
    if not errs:
        return str(exc)
    e = errs[0]
    where = ".".join(str(x) for x in e.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{where}: {e.get('msg')}{more}"


def conductor_config(spec: MooncakeClusterSpec) -> ConductorConfig:
    """The core's configuration for this cluster (validates the policy's parameters): the
    ``conductor`` part of the gateway's model document, one mapping for both."""
    doc = builders.gateway_model(ClusterRef("x", "x", "x"), spec)["conductor"]
    return ConductorConfig.model_validate(doc)


def status_patch(st: MooncakeClusterStatus) -> JsonDict:
    """The status as a merge patch (``rollout: null`` removes a finished rollout; the
    Conductor controller's hotPrefixes are left to it)."""
    data = st.model_dump(by_alias=True, mode="json", exclude={"hot_prefixes"})
    return {"status": data}


class Reconciler:
    def __init__(self, kube: Kube, gateway: GatewayClient | None, settings: OperatorSettings,
                 clock: Callable[[], float] = time.time, reader: Reader | None = None
                 ) -> None:
        self.kube = kube
        #: where children and pods are read: kopf's indexes in the operator (cache.py)
        self.reader: Reader = reader if reader is not None else kube
        self.gateway = gateway
        self.settings = settings
        self.clock = clock
        self.crashes = CrashHistory(settings.crash_loop_window_s, settings.crash_loop_restarts)

    # -- children -------------------------------------------------------------------------------
    async def _apply_children(self, ref: ClusterRef, spec: MooncakeClusterSpec
                              ) -> dict[str, JsonDict]:
        """Create or patch the non-pod children; delete those no longer wanted. Returns the
        live objects by ``kind/name``."""
        wanted = builders.children(ref, spec, self.settings)
        live: dict[str, JsonDict] = {}
        for obj in wanted:
            kind, name = obj["kind"], obj["metadata"]["name"]
            cur = await self.reader.get(kind, ref.namespace, name)
            want_hash = obj["metadata"]["annotations"][builders.SPEC_HASH_ANNOTATION]
            if cur is None:
                created = await self.kube.create(obj)
                if created is not None:
                    live[f"{kind}/{name}"] = created
                    continue
                # it exists: the cache lags, or the object is not labelled as ours
                cur = await self.kube.get(kind, ref.namespace, name)
                if cur is None:
                    continue  # deleted meanwhile: the next pass creates it
            if (cur["metadata"].get("annotations") or {}).get(
                    builders.SPEC_HASH_ANNOTATION) != want_hash:
                body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
                # the version just read: a concurrent writer's change is not overwritten
                body["metadata"] = {"labels": obj["metadata"]["labels"],
                                    "annotations": obj["metadata"]["annotations"]}
                if cur["metadata"].get("resourceVersion"):
                    body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
                cur = await self.kube.patch(kind, ref.namespace, name, body)
            if cur is not None:
                live[f"{kind}/{name}"] = cur
        keep = {f"{o['kind']}/{o['metadata']['name']}" for o in wanted}
        selector = f"{c.LABEL_CLUSTER}={ref.name},{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"
        for kind in CHILD_KINDS:
            for obj in await self.reader.list(kind, ref.namespace, selector):
                key = f"{kind}/{obj['metadata']['name']}"
                owners = obj["metadata"].get("ownerReferences") or []
                if key not in keep and any(o.get("uid") == ref.uid for o in owners):
                    await self.kube.delete(kind, ref.namespace, obj["metadata"]["name"])
        return live

    # -- one pass -------------------------------------------------------------------------------
    async def reconcile(self, body: JsonDict, emit: Emit) -> Outcome:
        started = time.perf_counter()
        try:
            out = await self._reconcile(body, emit)
            RECONCILES.labels("invalid" if out.spec is None else "ok").inc()
            return out
        except Exception as exc:
            RECONCILES.labels("error").inc()
            ERRORS.labels(type(exc).__name__).inc()
            raise
        finally:
            RECONCILE_SECONDS.observe(time.perf_counter() - started)

    async def _reconcile(self, body: JsonDict, emit: Emit) -> Outcome:
        ref = cluster_ref(body)
        version = body["metadata"].get("resourceVersion")
        now = self.clock()
        before = parse_status(body)
        spec, invalid = parse_spec(body)
        pods_raw = await self.reader.list("Pod", ref.namespace,
                                          f"{c.LABEL_CLUSTER}={ref.name}")
        pods = [v for p in pods_raw if self._owned(p, ref) and (v := observe.pod_view(p))]
        if spec is None:
            assert invalid is not None
            st = before.model_copy(update={
                "observed_generation": ref.generation,
                "conditions": self._invalid_conditions(before, invalid, ref.generation, now),
            })
            await self._write_status(ref, before, st, emit, version)
            return Outcome(progressing=False, status=st, spec=None)

        rev = builders.revision(ref, spec, self.settings)
        live = await self._apply_children(ref, spec)
        by_role: dict[str, list[JsonDict]] = {}
        for p in pods_raw:
            by_role.setdefault((p["metadata"].get("labels") or {}).get(c.LABEL_ROLE, ""),
                               []).append(p)
        store = observe.store_view(
            spec.store.enabled,
            live.get(f"Deployment/{names.store_master(ref.name)}"),
            live.get(f"DaemonSet/{names.store_nodes(ref.name)}"),
            by_role.get(c.ROLE_STORE_MASTER, []), by_role.get(c.ROLE_STORE_NODE, []))
        registry = None
        conflict: status.Problem | None = None
        if spec.gateway.enabled and self.gateway is not None:
            data = await self.gateway.registry(spec.model.served)
            if data is not None:
                registry = observe.registry_from_json(data, spec.model.served, ref.namespace)
            ours = f"{ref.namespace}/{names.gateway_configmap(ref.name)}"
            if registry is not None and registry.source and registry.source != ours:
                conflict = status.Problem(
                    "ServedNameConflict",
                    f"the gateway serves model {spec.model.served!r} from {registry.source} "
                    f"(the older claim wins); give this cluster another model.servedName")
                registry = None
        desired = {role: spec.pool(role).replicas for role in rollout.ROLES}
        plan = rollout.plan(rollout.PoolInput(
            revision=rev, desired=desired, max_surge=spec.rollout.max_surge,
            drain_timeout_s=spec.rollout.drain_timeout_seconds, pods=pods, registry=registry,
            gateway_gate=spec.gateway.enabled and self.gateway is not None,
            # the first engines wait for the store master; later ones (scale up, rollout)
            # do not wait on a master that blips: they retry connecting themselves
            start_allowed=not spec.store.enabled or store.master_ready or bool(pods),
            rollout=status.rollout_state(before), now=now))
        await self._execute(ref, spec, rev, plan, now, emit)
        await self._place(ref, spec, pods)
        st = status.compute(status.StatusInput(
            generation=ref.generation, revision=rev, policy=spec.conductor.policy,
            desired=desired, pods=pods, registry=registry,
            gateway_gate=spec.gateway.enabled and self.gateway is not None,
            gateway_endpoint=self.settings.gateway_public_url or self.settings.gateway_url,
            served_model=spec.model.served, store=store,
            store_address=f"{names.store_service(ref.name)}.{ref.namespace}.svc:"
                          f"{spec.store.master.rpc_port}",
            plan=plan, invalid=conflict, hot_prefixes=list(before.hot_prefixes),
            previous=before, gpu_resource=self.settings.gpu_resource,
            crash_restarts=self.settings.crash_loop_restarts,
            crash_window_s=self.settings.crash_loop_window_s,
            recent_crashes=self.crashes.observe(pods, now), now=now))
        if before.rollout is None and st.rollout is not None:
            emit("Normal", "RolloutStarted",
                 f"rolling both pools to revision {rev} in {st.rollout.steps} step(s)")
        elif before.rollout is not None and st.rollout is None:
            emit("Normal", "RolloutFinished", f"every pod runs revision {rev}")
        await self._write_status(ref, before, st, emit, version)
        READY_PODS.labels(ref.key, c.ROLE_PREFILL).set(st.prefill.ready)
        READY_PODS.labels(ref.key, c.ROLE_DECODE).set(st.decode.ready)
        publish_conditions(ref.key, ((cond.type, cond.status.value == "True", cond.reason)
                                     for cond in st.conditions))
        busy = plan.writes or plan.rollout is not None or any(
            cond.type == status.PROGRESSING and cond.status.value == "True"
            for cond in st.conditions)
        return Outcome(progressing=busy, status=st, spec=spec)

    @staticmethod
    def _owned(pod: JsonDict, ref: ClusterRef) -> bool:
        owners = pod["metadata"].get("ownerReferences") or []
        return any(o.get("uid") == ref.uid for o in owners)

    def _invalid_conditions(self, before: MooncakeClusterStatus, problem: status.Problem,
                            generation: int, now: float) -> list[Any]:
        prev = {cond.type: cond for cond in before.conditions}
        keep_progress = prev.get(status.PROGRESSING)
        conds = [
            status._condition(status.READY, False, problem.reason, problem.message,
                              generation, prev, now),
            keep_progress or status._condition(status.PROGRESSING, False, "Stalled",
                                               problem.message, generation, prev, now),
            status._condition(status.DEGRADED, True, problem.reason, problem.message,
                              generation, prev, now),
        ]
        return conds

    async def _execute(self, ref: ClusterRef, spec: MooncakeClusterSpec, rev: str,
                       plan: rollout.PoolPlan, now: float, emit: Emit) -> None:
        pods = [builders.engine_pod(ref, spec, self.settings, role, rev, ordinal)
                for role, ordinal in plan.create]
        limit = asyncio.Semaphore(self.settings.max_parallel_writes)

        async def create(pod: JsonDict) -> str | None:
            async with limit:
                return pod["metadata"]["name"] if await self.kube.create(pod) else None

        created = [n for n in await asyncio.gather(*(create(p) for p in pods)) if n]
        if created:
            emit("Normal", "CreatedPods", f"created {', '.join(created)}")
        for p in plan.drain:
            await self.kube.patch("Pod", ref.namespace, p.name, {"metadata": {"annotations": {
                c.ANNOTATION_DRAIN: "true", observe.DRAIN_SINCE_ANNOTATION: f"{now:.3f}"}}})
            emit("Normal", "DrainingPod",
                 f"{p.name}: the gateway stops sending it requests; deleted once idle")
        deleted = []
        for p in plan.delete:
            if await self.kube.delete("Pod", ref.namespace, p.name, uid=p.uid):
                deleted.append(p.name)
        if deleted:
            emit("Normal", "DeletedPods", f"deleted {', '.join(deleted)}")

    async def _place(self, ref: ClusterRef, spec: MooncakeClusterSpec,
                     pods: list[observe.PodView]) -> None:
        """Annotate each newly scheduled engine pod with its node's topology labels."""
        waiting = placement.unplaced(pods, spec.topology)
        labels: dict[str, dict[str, str]] = {}
        for node in sorted({p.node for p in waiting}):
            obj = await self.kube.get("Node", "", node)
            if obj is not None:
                labels[node] = dict((obj.get("metadata") or {}).get("labels") or {})
        for name, value in placement.patches(waiting, labels, spec.topology).items():
            await self.kube.patch("Pod", ref.namespace, name, {
                "metadata": {"annotations": {c.ANNOTATION_TOPOLOGY: value}}})

    async def _write_status(self, ref: ClusterRef, before: MooncakeClusterStatus,
                            after: MooncakeClusterStatus, emit: Emit,
                            version: str | None) -> None:
        """Patch the status when it changed, on the condition that the cluster is still
        at ``version`` (the resourceVersion it was read at): a status computed from a spec
        that has changed since, or by a replica that lost the lease while it computed,
        fails with 409 instead of landing."""
        if status_patch(after) == status_patch(before):
            return
        body = status_patch(after)
        if version:
            body["metadata"] = {"resourceVersion": version}
        await self.kube.patch("MooncakeCluster", ref.namespace, ref.name, body, sub="status")
        for cond in status.transitions(before, after):
            bad = (cond.type == status.DEGRADED and cond.status.value == "True") or (
                cond.type == status.READY and cond.status.value == "False"
                and cond.reason in ("InvalidSpec", UNSUPPORTED_ENGINE, "InsufficientGPUCapacity",
                                    "NoMatchingNodes", "Unschedulable", "EngineCrashLooping",
                                    "StoreDegraded", "Forbidden"))
            emit("Warning" if bad else "Normal", cond.reason,
                 f"{cond.type}={cond.status.value}: {cond.message}")

    async def report(self, body: JsonDict, problem: status.Problem, emit: Emit) -> None:
        """Write ``problem`` as ``Degraded`` (and ``Ready`` False with its reason), the rest
        of the status as it was: for what stopped a reconcile half-way, such as a 403 from
        the API server. The next reconcile that gets through computes the conditions
        afresh, so the problem clears itself once fixed."""
        ref = cluster_ref(body)
        before = parse_status(body)
        st = before.model_copy(update={
            "observed_generation": ref.generation,
            "conditions": self._invalid_conditions(before, problem, ref.generation,
                                                   self.clock()),
        })
        await self._write_status(ref, before, st, emit,
                                 body["metadata"].get("resourceVersion"))

    async def write_hot_prefixes(self, ref: ClusterRef, hot: list[HotPrefixStatus]) -> None:
        body = {"status": {"hotPrefixes": [h.model_dump(by_alias=True, mode="json")
                                           for h in hot]}}
        await self.kube.patch("MooncakeCluster", ref.namespace, ref.name, body, sub="status")
