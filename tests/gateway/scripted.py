"""Scripted engines, a scripted KV-event publisher and an in-process gateway, all on
127.0.0.1 and on the test's event loop.

- :class:`ScriptedEngine`: an aiohttp server standing in for a vLLM engine. It records
  every completion request it gets and answers as the test says: a prefill answer (with
  ``kv_transfer_params: null``, as vLLM's MooncakeConnector answers), a decode answer
  (JSON or SSE), an error status, or nothing until :attr:`ScriptedEngine.hold` is
  released.
- :class:`ScriptedPublisher`: a KV-event publisher on real ZeroMQ sockets (PUB + replay
  ROUTER, the worker's and vLLM's protocol, the shared codec) whose sequence numbers,
  replay buffer and losses the test decides.
- :func:`running_gateway`: the gateway's own :func:`~mooncake_gateway.server.serve` (fast
  front end, lean upstream client, aiohttp for streams) on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web
from mooncake_contract.kvevents.codec import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from mooncake_gateway.server import serve
from mooncake_gateway.settings import GatewaySettings

HOST = "127.0.0.1"
MODEL = "scripted"
BLOCK = 16
#: settings that keep an in-process gateway light: no kernel warm-up, no gc.freeze of the
#: test process, no checks or scrapes while a test runs unless it asks for them
QUIET = {"warm_kernels": False, "gc_freeze": False, "health_interval_s": 60.0,
         "metrics_interval_s": 60.0}


@dataclass
class Call:
    """One completion request an engine got."""

    path: str
    body: dict[str, Any]
    raw: bytes
    at: float = field(default_factory=time.monotonic)

    @property
    def is_prefill(self) -> bool:
        kvp = self.body.get("kv_transfer_params")
        return isinstance(kvp, dict) and kvp.get("do_remote_decode") is True


#: a scripted answer: the request (to stream on) and what it carried
Answer = Callable[[web.Request, Call], Awaitable[web.StreamResponse]]


class ScriptedEngine:
    """An engine stand-in: ``/health``, ``/metrics`` and the two completion routes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[Call] = []
        self.healthy = True
        #: status of completion answers other than 200 (a JSON error body)
        self.status = 200
        #: when set, completion answers wait until it is
        self.hold: asyncio.Event | None = None
        #: what a prefill answer carries (vLLM's MooncakeConnector: nothing of its own)
        self.kv_transfer_params: dict[str, Any] | None = None
        #: replaces the scripted answers when set
        self.answer: Answer | None = None
        self.arrived = asyncio.Event()  # set on every completion request
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- what the tests read ------------------------------------------------------------------
    @property
    def prefills(self) -> list[Call]:
        return [c for c in self.calls if c.is_prefill]

    @property
    def decodes(self) -> list[Call]:
        return [c for c in self.calls if not c.is_prefill]

    def endpoint(self, **extra: Any) -> dict[str, Any]:
        return {"url": self.url, "name": self.name, **extra}

    def decode_json(self, call: Call) -> dict[str, Any]:
        """The non-streamed decode answer this engine gives ``call``."""
        text = f"decoded by {self.name}"
        if call.path.endswith("/chat/completions"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": "length", "text": text}
            obj = "text_completion"
        return {"id": f"cmpl-{self.name}-{len(self.calls)}", "object": obj, "model": MODEL,
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}

    def sse(self, call: Call) -> bytes:
        """The streamed decode answer: two token events, then ``[DONE]``."""
        chat = call.path.endswith("/chat/completions")
        out = []
        for word in (f"decoded by {self.name}", " end"):
            delta = {"delta": {"content": word}} if chat else {"text": word}
            out.append(b"data: " + json.dumps(
                {"id": f"s-{self.name}", "choices": [{"index": 0, **delta}]}).encode() + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    # -- server -------------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        """The engine's HTTP routes (a subclass adds its own after these)."""
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)

    async def start(self) -> Self:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{HOST}:{port}"
        return self

    async def stop(self) -> None:
        """Stop listening (connections to its port are refused from now on)."""
        if self.hold is not None:
            self.hold.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _r: web.Request) -> web.Response:
        return web.json_response({"ok": self.healthy}, status=200 if self.healthy else 503)

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        call = Call(request.path, json.loads(raw), raw)
        self.calls.append(call)
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.answer is not None:
            return await self.answer(request, call)
        if self.status != 200:
            return web.json_response(
                {"error": {"message": f"{self.name} says {self.status}", "type": "x",
                           "param": None, "code": None}}, status=self.status)
        if call.is_prefill:
            body = self.decode_json(call)
            body["kv_transfer_params"] = self.kv_transfer_params
            body["usage"] = {"prompt_tokens": 100, "completion_tokens": 1,
                             "total_tokens": 101, "prompt_tokens_details": {"cached_tokens": 32}}
            return web.json_response(body)
        if call.body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(self.sse(call))
            await resp.write_eof()
            return resp
        return web.json_response(self.decode_json(call))


@contextlib.asynccontextmanager
async def engines(*names: str) -> AsyncIterator[list[ScriptedEngine]]:
    started: list[ScriptedEngine] = []
    try:
        for n in names:
            started.append(await ScriptedEngine(n).start())
        yield started
    finally:
        for e in started:
            await e.stop()


