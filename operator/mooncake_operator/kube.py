"""A small async JSON client over the ``kubernetes`` package's ApiClient.

Every write goes through here, so the operator can count them (metrics, and the test that a
reconcile with nothing to change writes nothing) and treat 404/409 the same way everywhere.
Calls run in a thread (the ``kubernetes`` client blocks); bodies are plain dicts in and out.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections import Counter
from collections.abc import Callable
from typing import Any

from . import crd
from .metrics import READS, WRITES

JsonDict = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
REQUEST_TIMEOUT_S = 30.0

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


class KubeError(Exception):
    """An API error: its HTTP status, the API's message and the request (``VERB path``)."""

    def __init__(self, status: int, message: str, request: str = "") -> None:
        super().__init__(f"{status}: {message}" + (f" ({request})" if request else ""))
        self.status = status
        self.message = message
        self.request = request


def _status_error(status: int, data: bytes | None) -> Exception:
    err = Exception(f"HTTP {status}")
    err.status = status  # type: ignore[attr-defined]
    err.body = (data or b"").decode(errors="replace")  # type: ignore[attr-defined]
    return err


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


def api_client_from_env() -> Any:
    """In-cluster service account first, then ``$KUBECONFIG`` / ``~/.kube/config``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()  # type: ignore[no-untyped-call]


class Kube:
    """Async get/list/create/patch/delete of plain-dict objects, counting reads and writes."""

    def __init__(self, api_client: Any, field_manager: str) -> None:
        self.api = api_client
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

    def _call(self, method: str, url: str, body: Any = None,
              content_type: str = "application/json",
              query: dict[str, str] | None = None) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            data = self._send(method, url, body, headers, query)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            raw = getattr(exc, "body", "") or ""
            try:
                message = json.loads(raw).get("message", raw)
            except (ValueError, AttributeError):
                message = str(raw)
            raise KubeError(int(status), str(message), f"{method} {url}") from None
        return json.loads(data) if data else None

    def _send(self, method: str, url: str, body: Any, headers: dict[str, str],
              query: dict[str, str] | None) -> bytes:
        """One request through the ``kubernetes`` client (its auth, TLS and pooling)."""
        api = self.api
        if hasattr(api, "param_serialize"):  # kubernetes >= 35 (openapi-generator 7)
            m, full, hdrs, payload, post = api.param_serialize(
                method, url, query_params=list((query or {}).items()), header_params=headers,
                body=body, auth_settings=["BearerToken"])
            resp = api.call_api(m, full, header_params=hdrs, body=payload, post_params=post,
                                _request_timeout=REQUEST_TIMEOUT_S)
            resp.read()
            if not 200 <= int(resp.status) < 300:
                raise _status_error(int(resp.status), resp.data)
            return bytes(resp.data or b"")
        if query:
            url += "?" + urllib.parse.urlencode(query)
        resp = api.call_api(url, method, header_params=headers, body=body,
                            auth_settings=["BearerToken"], _preload_content=False,
                            _return_http_data_only=True, _request_timeout=REQUEST_TIMEOUT_S)
        return bytes(resp.data or b"")

    async def request(self, method: str, url: str, body: Any = None,
                      content_type: str = "application/json",
                      query: dict[str, str] | None = None) -> Any:
        return await asyncio.to_thread(self._call, method, url, body, content_type, query)

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
