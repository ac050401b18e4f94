"""The gateway's aiohttp application: the OpenAI API in front, P/D dispatch behind.

:class:`Gateway` composes the parts and turns every error into an answer:
- the front door (``auth.py``: keys, per-key limits; ``bodies.py``: the cap on buffered
  request bodies), as middleware;
- :class:`~.fleet.Fleet`: the models served and their engines' health and metrics;
- :class:`~.dispatch.Dispatcher`: each completion request, from body to answer;
- :class:`~.admin.AdminApi`: the ``/conductor/*`` reads; :class:`~.peers.PeerSync`: the
  in-flight load shared with the other gateway replicas;
- the small endpoints (health, readiness, models, metrics, OpenAPI).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from mooncake_conductor.warmup import warm_up
from mooncake_kube.client import KubeClient
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admin import AdminApi
from .auth import KeyLimiter, KeyRing, Principal
from .bodies import BodyBudget
from .catalog import Catalog
from .dispatch import EXPLAIN_HEADER, Dispatcher
from .enginecalls import EngineCalls
from .errors import ApiError
from .fleet import Fleet
from .front import FrontServer, PlainJson
from .metrics import GatewayMetrics
from .openapi import openapi_spec
from .peers import PeerSync
from .runtime import ModelRuntime
from .settings import GatewaySettings, Role

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: who an aiohttp request runs as (absent: no keys configured, or an open route)
PRINCIPAL = web.RequestKey("principal", Principal)


class Gateway:
    def __init__(self, settings: GatewaySettings, kube: KubeClient | None = None) -> None:
        """``kube``: the client the ConfigMap watch and the peer discovery use (default:
        from the in-cluster or kube config)."""
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.calls = EngineCalls(settings)
        self.fleet = Fleet(settings, self.metrics, self.calls, kube)
        self.keys = KeyRing(settings.auth)
        self.limits = KeyLimiter(settings.auth)
        self.bodies = BodyBudget(settings.max_buffered_bytes)
        self.dispatch = Dispatcher(settings, self.metrics, self.fleet, self.calls, self.limits)
        self.admin = AdminApi(settings, self.fleet)
        self.peer_sync = PeerSync(settings.peers, lambda: self.fleet.models, self.keys, kube)
        self._started = False
        self.app = self._build_app()

    @property
    def models(self) -> dict[str, ModelRuntime]:
        return self.fleet.models

    @property
    def catalog(self) -> Catalog:
        return self.fleet.catalog

    # -- app -------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth, self._buffered],
                              client_max_size=self.settings.max_body_bytes)
        r = app.router
        r.add_get("/v1/models", self.list_models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/metrics", self.metrics_handler)
        self.admin.add_routes(r)
        r.add_get("/conductor/load", self.peer_sync.load)
        r.add_get("/openapi.json", self.openapi)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        s = self.settings
        if s.warm_kernels:
            warm_up()  # before serving: nothing waits on the loop yet
        await self.calls.start()
        await self.fleet.start()
        await self.peer_sync.start()
        if s.gc_freeze:  # what lives now lives for good: full collections skip it
            gc.collect()
            gc.freeze()
        self._started = True

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.peer_sync.stop()
        await self.fleet.stop()
        await self.calls.close()
        if self.settings.gc_freeze:
            gc.unfreeze()  # back to the collector (several gateways in one process)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = "request_too_large" if exc.status == 413 else None
            return ApiError(exc.status, exc.reason or "error", code=code,
                            headers={k: v for k, v in exc.headers.items()
                                     if k.lower() == "allow"}).response()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return ApiError(500, "internal gateway error", code="internal_error").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The front door (``auth.py``): who the request runs as, or 401/403."""
        try:
            principal = self.keys.authorize(request.path, request.headers.get("Authorization"))
        except ApiError as exc:
            self.metrics.auth_denied.labels(exc.code or "denied").inc()
            raise
        if principal is not None:
            request[PRINCIPAL] = principal
        return await handler(request)

    @web.middleware
    async def _buffered(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Reserve the request's body from the gateway-wide cap (``bodies.py``) before it
        is read; 503 when it does not fit."""
        if not request.body_exists:
            return await handler(request)
        # never more than one body's limit: past it the handler's read answers 413 (and
        # counts it), having read no more than the limit
        limit = self.settings.max_body_bytes
        size = limit if request.content_length is None else min(request.content_length, limit)
        if not self.bodies.take(size):
            self.metrics.buffer_refusals.inc()
            raise ApiError(503, f"the gateway holds {self.bodies.held >> 20} MiB of request "
                           "bodies, its limit; retry shortly", code="server_busy",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        try:
            return await handler(request)
        finally:
            self.bodies.give(size)

    # -- small endpoints -------------------------------------------------------------------
    async def health(self, _r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _r: web.Request) -> web.Response:
        missing = [
            f"{name}:{role.value}" for name, rt in self.models.items() for role in Role
            if not any(i.routable for i in rt.members.instances(role))
        ]
        if self.fleet.catalog_watch is not None:
            # serving many clusters: ready once the ConfigMaps were listed. A model without
            # routable instances (a cluster being created or scaled to zero) is listed in
            # `missing` and answers 503 itself; it must not take the Service away from the
            # models that can serve
            listed = self.fleet.documents is not None
            ok = self._started and listed
            if not listed:
                missing.append("kubernetes_models:list")
        else:
            ok = self._started and not missing and bool(self.models)
        return web.json_response({"ready": ok, "missing": missing}, status=200 if ok else 503)

    async def list_models(self, _r: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": n, "object": "model", "created": created, "owned_by": "mooncake",
                 "max_model_len": rt.cfg.max_model_len} for n, rt in self.models.items()]
        return web.json_response({"object": "list", "data": data})

    async def metrics_handler(self, _r: web.Request) -> web.Response:
        self.metrics.buffered_bytes.set(self.bodies.held)
        for name, rt in self.models.items():
            self.metrics.index_blocks.labels(name).set(len(rt.index))
            rt.reports.publish_gauges()
            now = rt.now()
            rt.queues.drain(now)
            for inst in rt.prefill:
                if not inst.listed:
                    continue  # left: not exported
                self.metrics.instance_queue_s.labels(name, inst.name).set(
                    rt.cluster.prefill[inst.iid].wait_time(now))
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, _r: web.Request) -> web.Response:
        return web.json_response(openapi_spec(list(self.models)))

    # -- the OpenAI endpoints --------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        explain = request.headers.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes")
        resp = await self.dispatch.answer(chat, time.perf_counter(), explain, request=request,
                                          principal=request.get(PRINCIPAL))
        assert isinstance(resp, web.StreamResponse)  # PlainJson only without a request
        return resp

    def admits(self, chat: bool, authorization: str | None) -> bool:
        """Whether a completion request with this ``Authorization`` header gets past the
        front door (the fast front end asks before it buffers the body)."""
        try:
            self.keys.authorize("/v1/chat/completions" if chat else "/v1/completions",
                                authorization)
        except ApiError:
            return False
        return True

    async def serve_plain(self, raw: bytes, chat: bool,
                          authorization: str | None = None) -> web.Response | PlainJson | None:
        """The fast front end's entry (``front.py``): a request without ``stream`` nor
        explain header, answered in full; ``None`` (nothing counted, nothing sent upstream)
        when it asks for a stream, which aiohttp's server then serves. ``authorization``
        is the request's ``Authorization`` header, checked as the aiohttp path checks it."""
        try:
            principal = self.keys.authorize(
                "/v1/chat/completions" if chat else "/v1/completions", authorization)
        except ApiError as exc:
            self.metrics.auth_denied.labels(exc.code or "denied").inc()
            return exc.response()
        try:
            resp = await self.dispatch.answer(chat, time.perf_counter(), False, raw=raw,
                                              principal=principal)
        except ApiError as exc:
            return exc.response()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error on POST %s", "chat" if chat else "completions")
            return ApiError(500, "internal gateway error", code="internal_error").response()
        if resp is None:
            return None
        assert isinstance(resp, web.Response | PlainJson)
        return resp



def loop_factory(settings: GatewaySettings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory when ``settings.uvloop`` and it is installed; ``None``
    (asyncio's default loop) otherwise."""
    if not settings.uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: running on asyncio's event loop")
        return None
    return uvloop.new_event_loop


async def serve(settings: GatewaySettings, ready: Callable[[int], None] | None = None) -> None:
    """Run the gateway until cancelled; ``ready(port)`` once it listens."""
    gw = Gateway(settings)
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    front: FrontServer | None = None
    listener: asyncio.Server | None = None
    if settings.fast_front and runner.server is not None:
        front = FrontServer(gw, runner.server, settings.max_body_bytes, settings.front_idle_s)
        listener = await asyncio.get_running_loop().create_server(
            front.protocol, settings.host, settings.port, reuse_address=True)
        port = int(listener.sockets[0].getsockname()[1])
    else:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = int(runner.addresses[0][1]) if runner.addresses else settings.port
    log.info("gateway listening on %s:%s (event loop %s, upstream client %s, front end %s)",
             settings.host, port, type(asyncio.get_running_loop()).__module__,
             "lean" if gw.calls.upstream is not None else "aiohttp",
             "fast" if front is not None else "aiohttp")
    if ready is not None:
        ready(port)
    try:
        await asyncio.Event().wait()
    finally:
        if listener is not None:
            listener.close()
        if front is not None:
            front.close()
        await runner.cleanup()
