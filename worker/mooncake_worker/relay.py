"""Relay mode: the worker in front of a real engine (vLLM, SGLang) instead of its simulated one.

``--engine-url URL --engine-kv-events tcp://... [--engine-kv-replay tcp://...]``:

- HTTP: every route except ``/metrics``, ``/agent/state`` and ``/livez`` (the relay's own
  liveness: the kubelet restarts a relay that hangs, not one whose engine still loads) is
  reverse-proxied to the engine unchanged (bodies, status codes, headers such as
  ``Retry-After``, SSE streams chunk by chunk). An unreachable engine gives an
  OpenAI-style 502.
- KV events: a :class:`KVEventSubscriber` reads the engine's stream (recovering gaps
  through its replay socket) and every payload is re-published *unchanged* on the pod's
  own PUB socket, renumbered into the relay's sequence (with its own replay buffer), so
  consumers see one gap-free stream even across engine restarts; a restart — the
  engine's sequence going back — is announced with an ``AllBlocksCleared``).
- Metrics: ``/metrics`` is the engine's exposition unchanged followed by the relay's own
  series (``mooncake_worker:*``).
- Cache view: from each ``BlockStored``'s ``token_ids`` the relay computes the Conductor's
  block keys (the chain of :mod:`mooncake_conductor.blockkeys`, continued from the
  parent's chain state) and keeps engine hash → key, so the agent can tell which of its
  prefixes the engine holds without reproducing the engine's hash function.
- Agent: warming a prefix sends the engine a ``max_tokens=1`` completion with the
  prefix's token ids (the engine's own connector loads from Mooncake Store when it has
  the blocks). A real engine cannot pin blocks, so listed prefixes whose blocks the
  events show evicted are warmed again (at most every ``agent_rewarm_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from mooncake_conductor.blockkeys import MASK64, P, mix64, namespace_seed
from mooncake_contract.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    hash_to_int,
)
from mooncake_contract.kvevents.subscriber import KVEventSubscriber
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .agent import AgentBase, Replica
from .api import LIVENESS_PATH, ApiError
from .kvevents.publisher import KVEventPublisher
from .settings import WorkerSettings

log = logging.getLogger(__name__)
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
        "upgrade", "proxy-connection", "te", "trailer"}


#: SGLang's own stand-in bootstrap host: a disaggregated SGLang engine refuses a request
#: without a bootstrap room, and sends this one's KV nowhere (its health check does the
#: same). SGLang 0.5.23 ``disaggregation/utils.py``; held to it by ``tests/conformance``.
SGLANG_FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def warm_body(engine_kind: str, model: str, tokens: list[int]) -> dict[str, Any]:
    """A one-token completion of ``tokens``, which leaves their KV in the engine's cache."""
    body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1}
    if engine_kind == "sglang":
        body.update(bootstrap_host=SGLANG_FAKE_BOOTSTRAP_HOST, bootstrap_room=0)
    return body


