"""A minimal Kubernetes API server for the gateway's tests (127.0.0.1, plain HTTP).

Serves what the gateway's ``kubernetes`` client calls: list and watch of pods and
ConfigMaps, in one namespace or all, filtered by equality label selectors, with
resource versions (a watch from version *v* first gets every later event). Tests change
objects with :meth:`FakeKube.put` and :meth:`FakeKube.delete`; :meth:`FakeKube.kubeconfig`
writes a kube config pointing at it (the gateway subprocess gets it as ``KUBECONFIG``).
This is a test double for the API's wire format, not a model of its semantics: the
real API server is for the operator's end-to-end tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import yaml
from aiohttp import web
from mooncake_kube.client import KubeClient

HOST = "127.0.0.1"

KINDS = {"pods": "Pod", "configmaps": "ConfigMap"}
WATCH_DEFAULT_S = 300


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in KINDS}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # rv, kind, type, obj
        self.rv = 1
        self.port = 0
        self.requests: list[str] = []
        #: how many of the next requests to answer 500 (an API server restarting)
        self.fail_next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # -- test side ---------------------------------------------------------------------------
    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (ADDED or MODIFIED to watchers); returns it."""
        return self._call(self._put(kind, json.loads(json.dumps(obj))))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._call(self._delete(kind, namespace, name))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return json.loads(json.dumps(self.objects[kind][(namespace, name)]))

    def kubeconfig(self, path: str) -> str:
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": {"server": f"http://{HOST}:{self.port}"}}],
               "users": [{"name": "fake", "user": {"token": "fake"}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def client(self) -> KubeClient:
        """The project's client, pointed at this server."""
        conf = kubernetes.client.Configuration()
        conf.host = f"http://{HOST}:{self.port}"
        return KubeClient(kubernetes.client.ApiClient(conf))

    def watchers(self) -> int:
        """Watch requests seen so far."""
        return sum(1 for r in self.requests if "watch=" in r)

    # -- server side -------------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        assert self._changed is not None
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self.objects[kind].get(key)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        else:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", KINDS[kind])
        self.objects[kind][key] = obj
        self.events.append((self.rv, kind, "MODIFIED" if old else "ADDED", obj))
        async with self._changed:
            self._changed.notify_all()
        return obj

    async def _delete(self, kind: str, namespace: str, name: str) -> None:
        assert self._changed is not None
        obj = self.objects[kind].pop((namespace, name))
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self.events.append((self.rv, kind, "DELETED", obj))
        async with self._changed:
            self._changed.notify_all()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(str(request.rel_url))
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"kind": "Status", "message": "restarting"}, status=500)
        kind = request.match_info["kind"]
        if kind not in KINDS:
            raise web.HTTPNotFound()
        ns = request.match_info.get("ns")
        selector = request.query.get("labelSelector", "")

        def wanted(obj: dict[str, Any]) -> bool:
            return (ns is None or obj["metadata"]["namespace"] == ns) and \
                _matches(obj, selector)

        if request.query.get("watch", "").lower() not in ("true", "1"):
            items = [o for o in self.objects[kind].values() if wanted(o)]
            return web.json_response({"apiVersion": "v1", "kind": KINDS[kind] + "List",
                                      "metadata": {"resourceVersion": str(self.rv)},
                                      "items": items})
        since = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or WATCH_DEFAULT_S)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent = since
        with contextlib.suppress(TimeoutError, ConnectionError):
            while loop.time() < deadline:
                for rv, k, typ, obj in self.events:
                    if rv > sent and k == kind and wanted(obj):
                        line = json.dumps({"type": typ, "object": obj}) + "\n"
                        await resp.write(line.encode())
                    sent = max(sent, rv)
                async with self._changed:
                    if self.events[-1:] and self.events[-1][0] > sent:
                        continue
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._changed = asyncio.Condition()
        app = web.Application()
        for path in ("/api/v1/{kind}", "/api/v1/namespaces/{ns}/{kind}"):
            app.router.add_get(path, self._handle)
        runner = self._runner = web.AppRunner(app, handler_cancellation=True)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, HOST, 0)
        loop.run_until_complete(site.start())
        self.port = int(runner.addresses[0][1])
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="fake-kube", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def stop(self) -> None:
        """Stop answering (its port refuses connections from now on); idempotent."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


@contextlib.contextmanager
def fake_kube() -> Iterator[FakeKube]:
    k = FakeKube()
    k.start()
    try:
        yield k
    finally:
        k.stop()
