"""The gateway's aiohttp application: OpenAI API in front, P/D dispatch behind.

Per request: validate → tokens (cached) → block keys → ``Conductor.schedule`` in-process
→ 429 on rejection, else prefill (``max_tokens=1``, ``kv_transfer_params.do_remote_decode``)
then decode with the returned ``kv_transfer_params`` (streamed through), or straight to
decode when the uncached part of the prompt is below the model's ``direct`` threshold.
A prefill that fails before the client got anything is retried on the next-best
instance; a decode failing mid-stream ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from mooncake_conductor import kernels
from mooncake_conductor.blockkeys import block_keys_array
from mooncake_conductor.engine import Decision
from mooncake_conductor.state import RequestInfo
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import fastjson
from .auth import KeyLimiter, KeyRing, LimitExceeded, Principal
from .bodies import BodyBudget
from .catalog import Catalog, ConfigMapWatch, Conflict, ModelDocument, resolve
from .enginemetrics import parse_engine_metrics
from .errors import ApiError, error_body
from .front import FrontServer, PlainJson
from .handshake import Handshake, Transfer, handshake
from .metrics import GatewayMetrics, RequestCounter
from .openapi import openapi_spec
from .peers import PeerSync
from .runtime import Instance, ModelRuntime
from .settings import GatewaySettings, ModelSettings, Role, TokenizerMode
from .tokens import PromptTokenizer, Tokens
from .upstream import UpstreamCallError, UpstreamPool
from .validate import Parsed, parse_request

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: what answers a completion request: aiohttp's response, or the fast front end's own
Answer = web.StreamResponse | PlainJson
EXPLAIN_HEADER = "x-conductor-explain"
DECISION_HEADER = "x-conductor-decision"
DECODE_ATTEMPTS = 2
JSON_HEADERS = {"Content-Type": "application/json"}
UPSTREAM_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
SSE_DONE = b"data: [DONE]"
MICRO = 1e6
DECISIONS_DEFAULT_LIMIT = 50
UNKNOWN_MODEL = "unknown"
T = TypeVar("T")
#: who an aiohttp request runs as (absent: no keys configured, or an open route)
PRINCIPAL = web.RequestKey("principal", Principal)
OUTCOME_BY_STATUS = {400: "bad_request", 404: "not_found", 413: "too_large", 429: "rejected"}


class UpstreamError(Exception):
    """An engine call failed in a way another instance may not."""


class Gateway:
    def __init__(self, settings: GatewaySettings, kube_api: Any | None = None,
                 watch_factory: Callable[[], Any] | None = None) -> None:
        """``kube_api`` / ``watch_factory``: the ``CoreV1Api`` and ``Watch`` maker the
        ConfigMap watch uses (default: from the in-cluster or kube config; tests pass
        fakes)."""
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.request_counter = RequestCounter(self.metrics)
        self.models: dict[str, ModelRuntime] = {
            m.name: ModelRuntime(m, settings, self.metrics) for m in settings.models
        }
        self.catalog_watch: ConfigMapWatch | None = None
        if settings.kubernetes_models is not None:
            self.catalog_watch = ConfigMapWatch(settings.kubernetes_models, kube_api,
                                                watch_factory)
        self.catalog = Catalog()
        self._documents: list[ModelDocument] | None = None  # the latest seen
        self._documents_dirty = False
        self._reconciler: asyncio.Task[None] | None = None
        self._errors_counted: dict[str, str] = {}  # source -> the error counted last
        self._conflicts_logged: list[Conflict] = []  # conflicts logged already
        self._background: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None  # non-streamed calls (lean_upstream)
        self.tokenizer = PromptTokenizer(
            settings.tokenize_cache_entries,
            self._remote_tokenize if settings.tokenizer is TokenizerMode.ENGINE else None,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.keys = KeyRing(settings.auth)
        self.limits = KeyLimiter(settings.auth)
        self.bodies = BodyBudget(settings.max_buffered_bytes)
        self.peer_sync = PeerSync(settings.peers, lambda: self.models, self.keys, kube_api,
                                  watch_factory)
        self.app = self._build_app()

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
        r.add_get("/conductor/state", self.conductor_state)
        r.add_get("/conductor/hot-prefixes", self.hot_prefixes)
        r.add_get("/conductor/decisions", self.decisions)
        r.add_get("/conductor/registry", self.registry)
        r.add_get("/conductor/models", self.model_catalog)
        r.add_get("/conductor/load", self.peer_sync.load)
        r.add_get("/openapi.json", self.openapi)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        s = self.settings
        if s.warm_kernels:
            kernels.warm_up()  # before serving: nothing waits on the loop yet
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s,
                                          sock_connect=s.connect_timeout_s),
        )
        if s.lean_upstream:
            self.upstream = UpstreamPool(s.connect_timeout_s, s.request_timeout_s,
                                         s.upstream_keepalive_s)
        for rt in self.models.values():
            rt.on_join = self._on_join(rt)
            await rt.start()
        if self.catalog_watch is not None:
            await self.catalog_watch.start(self._on_documents)
        await self.peer_sync.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()),
                       loop.create_task(self._scrape_loop())]
        if s.gc_freeze:  # what lives now lives for good: full collections skip it
            gc.collect()
            gc.freeze()
        self._started = True

    async def _on_cleanup(self, _app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.catalog_watch is not None:
            await self.catalog_watch.stop()
        await self.peer_sync.stop()
        for task in [self._reconciler, *self._background]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for rt in list(self.models.values()):
            await rt.close()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            self.upstream.close()
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
            if not any(i.routable for i in rt.instances(role))
        ]
        if self.catalog_watch is not None:
            # serving many clusters: ready once the ConfigMaps were listed. A model without
            # routable instances (a cluster being created or scaled to zero) is listed in
            # `missing` and answers 503 itself; it must not take the Service away from the
            # models that can serve
            listed = self._documents is not None
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
            rt.publish_gauges()
            now = rt.now()
            rt.drain(now)
            for inst in rt.prefill:
                if not inst.listed:
                    continue  # left: not exported
                self.metrics.instance_queue_s.labels(name, inst.name).set(
                    rt.cluster.prefill[inst.iid].wait_time(now))
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, _r: web.Request) -> web.Response:
        return web.json_response(openapi_spec(list(self.models)))

    def _model_param(self, request: web.Request) -> list[ModelRuntime]:
        name = request.query.get("model")
        if name is None:
            return list(self.models.values())
        if name not in self.models:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return [self.models[name]]

    async def conductor_state(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [rt.state() for rt in self._model_param(request)]})

    async def hot_prefixes(self, request: web.Request) -> web.Response:
        limit = _int_query(request, "limit", self.settings.hot_prefixes_max)
        with_tokens = _bool_query(request, "tokens")
        out: list[dict[str, Any]] = []
        for rt in self._model_param(request):
            out.extend(rt.hot_prefixes(limit, with_tokens))
        out.sort(key=lambda h: -float(h["rate_per_s"]))
        return web.json_response(out[:limit])

    async def registry(self, request: web.Request) -> web.Response:
        chunk = self.settings.registry_chunk_keys
        return web.json_response(
            {"models": [await rt.registry(chunk) for rt in self._model_param(request)]})

    async def model_catalog(self, _r: web.Request) -> web.Response:
        km = self.settings.kubernetes_models
        cat = self.catalog
        return web.json_response({
            "kubernetes_models": None if km is None else {
                "namespace": km.namespace, "label_selector": km.label_selector,
                "key": km.key, "listed": self._documents is not None,
                "documents": len(self._documents or [])},
            "models": [{"model": name, "source": rt.source}
                       for name, rt in sorted(self.models.items())],
            "invalid": [{"source": src, "error": err}
                        for src, err in sorted(cat.invalid.items())],
            "conflicts": [{"source": c.source, "model": c.model, "winner": c.winner}
                          for c in cat.conflicts],
        })

    async def decisions(self, request: web.Request) -> web.Response:
        limit = _int_query(request, "limit", DECISIONS_DEFAULT_LIMIT)
        out: list[dict[str, Any]] = []
        for rt in self._model_param(request):
            out.extend(rt.decisions)
        out.sort(key=lambda d: float(d["time"]))
        return web.json_response(out[-limit:] if limit else [])

    # -- models from ConfigMaps -------------------------------------------------------------
    def _on_documents(self, docs: list[ModelDocument]) -> None:
        """The ConfigMap watch's latest list (on the loop): reconciled by one task, which
        picks up whatever came while it worked."""
        self._documents = docs
        self._documents_dirty = True
        if self._reconciler is None or self._reconciler.done():
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile())

    async def _reconcile(self) -> None:
        while self._documents_dirty:
            self._documents_dirty = False
            assert self.catalog_watch is not None and self._documents is not None
            reserved = [n for n, rt in self.models.items() if rt.source is None]
            cat = resolve(self._documents, self.catalog_watch.cfg.key, reserved)
            try:
                await self._apply_catalog(cat)
            except asyncio.CancelledError:
                raise
            except Exception:  # a model that cannot start must not stop the others
                log.exception("applying the model ConfigMaps failed")

    async def _apply_catalog(self, cat: Catalog) -> None:
        self.catalog = cat  # what is invalid or in conflict shows at once
        for name, rt in list(self.models.items()):
            if rt.source is None:
                continue  # the gateway's own settings
            want = cat.served.get(name)
            if want is None:
                log.info("model %s (%s) is no longer served", name, rt.source)
                await rt.close()  # its series go before /v1/models stops listing it
                del self.models[name]
                continue
            source, cfg = want
            if cfg == rt.cfg or rt.can_swap(cfg):
                rt.source = source
                if cfg != rt.cfg:
                    log.info("model %s (%s): new Conductor settings", name, source)
                    rt.reconfigure(cfg)
                continue
            log.info("model %s (%s) changed: a new runtime takes over", name, source)
            new = await self._start_model(cfg, source, cat)
            if new is None:
                del self.models[name]
            else:
                await new.wait_settled(self.settings.model_swap_timeout_s)
                self.models[name] = new
            await rt.close(keep=new)
        for name, (source, cfg) in cat.served.items():
            if name not in self.models:
                log.info("model %s (%s) served", name, source)
                new = await self._start_model(cfg, source, cat)
                if new is not None:
                    self.models[name] = new
        for source, err in cat.invalid.items():
            if self._errors_counted.get(source) != err:
                log.warning("model ConfigMap %s is invalid: %s", source, err)
                self.metrics.model_document_errors.labels(source).inc()
        self._errors_counted = dict(cat.invalid)
        for c in set(cat.conflicts) - set(self._conflicts_logged):
            log.warning("model ConfigMap %s names model %s, already served from %s",
                        c.source, c.model, c.winner)
        self._conflicts_logged = list(cat.conflicts)
        served = sum(1 for rt in self.models.values() if rt.source is not None)
        for state, count in (("served", served), ("invalid", len(cat.invalid)),
                             ("conflict", len(cat.conflicts))):
            self.metrics.model_documents.labels(state).set(count)

    async def _start_model(self, cfg: ModelSettings, source: str,
                           cat: Catalog) -> ModelRuntime | None:
        """A runtime for ``cfg`` with its endpoint source started (``None``, and the
        ConfigMap reported invalid, when the source cannot start)."""
        rt = ModelRuntime(cfg, self.settings, self.metrics, source)
        rt.on_join = self._on_join(rt)
        try:
            await rt.start()
        except Exception as exc:
            log.exception("model %s (%s): its endpoint source failed", cfg.name, source)
            await rt.close()
            cat.invalid[source] = f"endpoint source failed: {type(exc).__name__}: {exc}"
            del cat.served[cfg.name]
            return None
        return rt

    def _on_join(self, rt: ModelRuntime) -> Callable[[Instance], None]:
        """Check a joining instance's health at once (it registers after one pass)."""
        def join(inst: Instance) -> None:
            if self.session is None:
                return  # not started: the health loop's first round checks it
            task = asyncio.get_running_loop().create_task(self._check(rt, inst))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return join

    # -- background: health and engine metrics ---------------------------------------------
    def _all_instances(self) -> list[tuple[ModelRuntime, Instance]]:
        return [(rt, i) for rt in self.models.values() for role in Role
                for i in rt.instances(role) if i.listed]

    def _by_engine(self, healthy_only: bool = False
                   ) -> dict[str, list[tuple[ModelRuntime, Instance]]]:
        """The listed instances by engine URL: an engine that serves as a prefill and a
        decode instance (or for several models) is checked and scraped once a round."""
        out: dict[str, list[tuple[ModelRuntime, Instance]]] = {}
        for rt, inst in self._all_instances():
            if inst.healthy or not healthy_only:
                out.setdefault(inst.endpoint.url, []).append((rt, inst))
        return out

    async def _health_loop(self) -> None:
        s = self.settings
        while True:
            await asyncio.gather(*(self._check_all(url, insts)
                                   for url, insts in self._by_engine().items()))
            await asyncio.sleep(s.health_interval_s)

    async def _check_all(self, url: str, insts: list[tuple[ModelRuntime, Instance]]) -> None:
        ok = await self._healthy(url)
        for rt, inst in insts:
            rt.mark_health(inst, ok)

    async def _check(self, rt: ModelRuntime, inst: Instance) -> None:
        rt.mark_health(inst, await self._healthy(inst.endpoint.url))

    async def _healthy(self, url: str) -> bool:
        """Whether the engine at ``url`` answers ``/health`` with 200 in time."""
        timeout = self.settings.health_timeout_s
        if self.upstream is not None and self.upstream.supports(url):
            try:
                status, _ = await self.upstream.get(url, "/health", timeout)
            except UpstreamCallError:
                return False
            return status == 200
        assert self.session is not None
        with contextlib.suppress(Exception):
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        return False

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(url, insts) for url, insts
                                   in self._by_engine(healthy_only=True).items()))
            await asyncio.sleep(self.settings.metrics_interval_s)

    async def _scrape(self, url: str, insts: list[tuple[ModelRuntime, Instance]]) -> None:
        """One ``/metrics`` page of the engine at ``url``, applied to its ``insts``."""
        timeout = self.settings.health_timeout_s
        try:
            if self.upstream is not None and self.upstream.supports(url):
                status, raw = await self.upstream.get(url, "/metrics", timeout)
                if status != 200:
                    return
                text = raw.decode("utf-8", "replace")
            else:
                assert self.session is not None
                async with self.session.get(
                    url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    if resp.status != 200:
                        return
                    text = await resp.text()
        except Exception:
            return
        stats = parse_engine_metrics(text)
        for rt, inst in insts:
            rt.apply_stats(inst, stats)

    # -- tokenization ----------------------------------------------------------------------
    async def _remote_tokenize(self, body: dict[str, Any]) -> list[int]:
        assert self.session is not None
        for rt in self.models.values():
            for inst in rt.prefill + rt.decode:
                if not inst.routable:
                    continue
                try:
                    async with self.session.post(inst.endpoint.url + "/tokenize", json=body) as r:
                        data = await r.json(content_type=None)
                        if r.status == 200 and isinstance(data, dict):
                            toks = data.get("tokens")
                            if isinstance(toks, list):
                                return [int(t) for t in toks]
                        if 400 <= r.status < 500:
                            err = data.get("error") if isinstance(data, dict) else None
                            if not isinstance(err, dict):  # not OpenAI's shape
                                err = {}
                            raise ApiError(r.status, str(err.get("message") or "bad prompt"),
                                           err.get("param"), err.get("code"))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
        raise ApiError(503, "no engine could tokenize the prompt", code="no_tokenizer")

    async def _tokens(self, p: Parsed) -> Tokens:
        if p.prompt_ids is not None:
            return p.prompt_ids
        if p.prompt_text is not None:
            return await self.tokenizer.prompt(p.prompt_text)
        assert p.messages is not None
        return await self.tokenizer.chat(p.messages)

    # -- the OpenAI endpoints --------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        explain = request.headers.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes")
        resp = await self._answer(chat, time.perf_counter(), explain, request=request,
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
            resp = await self._answer(chat, time.perf_counter(), False, raw=raw,
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

    async def _answer(self, chat: bool, arrived: float, explain: bool,
                      request: web.Request | None = None, raw: bytes | None = None,
                      principal: Principal | None = None) -> Answer | None:
        """One completion request from ``request`` (aiohttp) or ``raw`` (the fast front end;
        ``None`` is returned for a streamed one), run as ``principal`` (``None``: no keys
        configured)."""
        endpoint = "chat" if chat else "completions"
        model = UNKNOWN_MODEL  # label for requests that name no served model
        outcome: str | None = "error"
        try:
            try:
                if raw is None:
                    assert request is not None
                    raw = await request.read()
                data = fastjson.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}") from None
            default = next(iter(self.models)) if len(self.models) == 1 else None
            p = parse_request(data, chat, default)
            if request is None and p.stream:
                outcome = None  # served (and counted) through aiohttp
                return None
            p.raw = raw
            rt = self.models.get(p.model)
            if rt is None:
                raise ApiError(404, f"The model `{p.model}` does not exist.", "model",
                               "model_not_found")
            model = p.model
            self.limits.request(principal)
            resp = await self._route(request, rt, data, p, arrived, explain, principal)
            outcome = "ok"
            return resp
        except LimitExceeded as exc:
            outcome = "limited"  # the key's budget, not the cluster: no SLO miss
            self.metrics.key_limited.labels(exc.code or "limit").inc()
            raise
        except ApiError as exc:
            outcome = OUTCOME_BY_STATUS.get(exc.status, "error")
            if model in self.models and (exc.status == 429 or exc.status >= 500):
                self.models[model].slo.missed()
            raise
        except web.HTTPException as exc:
            outcome = OUTCOME_BY_STATUS.get(exc.status, "error")
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if outcome is not None:
                self.request_counter.inc(model, endpoint, outcome)

    async def _route(self, request: web.Request | None, rt: ModelRuntime,
                     data: dict[str, Any], p: Parsed, arrived: float,
                     explain: bool, principal: Principal | None) -> Answer:
        cfg = rt.cfg
        tokens = await self._tokens(p)
        if len(tokens) == 0:
            raise ApiError(400, "the prompt is empty", "messages" if p.chat else "prompt")
        max_tokens = p.max_tokens or cfg.default_max_tokens
        if len(tokens) + max_tokens > cfg.max_model_len:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the context window ({cfg.max_model_len})",
                           "max_tokens", "context_length_exceeded")
        self.limits.tokens(principal, len(tokens) + max_tokens)
        t0 = time.perf_counter()
        key_array = block_keys_array(tokens, cfg.block_size, rt.seed)
        req = rt.request_info(len(tokens), key_array, max_tokens)
        decision, record = self._decide(rt, req, tokens, explain, t0)
        if decision.rejected:
            decision, record = await self._hold(rt, req, tokens, explain, decision, record)
        if decision.rejected:
            reason = decision.reject_reason or "rejected"
            self.metrics.rejections.labels(cfg.name, reason).inc()
            raise ApiError(429, f"request rejected by the scheduler ({reason}); retry later",
                           code=reason.replace("-", "_"),
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        try:  # the policy's own count of outstanding requests is released however it ends
            pl = decision.placement
            assert pl.prefill is not None
            # what the chosen instance holds now (pending prefixes and fetches not counted: the
            # engines cannot pull blocks from a peer, so the gateway runs a fetch as a recompute)
            held = rt.index.match(pl.prefill, req.keys)
            reused = req.tokens_of(held)
            # the direct rule: what the chosen decode engine would compute itself
            dec = decision.decode.decode
            dec_held = rt.decode_index.match(dec, req.keys) if dec is not None else 0
            direct = len(tokens) - req.tokens_of(dec_held) < cfg.direct.uncached_tokens_below
            record["direct"] = direct
            record["held_blocks"] = held
            record["decode_held_blocks"] = dec_held
            rt.prompt_tokens += len(tokens)
            if not direct:
                rt.reused_tokens += reused
                rt.prefill_seconds += pl.gpu_seconds
                rt.m.prompt_reused.inc(reused)
                rt.m.prompt_computed.inc(len(tokens) - reused)
            else:
                rt.m.prompt_computed.inc(len(tokens))
            headers = {DECISION_HEADER: json.dumps(_header_view(record), separators=(",", ":"))} \
                if explain else {}
            fields: dict[str, Any] = {}
            group: int | None = None  # the engine group both halves of a P/D request share
            if direct:  # the decode engine prefills itself: in its batch from now on
                rt.conductor.decoding(req, decision)
            else:
                assert dec is not None
                group = rt.cluster.decode[dec].group
                hs = handshake(cfg.handshake)
                transfer = Transfer.new(rt.prefill[pl.prefill].endpoint, cfg.bootstrap_port)
                if hs.concurrent:
                    return await self._prefill_with_decode(
                        request, rt, req, decision, data, p, record, headers, arrived,
                        explain, group, hs, transfer)
                transfer = await self._prefill_tracked(rt, req, decision, data, p, record,
                                                       group, hs, transfer)
                fields = hs.decode_fields(transfer)
            return await self._decode(request, rt, req, decision, data, p, fields, record,
                                      headers, arrived, explain, group)
        finally:
            rt.conductor.finished(req, decision)

    async def _hold(self, rt: ModelRuntime, req: RequestInfo, tokens: Tokens, explain: bool,
                    decision: Decision, record: dict[str, Any]
                    ) -> tuple[Decision, dict[str, Any]]:
        """Holding (``mooncake_conductor.holding``): while the Conductor says a request
        refused for decode room may wait, wait for a decode request to end and decide
        again (admission counts the wait); the last decision when the hold ends."""
        held = False
        while decision.rejected:
            now = rt.now()
            until = rt.conductor.hold_until(req, decision, now)
            if until is None:
                break
            held = True
            if not await rt.wait_decode_room((until - now) * rt.time_scale):
                break  # the deadline passed: the refusal stands
            decision, record = self._decide(rt, req, tokens, explain, time.perf_counter(),
                                            rt.now())
        if held:
            self.metrics.held.labels(rt.cfg.name,
                                     "rejected" if decision.rejected else "placed").inc()
        return decision, record

    def _decide(self, rt: ModelRuntime, req: RequestInfo, tokens: Tokens, explain: bool,
                t0: float, now: float | None = None) -> tuple[Decision, dict[str, Any]]:
        """The Conductor's decision for ``req`` at ``now`` (default: its arrival)."""
        if now is None:
            now = req.arrival
        rt.drain(now)
        hot = rt.hot_tokens
        hot.prompt = tokens  # a prefix that gets hot by this request keeps its tokens
        try:
            decision = rt.conductor.schedule(req, rt.cluster, now)
        finally:
            hot.prompt = None
        took = time.perf_counter() - t0
        rt.m.decision.observe(took)
        pl, dc = decision.placement, decision.decode
        record: dict[str, Any] = {
            "id": req.rid, "time": time.time(), "model": rt.cfg.name,
            "policy": rt.cfg.conductor.policy, "prompt_tokens": req.input_tokens,
            "blocks": len(req.keys),
            "prefill": rt.prefill[pl.prefill].name if pl.prefill is not None else None,
            "decode": rt.decode[dc.decode].name if dc.decode is not None else None,
            "local_blocks": pl.local_blocks, "fetch_blocks": pl.fetch_blocks,
            "source": _source_name(rt, pl.source),
            "predicted": {"queue_s": pl.queue_s, "transfer_s": pl.transfer_s,
                          "prefill_s": pl.prefill_s, "ttft_s": pl.ttft_s,
                          "tbt_s": dc.predicted_tbt_s},
            "reject_reason": decision.reject_reason, "decision_us": took * MICRO,
            "attempts": [],
        }
        if explain:
            record["candidates"] = self._candidates(rt, req, now)
        rt.decisions.append(record)
        return decision, record

    def _candidates(self, rt: ModelRuntime, req: RequestInfo, now: float) -> list[dict[str, Any]]:
        """Every routable prefill instance's predicted TTFT parts, best first."""
        cost = rt.cost
        matched = rt.index.match_all(req.keys, rt.cluster.prefill_mask, include_pending=True)
        out: list[dict[str, Any]] = []
        for ps in rt.cluster.prefill:
            if not ps.up:
                continue
            local = matched.get(ps.iid, 0)
            cached = req.tokens_of(local)
            queue = ps.wait_time(now)
            prefill = cost.prefill_time(req.input_tokens, cached)
            out.append({"instance": rt.prefill[ps.iid].name, "matched_blocks": local,
                        "cached_tokens": cached, "queue_s": queue, "prefill_s": prefill,
                        "ttft_s": queue + prefill})
        out.sort(key=lambda c: float(c["ttft_s"]))
        return out[: self.settings.explain_top]

    # -- prefill ---------------------------------------------------------------------------
    async def _prefill_tracked(self, rt: ModelRuntime, req: RequestInfo, decision: Decision,
                               data: dict[str, Any], p: Parsed, record: dict[str, Any],
                               group: int, hs: Handshake, transfer: Transfer,
                               attempts: int | None = None) -> Transfer:
        """:meth:`_prefill`, with the request counted in flight on its decode instance
        meanwhile (a draining decode pod is not retired under it), and the policy told
        when it ends."""
        dec = decision.decode.decode
        assert dec is not None  # a disaggregated decision names its decode instance
        chosen = rt.decode[dec]
        chosen.inflight += 1
        try:
            return await self._prefill(rt, req, decision, data, p, record, group, hs,
                                       transfer, attempts)
        finally:
            chosen.inflight -= 1
            rt.conductor.prefilled(req, decision)

    async def _prefill_with_decode(self, request: web.Request | None, rt: ModelRuntime,
                                   req: RequestInfo, decision: Decision, data: dict[str, Any],
                                   p: Parsed, record: dict[str, Any], headers: dict[str, str],
                                   arrived: float, explain: bool, group: int, hs: Handshake,
                                   transfer: Transfer) -> Answer:
        """Both halves at once (the prefill engine waits for the decode engine to connect):
        one attempt each, since the decode engine is told which prefill engine to meet. A
        failed prefill cancels the decode and answers with the prefill's error."""
        prefill = asyncio.create_task(self._prefill_tracked(
            rt, req, decision, data, p, record, group, hs, transfer, attempts=1))
        decode = asyncio.create_task(self._decode(
            request, rt, req, decision, data, p, hs.decode_fields(transfer), record, headers,
            arrived, explain, group, attempts=1))
        try:
            done, _ = await asyncio.wait({prefill, decode},
                                         return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and prefill.exception() is not None:
                decode.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await decode
                prefill.result()  # raises the prefill's error
            return await decode
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _prefill(self, rt: ModelRuntime, req: RequestInfo, decision: Decision,
                       data: dict[str, Any], p: Parsed, record: dict[str, Any],
                       group: int, hs: Handshake, transfer: Transfer,
                       attempts: int | None = None) -> Transfer:
        """Prefill on the chosen instance, then on the next best of ``group`` (the decode
        instance's) while attempts are left; the transfer as the instance that served it
        made it."""
        overrides: dict[str, Any] = {"stream": False, "stream_options": None, "max_tokens": 1}
        if p.chat:
            overrides["max_completion_tokens"] = None
        path = "/v1/chat/completions" if p.chat else "/v1/completions"
        tried: set[int] = set()
        pl = decision.placement
        last = "no prefill instance"
        for attempt in range(attempts or self.settings.prefill_attempts):
            if attempt:
                rt.m.retries_prefill.inc()
                pl = self._replace_prefill(rt, req, tried, group)
                if pl is None:
                    break
            assert pl.prefill is not None
            inst = rt.prefill[pl.prefill]
            tried.add(inst.iid)
            prio = pl.priority if pl.priority is not None else req.arrival
            # only the decision's own placement is in the policy's books, so only it can
            # move (a retry's stays where it is sent)
            rt.prefill_started(inst, req, pl.prefill_s + pl.transfer_s, prio,
                               pl if attempt == 0 else None)
            started = time.perf_counter()
            status = 0
            try:
                queued = await rt.prefill_turn(req)  # late binding: its turn, maybe elsewhere
                if queued.iid != inst.iid and queued.placement is not None:
                    record["attempts"].append({"prefill": inst.name, "stolen_by":
                                               rt.prefill[queued.iid].name})
                    inst, pl = rt.prefill[queued.iid], queued.placement
                    tried.add(inst.iid)
                    decision.placement = pl  # the policy's books moved with it
                    record["prefill"] = inst.name
                    started = time.perf_counter()  # predicted from the move on
                transfer = transfer.with_prefill(inst.endpoint)
                body = splice_json(p.raw, data, {**overrides, **hs.prefill_fields(transfer)})
                status, resp = await self._unless_down(inst, self._post_json(inst, path, body))
            except UpstreamError as exc:
                last = f"{inst.name}: {exc}"
                record["attempts"].append({"prefill": inst.name, "error": str(exc)})
                rt.mark_health(inst, False)
                continue
            finally:
                ok = status == 200
                rt.prefill_done(inst, req, (time.perf_counter() - started) / rt.time_scale,
                                pl.ttft_s if ok else None)
            record["attempts"].append({"prefill": inst.name, "status": status})
            if status == 200 and isinstance(resp, dict):
                usage = resp.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                prompt = usage.get("prompt_tokens") or req.input_tokens
                rt.engine_cached_tokens += int(cached)
                rt.engine_prompt_tokens += int(prompt)
                rt.m.engine_cached_tokens.inc(int(cached))
                rt.m.engine_prompt_tokens.inc(int(prompt))
                record["engine_cached_tokens"] = int(cached)
                return transfer
            if status in UPSTREAM_RETRY_STATUSES:
                last = f"{inst.name}: HTTP {status}"
                continue
            raise _relayed_error(status, resp)
        raise ApiError(502, f"prefill failed on every instance tried ({last})",
                       code="upstream_failed")

    def _replace_prefill(self, rt: ModelRuntime, req: RequestInfo, excluded: set[int],
                         group: int) -> Any:
        """The next-best placement with the ``excluded`` instances and those of other
        groups than ``group`` out of consideration."""
        states = [s for s in rt.cluster.prefill
                  if s.up and (s.iid in excluded or s.group != group)]
        for s in states:
            s.up = False
        try:
            d = rt.conductor.policy.choose(req, rt.cluster, rt.now())
        finally:
            for s in states:
                s.up = True
        return d if d.prefill is not None else None

    @staticmethod
    async def _unless_down(inst: Instance, call: Awaitable[T]) -> T:
        """``call``'s result, unless ``inst`` is marked down first (failed health checks):
        then the call is abandoned with :class:`UpstreamError`, so a prefill on an engine
        that accepts connections and never answers is retried elsewhere within the health
        checks' few seconds, not after ``request_timeout_s``. Nothing has reached the
        client at that point, so the retry is safe."""
        task = asyncio.ensure_future(call)
        down = inst.went_down()
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, UpstreamError):
            await task
        raise UpstreamError("marked down while the call waited")

    async def _post_json(self, inst: Instance, path: str, body: bytes) -> tuple[int, Any]:
        status, parsed, _raw = await self._post(inst, path, body)
        return status, parsed

    async def _post(self, inst: Instance, path: str, body: bytes,
                    parse: bool = True) -> tuple[int, Any, bytes]:
        """POST ``body``; the status, the parsed JSON (``None`` when not asked or not JSON)
        and the raw answer."""
        url = inst.endpoint.url
        if self.upstream is not None and self.upstream.supports(url):
            try:
                status, raw = await self.upstream.post(url, path, body)
            except UpstreamCallError as exc:
                raise UpstreamError(str(exc)) from exc
        else:
            assert self.session is not None
            try:
                async with self.session.post(url + path, data=body,
                                             headers=JSON_HEADERS) as resp:
                    status = resp.status
                    raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                raise UpstreamError(type(exc).__name__) from exc
        parsed = None
        if parse or status != 200:
            with contextlib.suppress(ValueError):
                parsed = fastjson.loads(raw) if raw else None
        return status, parsed, raw

    # -- decode ----------------------------------------------------------------------------
    async def _decode(self, request: web.Request | None, rt: ModelRuntime, req: RequestInfo,
                      decision: Decision, data: dict[str, Any], p: Parsed,
                      fields: dict[str, Any], record: dict[str, Any],
                      headers: dict[str, str], arrived: float,
                      explain: bool, group: int | None,
                      attempts: int = DECODE_ATTEMPTS) -> Answer:
        """The decode half, with the handshake's ``fields`` spliced into the body."""
        assert self.session is not None
        body = splice_json(p.raw, data, fields) if fields else p.raw
        path = "/v1/chat/completions" if p.chat else "/v1/completions"
        iid = decision.decode.decode
        tried: set[int] = set()
        last = "no decode instance"
        for attempt in range(attempts):
            if attempt:
                rt.m.retries_decode.inc()
                iid = self._replace_decode(rt, tried, group)
            if iid is None:
                break
            inst = rt.decode[iid]
            tried.add(iid)
            record["decode"] = inst.name
            rt.decode_started(inst, req)
            try:
                resp: Answer
                if p.stream:
                    assert request is not None  # the fast front end hands streams to aiohttp
                    # the TBT the decode selector predicted, for its own choice only
                    predicted = (decision.decode.predicted_tbt_s
                                 if iid == decision.decode.decode else 0.0)
                    resp = await self._stream(request, rt, inst, path, body, headers, arrived,
                                              predicted)
                else:
                    resp = await self._unary(rt, inst, path, body, headers, record, explain,
                                             plain=request is None)
                    rt.slo.served(time.perf_counter() - arrived, None)
                record["outcome"] = "ok"
                return resp
            except UpstreamError as exc:
                last = f"{inst.name}: {exc}"
                record["attempts"].append({"decode": inst.name, "error": str(exc)})
                if not str(exc).startswith("HTTP"):
                    rt.mark_health(inst, False)
            finally:
                rt.decode_done(inst, req)
        raise ApiError(502, f"decode failed ({last})", code="upstream_failed")

    def _replace_decode(self, rt: ModelRuntime, excluded: set[int],
                        group: int | None) -> int | None:
        """The least loaded other decode instance (of ``group`` after a prefill: the KV
        came from an engine of that revision)."""
        live = [d for d in rt.cluster.decode if d.up and d.iid not in excluded
                and (group is None or d.group == group)]
        if not live:
            return None
        return min(live, key=lambda d: (d.batch + d.waiting, d.iid)).iid

    async def _unary(self, rt: ModelRuntime, inst: Instance, path: str, body: bytes,
                     headers: dict[str, str], record: dict[str, Any],
                     explain: bool, plain: bool = False) -> web.Response | PlainJson:
        """A non-streamed decode; ``plain``: for the fast front end (:class:`PlainJson`
        when the answer needs no header of its own)."""
        status, resp, raw = await self._post(inst, path, body, parse=explain)
        if status in UPSTREAM_RETRY_STATUSES:
            raise UpstreamError(f"HTTP {status}")
        if status != 200:
            raise _relayed_error(status, resp)
        if not explain:  # the decode answer goes back as it came
            if plain and not headers:
                return PlainJson(raw)
            return web.Response(body=raw, content_type="application/json", headers=headers)
        if not isinstance(resp, dict):
            raise UpstreamError("answer is not a JSON object")
        resp["conductor"] = record
        return web.Response(text=json.dumps(resp), content_type="application/json",
                            headers=headers)

    async def _stream(self, request: web.Request, rt: ModelRuntime, inst: Instance, path: str,
                      body: bytes, headers: dict[str, str],
                      arrived: float, predicted_tbt_s: float = 0.0) -> web.StreamResponse:
        assert self.session is not None
        try:
            upstream = await self.session.post(inst.endpoint.url + path, data=body,
                                               headers=JSON_HEADERS)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise UpstreamError(type(exc).__name__) from exc
        async with upstream:
            if upstream.status in UPSTREAM_RETRY_STATUSES:
                raise UpstreamError(f"HTTP {upstream.status}")
            if upstream.status != 200:
                raw = await upstream.read()
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = None
                raise _relayed_error(upstream.status, parsed)
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
            await resp.prepare(request)
            first: float | None = None
            last_at = 0.0
            intervals: list[float] = []
            done = False
            buf = b""
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    buf += chunk
                    events, buf = _split_events(buf)
                    now = time.perf_counter()
                    for ev in events:
                        if ev.startswith(SSE_DONE):
                            done = True
                        elif first is None:
                            if _has_token(ev):
                                first = last_at = now
                                rt.m.ttft.observe(now - arrived)
                        else:
                            rt.m.tbt.observe(now - last_at)
                            intervals.append(now - last_at)
                            last_at = now
                if not done:
                    raise UpstreamError("stream ended early")
            except ConnectionResetError:  # the client went away; closing upstream aborts it
                return resp
            except (aiohttp.ClientError, TimeoutError, UpstreamError) as exc:
                err = error_body(502, f"decode failed mid-stream on {inst.name}: "
                                 f"{type(exc).__name__}", code="upstream_failed")
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    await resp.write_eof()
                rt.mark_health(inst, False)
                rt.slo.missed()
                return resp
            await resp.write_eof()
            if first is not None:
                rt.slo.served(first - arrived, intervals)
                rt.decode_observed(predicted_tbt_s, intervals)
            return resp


def splice_json(raw: bytes, data: dict[str, Any], overrides: dict[str, Any]) -> bytes:
    """The client's JSON object with ``overrides`` appended as later duplicate keys (JSON
    parsers keep the last): a long token-id prompt is forwarded without re-encoding it."""
    body = raw.rstrip()
    if data and body.endswith(b"}"):
        extra = json.dumps(overrides, separators=(",", ":")).encode()
        return body[:-1] + b"," + extra[1:]
    return json.dumps({**data, **overrides}).encode()


def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    parts = buf.split(b"\n\n")
    return [p.strip() for p in parts[:-1] if p.strip()], parts[-1]


def _has_token(event: bytes) -> bool:
    """Whether an SSE event carries generated text (not the chat role-only first chunk)."""
    if not event.startswith(b"data:"):
        return False
    try:
        obj = json.loads(event[5:])
    except ValueError:
        return False
    for c in obj.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


def _relayed_error(status: int, resp: Any) -> ApiError:
    """An engine's own 4xx (bad input the gateway did not catch), passed on."""
    err = resp.get("error") if isinstance(resp, dict) else None
    if not isinstance(err, dict):
        err = {}
    out = status if 400 <= status < 500 else 502
    return ApiError(out, str(err.get("message") or f"engine answered HTTP {status}"),
                    err.get("param"), err.get("code"))


def _source_name(rt: ModelRuntime, source: int | None) -> str | None:
    if source is None:
        return None
    if source < len(rt.prefill):
        return rt.prefill[source].name
    return f"instance-{source}"


def _header_view(record: dict[str, Any]) -> dict[str, Any]:
    keep = ("id", "policy", "prefill", "decode", "local_blocks", "fetch_blocks", "predicted",
            "decision_us", "candidates", "direct")
    return {k: _finite(record[k]) for k in keep if k in record}


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _bool_query(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "").lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ApiError(400, f"'{name}' must be 1/true/yes or 0/false/no", name)


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ApiError(400, f"'{name}' must be an integer", name) from None
    if v < 0:
        raise ApiError(400, f"'{name}' must not be negative", name)
    return v


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
             "lean" if gw.upstream is not None else "aiohttp",
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