def model(prefill: Sequence[ScriptedEngine | dict[str, Any]],
          decode: Sequence[ScriptedEngine | dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A model document over scripted engines (or endpoint dicts)."""
    def ep(e: ScriptedEngine | dict[str, Any]) -> dict[str, Any]:
        return e.endpoint() if isinstance(e, ScriptedEngine) else e
    return {"name": MODEL, "block_size": BLOCK, "prefill": [ep(e) for e in prefill],
            "decode": [ep(e) for e in decode], **extra}


class GatewayClient:
    """Real HTTP to an in-process gateway. Every POST on a connection of its own: the
    fast front end decides about each (on a connection it handed to aiohttp once, aiohttp
    would serve the rest)."""

    def __init__(self, url: str, session: aiohttp.ClientSession,
                 posts: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session
        self.posts = posts

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
                   ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.posts.post(self.url + path, data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, dict(r.headers), await r.read()

    async def get(self, path: str) -> Any:
        async with self.session.get(self.url + path) as r:
            assert r.status == 200, (path, r.status, await r.text())
            return await r.json()

    async def text(self, path: str) -> str:
        async with self.session.get(self.url + path) as r:
            assert r.status == 200, (path, r.status)
            return await r.text()

    async def state(self) -> dict[str, Any]:
        models = (await self.get(f"/conductor/state?model={MODEL}"))["models"]
        return dict(models[0])

    async def ready(self) -> bool:
        async with self.session.get(self.url + "/ready") as r:
            return r.status == 200


@contextlib.asynccontextmanager
async def running_gateway(models: list[dict[str, Any]], wait_ready: bool = True,
                          **settings: Any) -> AsyncIterator[GatewayClient]:
    """:func:`~mooncake_gateway.server.serve` on 127.0.0.1 (a free port unless ``port``
    is given; ``QUIET`` settings unless overridden), cancelled on exit."""
    cfg = GatewaySettings.model_validate(
        {**QUIET, "port": 0, **settings, "host": HOST, "models": models})
    loop = asyncio.get_running_loop()
    port: asyncio.Future[int] = loop.create_future()
    task = loop.create_task(serve(cfg, port.set_result))
    try:
        waiting: set[asyncio.Future[Any]] = {task, port}
        await asyncio.wait(waiting, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what stopped it
        assert port.done(), "the gateway did not start listening"
        async with aiohttp.ClientSession() as session, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as posts:
            client = GatewayClient(f"http://{HOST}:{port.result()}", session, posts)
            if wait_ready:
                await until(client.ready, what="the gateway is ready")
            yield client
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` (a stand-in gateway or peer) on a free port of 127.0.0.1; its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, HOST, 0).start()
        yield f"http://{HOST}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def until(cond: Callable[[], Awaitable[Any]], timeout: float = 10.0,
                what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        v = await cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not met in {timeout} s: {what}")
        await asyncio.sleep(0.02)


def prompt_ids(n: int, first: int = 1) -> list[int]:
    """``n`` token ids starting at ``first`` (distinct prompts: distinct ``first``)."""
    return [(first * 7919 + i) % 100_000 + 1 for i in range(n)]


class ScriptedPublisher:
    """A KV-event publisher on real ZeroMQ sockets whose sequence numbers, replay buffer
    and losses the test decides (the frames are the worker's and vLLM's: PUB ``[topic,
    seq, payload]``; the ROUTER answers ``[b"", start]`` with ``[b"", topic, seq,
    payload]`` per buffered batch from ``start`` on, then the end marker)."""

    def __init__(self, replay: bool = True, answer_replay: bool = True, topic: bytes = b"",
                 bind: tuple[str, str | None] | None = None) -> None:
        """``replay``: with a replay socket; ``answer_replay``: which answers (else it takes
        requests and never answers); ``bind``: the PUB and replay endpoints of a
        publisher closed before (an engine restarting on its ports), else free ports."""
        self.topic = topic
        self.seq = 0
        self.buffer: dict[int, bytes] = {}
        self.answer_replay = answer_replay
        #: when set, replay answers wait until it is
        self.replay_gate: asyncio.Event | None = None
        pub_at, replay_at = bind or (f"tcp://{HOST}:*", f"tcp://{HOST}:*" if replay else None)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(pub_at)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        if replay_at is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_at)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def endpoint_fields(self) -> dict[str, Any]:
        return {"kv_events": self.endpoint, "kv_replay": self.replay_endpoint}

    async def publish(self, events: Sequence[KVEvent], wire: bool = True,
                      buffered: bool = True) -> int:
        """One batch with the next sequence number: sent on the PUB socket unless not
        ``wire`` (lost on the way), kept for replay unless not ``buffered``."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(KVEventBatch(time.time(), list(events)))
        if buffered:
            self.buffer[seq] = payload
        if wire:
            await self._pub.send_multipart([self.topic, encode_seq(seq), payload])
        return seq

    def lose(self, n: int) -> None:
        """``n`` sequence numbers go by that nobody will ever get (not even by replay)."""
        self.seq += n

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _empty, start_frame = frames
            start = decode_seq(start_frame)
            self.replay_requests.append(start)
            if not self.answer_replay:
                continue
            if self.replay_gate is not None:
                await self.replay_gate.wait()
            for seq in sorted(self.buffer):
                if seq >= start:
                    await router.send_multipart(
                        [ident, b"", self.topic, encode_seq(seq), self.buffer[seq]])
            await router.send_multipart([ident, b"", b"", encode_seq(END_SEQ), b""])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()
