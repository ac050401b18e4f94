"""The operator's reads and writes of Kubernetes objects, by kind.

Every write goes through here, so the operator can count them (metrics, and the test that a
reconcile with nothing to change writes nothing) and treat 404/409 the same way everywhere.
Requests go through the project's one client (:mod:`mooncake_kube.client`); bodies are
plain dicts in and out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from mooncake_kube.client import (
    MERGE_PATCH,
    STRATEGIC_PATCH,
    KubeClient,
    KubeError,
    api_client_from_env,
)

from . import crd
from .metrics import READS, WRITES

JsonDict = dict[str, Any]
__all__ = ["MERGE_PATCH", "STRATEGIC_PATCH", "Kube", "KubeError", "NotLeader",
           "api_client_from_env", "path", "resource"]

#: API path prefix and plural of each kind the operator touches.
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "DaemonSet": ("/apis/apps/v1", "daemonsets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "Node": ("/api/v1", "nodes"),
    crd.KIND: (f"/apis/{crd.GROUP}/{crd.VERSION}", crd.PLURAL),
}


class NotLeader(Exception):
    """A write refused by this replica itself: another replica leads (``leader.py``)."""


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    """The API path of ``kind`` (cluster-scoped, such as a Node, when ``namespace`` is
    empty)."""
    prefix, plural = KINDS[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    if name is not None:
        out += f"/{name}"
    if sub is not None:
        out += f"/{sub}"
    return out


def resource(kind: str) -> tuple[str, str, str]:
    """(API group, version, plural) of ``kind``, as kopf's handlers name a resource."""
    prefix, plural = KINDS[kind]
    parts = prefix.strip("/").split("/")  # api/v1, apis/<group>/<version>
    return ("" if parts[0] == "api" else parts[1]), parts[-1], plural


class Kube:
    """Async get/list/create/patch/delete of plain-dict objects, counting reads and writes."""

    def __init__(self, api_client: Any, field_manager: str) -> None:
        self.client = KubeClient(api_client)
        self.field_manager = field_manager
        self.writes: Counter[tuple[str, str]] = Counter()
        self.reads: Counter[tuple[str, str]] = Counter()
        #: whether this replica may write now (None: always); the Lease is always written
        self.may_write: Callable[[], bool] | None = None
        #: told of every write that landed: (kind, namespace, name, the object as the API
        #: answered or None once it is gone, its uid when known); the reconciler's cache
        #: reads its own writes (cache.py)
        self.on_written: Callable[[str, str, str, JsonDict | None, str | None], None] | None
        self.on_written = None

    async def request(self, method: str, url: str, body: Any = None,
                      content_type: str = "application/json",
                      query: dict[str, str] | None = None) -> Any:
        return await self.client.request(method, url, body, content_type, query)

    def _count(self, verb: str, kind: str) -> None:
        if kind != "Lease" and self.may_write is not None and not self.may_write():
            raise NotLeader(f"{verb} {kind}: this replica does not hold the lease")
        self.writes[(verb, kind)] += 1
        WRITES.labels(verb, kind).inc()

    def _written(self, kind: str, namespace: str, name: str, obj: JsonDict | None,
                 uid: str | None = None) -> None:
        if self.on_written is not None:
            self.on_written(kind, namespace, name, obj, uid)

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    # -- reads ----------------------------------------------------------------------------------
    def _read(self, verb: str, kind: str) -> None:
        self.reads[(verb, kind)] += 1
        READS.labels(verb, kind).inc()

    async def get(self, kind: str, namespace: str, name: str) -> JsonDict | None:
        self._read("get", kind)
        try:
            out: JsonDict = await self.request("GET", path(kind, namespace, name))
            return out
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, selector: str | None = None
                   ) -> list[JsonDict]:
        self._read("list", kind)
        query = {"labelSelector": selector} if selector else None
        out = await self.request("GET", path(kind, namespace), query=query)
        items: list[JsonDict] = out.get("items") or []
        return items

    # -- writes ---------------------------------------------------------------------------------
    async def create(self, obj: JsonDict) -> JsonDict | None:
        """Create ``obj``; ``None`` when it already exists (409)."""
        kind, ns = obj["kind"], obj["metadata"]["namespace"]
        self._count("create", kind)
        try:
            out: JsonDict = await self.request(
                "POST", path(kind, ns), obj, query={"fieldManager": self.field_manager})
            self._written(kind, ns, obj["metadata"]["name"], out)
            return out
        except KubeError as err:
            if err.status == 409:
                return None
            raise

    async def patch(self, kind: str, namespace: str, name: str, body: JsonDict,
                    content_type: str = MERGE_PATCH, sub: str | None = None
                    ) -> JsonDict | None:
        """Patch; ``None`` when the object is gone (404)."""
        self._count("patch" if sub is None else f"patch-{sub}", kind)
        try:
            out: JsonDict = await self.request(
                "PATCH", path(kind, namespace, name, sub), body, content_type,
                query={"fieldManager": self.field_manager})
            self._written(kind, namespace, name, out)
            return out
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None
                     ) -> bool:
        """Delete (only that incarnation when ``uid`` is given); False when already gone."""
        self._count("delete", kind)
        body: JsonDict = {"kind": "DeleteOptions", "apiVersion": "v1",
                          "propagationPolicy": "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            out = await self.request("DELETE", path(kind, namespace, name), body)
            # a pod in its grace period (or an object held by finalizers) is still there,
            # marked for deletion; otherwise the API answers a Status and it is gone
            meta = (out or {}).get("metadata") or {}
            self._written(kind, namespace, name, out if meta.get("deletionTimestamp") else None,
                          uid)
            return True
        except KubeError as err:
            if err.status in (404, 409):
                return False
            raise