class CacheView:
    """What the engine holds, in the Conductor's block keys, learned from its events."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.state: dict[int, tuple[int, int]] = {}  # engine hash -> (chain state, our key)
        self.keys: dict[int, int] = {}  # our key -> engine hash
        self.unmapped = 0

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    got = self.state.pop(hash_to_int(h), None)
                    if got is not None:
                        self.keys.pop(got[1], None)
            elif isinstance(ev, AllBlocksCleared):
                self.state.clear()
                self.keys.clear()

    def _stored(self, ev: BlockStored) -> None:
        bs = ev.block_size
        if ev.parent_block_hash is None:
            h = self.seed & MASK64
        else:
            parent = self.state.get(hash_to_int(ev.parent_block_hash))
            if parent is None:  # we never saw the parent: cannot continue the chain
                self.unmapped += len(ev.block_hashes)
                return
            h = parent[0]
        toks = ev.token_ids
        for i, eh in enumerate(ev.block_hashes):
            for t in toks[i * bs : (i + 1) * bs]:
                h = (h * P + int(t) + 1) & MASK64
            key = mix64(h)
            self.state[hash_to_int(eh)] = (h, key)
            self.keys[key] = hash_to_int(eh)

    def match(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


class RelayAgent(AgentBase):
    def __init__(self, relay: EngineRelay, path: str, poll_s: float) -> None:
        super().__init__(path, poll_s)
        self.relay = relay
        self.block_size = relay.settings.block_size

    def keys_of(self, tokens: list[int]) -> list[int]:
        from mooncake_conductor.blockkeys import block_keys

        return block_keys(tokens, self.block_size, self.relay.view.seed)

    def held(self, r: Replica) -> int:
        return self.relay.view.match(r.keys)

    async def _warm(self, r: Replica) -> None:
        r.state = "warming"
        if r.spec.tokens is None:
            r.state, r.error = "failed", "relay mode needs 'tokens' to warm a prefix"
            return
        prompt = r.spec.tokens[: len(r.keys) * self.block_size]
        try:
            await self.relay.warm(prompt)
        except (aiohttp.ClientError, TimeoutError, ApiError) as exc:
            r.state, r.error = "failed", f"engine refused the warm-up: {exc}"
            return
        r.warmed_at = time.monotonic()
        r.source = "engine"
        r.error = None
        # the engine's events arrive asynchronously; 'ready' once they show the blocks
        deadline = time.monotonic() + self.relay.settings.agent_event_wait_s
        while self.held(r) < len(r.keys) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        r.state = "ready" if self.held(r) == len(r.keys) else "partial"

    async def tick(self) -> None:
        now = time.monotonic()
        again = [
            r for r in self.replicas.values()
            if r.state in ("ready", "partial") and self.held(r) < len(r.keys)
            and now - r.warmed_at >= self.relay.settings.agent_rewarm_s
        ]
        if again:
            await asyncio.gather(*(self._warm(r) for r in again))


class EngineRelay:
    def __init__(self, settings: WorkerSettings) -> None:
        assert settings.engine_url is not None
        self.settings = settings
        self.engine_url = settings.engine_url.rstrip("/")
        self.view = CacheView(namespace_seed(settings.model, settings.block_size,
                                             settings.lora_name, settings.cache_salt))
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events_port is not None:
            host = settings.kv_events_host
            self.publisher = KVEventPublisher(
                f"tcp://{host}:{settings.kv_events_port}",
                f"tcp://{host}:{settings.kv_replay_port}"
                if settings.kv_replay_port is not None else None,
                settings.kv_events_topic.encode(),
                settings.kv_buffer_steps,
            )
        self.registry = CollectorRegistry()
        self.relayed = Counter("mooncake_worker:relayed_batches", "KV-event batches relayed",
                               registry=self.registry)
        self.lost = Gauge("mooncake_worker:relay_lost_batches",
                          "Engine KV-event batches lost (not recoverable by replay)",
                          registry=self.registry)
        self.held = Gauge("mooncake_worker:agent_held_blocks",
                          "Blocks of the pod's listed replicas the engine holds",
                          registry=self.registry)
        self.subscriber: KVEventSubscriber | None = None
        if settings.engine_kv_events:
            self.subscriber = KVEventSubscriber(
                settings.engine_kv_events, self._on_batch,
                replay_endpoint=settings.engine_kv_replay,
                expected_seq=0,  # replay whatever the engine still buffers on join
                on_payload=self._on_payload,
                on_reset=self._on_engine_restart,
            )
        self.agent: RelayAgent | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.app = self._build_app()

    # -- events ---------------------------------------------------------------------------
    def _on_payload(self, _seq: int, payload: bytes) -> None:
        if self.publisher is not None:
            self.publisher.publish_payload(payload)
        self.relayed.inc()

    def _on_batch(self, _seq: int, batch: KVEventBatch) -> None:
        self.view.apply(batch)

    def _on_engine_restart(self) -> None:
        """The engine's sequence went back: it restarted with an empty cache. Consumers of
        the relayed stream learn it from an ``AllBlocksCleared`` the engine never sent."""
        self.view.apply(KVEventBatch(time.time(), [AllBlocksCleared()]))
        if self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()])

    # -- app ------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/agent/state", self.agent_state)
        app.router.add_get(LIVENESS_PATH, self.live)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        if self.settings.warm_kernels:
            from mooncake_conductor.warmup import warm_block_keys

            warm_block_keys()  # the pod agent keys warm-up prompts
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=10)
        )
        if self.publisher is not None:
            self.publisher.start()
        if self.subscriber is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self.subscriber.run()))
        if self.settings.annotations_file:
            self.agent = RelayAgent(self, self.settings.annotations_file,
                                    self.settings.agent_poll_s)
            self.agent.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self.agent is not None:
            await self.agent.stop()
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.publisher is not None:
            await self.publisher.close()
        if self._session is not None:
            await self._session.close()

    async def warm(self, tokens: list[int]) -> None:
        assert self._session is not None
        body = warm_body(self.settings.engine_kind, self.settings.model, tokens)
        async with self._session.post(self.engine_url + "/v1/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                raise ApiError(r.status, f"engine answered {r.status}")

    async def metrics(self, _r: web.Request) -> web.Response:
        assert self._session is not None
        engine_text = b""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.get(self.engine_url + "/metrics") as r:
                if r.status == 200:
                    engine_text = await r.read()
        if self.subscriber is not None:
            self.lost.set(self.subscriber.lost)
        if self.agent is not None:
            self.held.set(self.agent.state()["held_blocks"])
        own = generate_latest(self.registry)
        sep = b"" if not engine_text or engine_text.endswith(b"\n") else b"\n"
        return web.Response(body=engine_text + sep + own,
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def live(self, _r: web.Request) -> web.Response:
        """The relay itself answers (``/health`` is relayed: the engine's readiness)."""
        return web.Response(status=200)

    async def agent_state(self, _r: web.Request) -> web.Response:
        if self.agent is None:
            return ApiError(404, "the pod agent is not enabled (--annotations-file)").response()
        state: dict[str, Any] = self.agent.state()
        state["engine_blocks_mapped"] = len(self.view.keys)
        state["engine_blocks_unmapped"] = self.view.unmapped
        return web.json_response(state)

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        try:
            async with self._session.request(
                request.method, self.engine_url + request.rel_url.path_qs,
                data=body, headers=headers, allow_redirects=False,
            ) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers.add(k, v)
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            return ApiError(502, f"engine unavailable: {exc}", code="engine_unavailable",
                            type_="server_error").response()
