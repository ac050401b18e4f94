"""The worker's HTTP server: OpenAI-compatible API of the simulated engine, vLLM's
``/tokenize``, ``/health``, ``/metrics``, the P/D handshake and the pod agent's state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from mooncake_conductor.warmup import warm_block_keys
from mooncake_contract.kvevents.codec import KVEvent
from mooncake_contract.tokenizer import VOCAB_SIZE, Tokenizer, chat_messages_problem
from prometheus_client import CONTENT_TYPE_LATEST

from .agent import PodAgent
from .api import LIVENESS_PATH, ApiError
from .engine import Engine, EngineObserver, EngineSeq, QueueFull, TooLarge
from .kvevents.publisher import KVEventPublisher
from .metrics import WorkerMetrics
from .settings import WorkerSettings
from .store import BlockStore

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_dumps = json.dumps


def _is_part(part: Any) -> bool:
    """A chat content part the engine accepts (its text, if any, is tokenized)."""
    return isinstance(part, dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


#: what the decode half must carry to pull the prefill's KV (vLLM 0.33's MooncakeConnector
#: ignores ``do_remote_prefill`` without all three: "Got invalid KVTransferParams")
PULL_PARAMS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
_NUMERIC_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed")


class _Publish(EngineObserver):
    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def on_events(self, events: list[KVEvent]) -> None:
        self.publisher.publish(events)


class Worker:
    """One worker process: engine, metrics, KV-event publisher, store client, agent."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.tokenizer = Tokenizer()
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events_port is not None:
            host = settings.kv_events_host
            replay = (
                f"tcp://{host}:{settings.kv_replay_port}"
                if settings.kv_replay_port is not None
                else None
            )
            self.publisher = KVEventPublisher(
                f"tcp://{host}:{settings.kv_events_port}",
                replay,
                settings.kv_events_topic.encode(),
                settings.kv_buffer_steps,
            )
        self.metrics = WorkerMetrics(
            settings, _Publish(self.publisher) if self.publisher is not None else None
        )
        self.engine = Engine(settings, self.metrics)
        self.store: BlockStore | None = (
            BlockStore(settings, self.engine.cost.kv_bytes_per_token)
            if settings.store_enabled
            else None
        )
        self.agent: PodAgent | None = None
        self.created = int(time.time())
        self.transferred_blocks = 0
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors], client_max_size=self.settings.max_body_bytes
        )
        r = app.router
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/tokenize", self.tokenize)
        r.add_get("/health", self.health)
        r.add_get(LIVENESS_PATH, self.health)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/agent/state", self.agent_state)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/kv/blocks", self.kv_blocks)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        if self.settings.warm_kernels:
            warm_block_keys()  # before serving: nothing waits on the loop yet
        if self.store is not None:
            await self.store.connect()
        if self.publisher is not None:
            self.publisher.start()
        self.engine.start()
        if self.settings.annotations_file:
            self.agent = PodAgent(self.engine, self.settings.annotations_file,
                                  self.settings.agent_poll_s, self.store)
            self.agent.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self.agent is not None:
            await self.agent.stop()
        await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.close()
        if self.store is not None:
            await self.store.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return ApiError(e.status, e.reason or "error", code=str(e.status)).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # never leak a traceback as a bare 500
            log.exception("unhandled error on %s", request.path)
            return ApiError(500, f"internal error: {type(e).__name__}").response()

    # -- small endpoints ------------------------------------------------------------------
    async def health(self, _r: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _r: web.Request) -> web.Response:
        s = self.settings
        return web.json_response({
            "object": "list",
            "data": [{
                "id": s.model, "object": "model", "created": self.created,
                "owned_by": "mooncake-worker", "root": s.model, "parent": None,
                "max_model_len": s.max_model_len,
            }],
        })

    async def metrics_handler(self, _r: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def agent_state(self, _r: web.Request) -> web.Response:
        if self.agent is None:
            raise ApiError(404, "the pod agent is not enabled (--annotations-file)")
        return web.json_response(self.agent.state())

    async def reset_prefix_cache(self, _r: web.Request) -> web.Response:
        n = self.engine.reset_prefix_cache()
        return web.json_response({"cleared_blocks": n})

    async def kv_blocks(self, _r: web.Request) -> web.Response:
        """Keys the prefix cache holds now (for tests and debugging)."""
        cache = self.engine.cache
        return web.json_response({
            "block_size": cache.block_size,
            "capacity_blocks": cache.capacity,
            "used_blocks": cache.used,
            "keys": sorted(cache.cached),
        })

    # -- request parsing ------------------------------------------------------------------
    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def _check_model(self, data: dict[str, Any]) -> None:
        model = data.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model != self.settings.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model",
                           "model_not_found")

    def _prompt_tokens(self, prompt: Any, param: str = "prompt") -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
                raise ApiError(400, f"token ids must be in [0, {VOCAB_SIZE})", param)
            tokens = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            raise ApiError(400, "batched prompts are not supported; send one prompt", param)
        else:
            raise ApiError(400, f"'{param}' must be a string or a list of token ids", param)
        if not tokens:
            raise ApiError(400, "the prompt is empty", param)
        return tokens

    def _messages_tokens(self, messages: Any) -> list[int]:
        problem = chat_messages_problem(messages, _is_part, "a string or a list of parts")
        if problem is not None:
            raise ApiError(400, problem, "messages")
        return self.tokenizer.encode_chat(messages)

    def _common(self, data: dict[str, Any], chat: bool) -> tuple[int | None, bool, bool]:
        """Validate the shared sampling fields: (max_tokens, stream, include_usage)."""
        self._check_model(data)
        max_tokens = data.get("max_tokens")
        param = "max_tokens"
        if chat and data.get("max_completion_tokens") is not None:
            max_tokens, param = data["max_completion_tokens"], "max_completion_tokens"
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
            raise ApiError(400, f"'{param}' must be a positive integer", param)
        stream = data.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream")
        opts = data.get("stream_options")
        include_usage = False
        if opts is not None:
            if not isinstance(opts, dict):
                raise ApiError(400, "'stream_options' must be an object", "stream_options")
            iu = opts.get("include_usage")
            if iu is not None and not isinstance(iu, bool):
                raise ApiError(400, "'stream_options.include_usage' must be a boolean",
                               "stream_options")
            include_usage = bool(iu)
        n = data.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise ApiError(400, "only n=1 is supported", "n")
        for f in _NUMERIC_FIELDS:
            v = data.get(f)
            if v is not None and not _is_number(v):
                raise ApiError(400, f"'{f}' must be a number", f)
        kvp = data.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):
            raise ApiError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
        return max_tokens, bool(stream), include_usage

    def _check_length(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        limit = self.settings.max_model_len
        if n_prompt >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {n_prompt} tokens.",
                param, "context_length_exceeded",
            )
        if max_tokens is None:
            return min(self.settings.default_max_tokens, limit - n_prompt)
        if n_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion).",
                "max_tokens", "context_length_exceeded",
            )
        return max_tokens

    # -- endpoints ------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        self._check_model(data)
        if "messages" in data:
            tokens = self._messages_tokens(data["messages"])
        elif "prompt" in data:
            tokens = self._prompt_tokens(data["prompt"])
        else:
            raise ApiError(400, "send 'prompt' or 'messages'", "prompt")
        return web.json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.settings.max_model_len}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        max_tokens, stream, include_usage = self._common(data, chat=False)
        if "prompt" not in data:
            raise ApiError(400, "'prompt' is required", "prompt")
        tokens = self._prompt_tokens(data["prompt"])
        mt = self._check_length(len(tokens), max_tokens, "prompt")
        return await self._generate(request, data, tokens, mt, stream, include_usage, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        max_tokens, stream, include_usage = self._common(data, chat=True)
        if "messages" not in data:
            raise ApiError(400, "'messages' is required", "messages")
        tokens = self._messages_tokens(data["messages"])
        mt = self._check_length(len(tokens), max_tokens, "messages")
        return await self._generate(request, data, tokens, mt, stream, include_usage, chat=True)

    # -- generation -----------------------------------------------------------------------
    async def _generate(
        self,
        request: web.Request,
        data: dict[str, Any],
        tokens: list[int],
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        chat: bool,
    ) -> web.StreamResponse:
        kvp: dict[str, Any] | None = data.get("kv_transfer_params")
        remote_decode = bool(kvp and kvp.get("do_remote_decode") is True)
        remote_prefill = bool(kvp and kvp.get("do_remote_prefill") is True)
        if remote_decode:
            # the prefill half of a P/D pair produces only the first token, and answers in
            # one JSON body (which carries the kv_transfer_params)
            max_tokens = 1
            stream = False
        engine = self.engine
        keys = engine.keys_of(tokens)
        pulled = False
        if remote_prefill and not remote_decode:
            if all(k in (kvp or {}) for k in PULL_PARAMS):
                await self._load_remote_kv(tokens, keys)
                pulled = True  # what is held now, loaded or cached before
            else:  # as vLLM does: no transfer, the prompt is computed here
                log.warning("kv_transfer_params without %s: recomputing",  # pragma: no mutate
                            ", ".join(PULL_PARAMS))  # pragma: no mutate
        try:
            seq = engine.submit(tokens, max_tokens, stream=stream, keys=keys,
                                pulled=pulled)
        except QueueFull as exc:
            self.metrics.rejected.inc()
            raise ApiError(
                429, "Too many requests: the worker's queue is full, retry later.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            ) from exc
        except TooLarge as exc:
            raise ApiError(400, str(exc), "max_tokens", "context_length_exceeded") from exc
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex
        if stream:
            return await self._stream(request, seq, rid, chat, include_usage)
        assert seq.done is not None
        held: asyncio.Task[int] | None = None
        if remote_decode and (kvp or {}).get("transfer_id"):
            # the store writes run beside the modelled prefill once it begins, as an
            # engine writes KV while it computes, instead of adding their wall time after
            held = asyncio.create_task(self._hold_for_transfer(seq, keys))
        try:
            await seq.done
        except asyncio.CancelledError:
            engine.abort(seq)
            if held is not None:
                held.cancel()
            raise
        if seq.finish_reason == "error":
            if held is not None:  # nothing computed: nothing to offer a decode engine
                held.cancel()
            raise ApiError(503, "the KV cache cannot hold this request now", code="cache_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        text = self.tokenizer.decode(seq.generated)
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.settings.model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text},
                 "logprobs": None, "finish_reason": seq.finish_reason}
                if chat else
                {"index": 0, "text": text, "logprobs": None,
                 "finish_reason": seq.finish_reason, "stop_reason": None}
            ],
            "usage": self._usage(seq),
        }
        if remote_decode:
            # vLLM's MooncakeConnector holds the blocks for a transfer id and answers with
            # no parameters of its own (the gateway tells the decode engine where to pull)
            if held is not None:
                await held
            else:
                log.warning("kv_transfer_params without transfer_id: "  # pragma: no mutate
                            "nothing held for a decode engine")  # pragma: no mutate
            body["kv_transfer_params"] = None
        return web.Response(text=_dumps(body), content_type="application/json")

    @staticmethod
    def _usage(seq: EngineSeq) -> dict[str, Any]:
        n, g = len(seq.prompt), len(seq.generated)
        return {"prompt_tokens": n, "completion_tokens": g, "total_tokens": n + g,
                "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}

    async def _stream(
        self, request: web.Request, seq: EngineSeq, rid: str, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        assert seq.stream is not None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        created = int(time.time())
        model = self.settings.model
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}
            return b"data: " + _dumps(body).encode() + b"\n\n"

        try:
            await resp.prepare(request)
            if chat:
                await resp.write(chunk("", None, role=True))
            q = seq.stream
            decode = self.tokenizer.decode_token
            while True:
                tok = await q.get()
                if tok is None:
                    break
                parts = [decode(tok)]
                end = False
                while not q.empty():
                    t = q.get_nowait()
                    if t is None:
                        end = True
                        break
                    parts.append(decode(t))
                await resp.write(chunk("".join(parts), None))
                if end:
                    break
            finish = seq.finish_reason if seq.finish_reason != "error" else "abort"
            await resp.write(chunk(None if chat else "", finish))
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model,
                        "choices": [], "usage": self._usage(seq)}
                await resp.write(b"data: " + _dumps(body).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.engine.abort(seq)
            raise
        finally:
            if not seq.finished:
                self.engine.abort(seq)
        return resp

    # -- P/D handshake --------------------------------------------------------------------
    async def _hold_for_transfer(self, seq: EngineSeq, keys: list[int]) -> int:
        """Prefill side: once a step computes ``seq``'s prompt, make the prompt's blocks
        available to the decode engine (in the store); the number newly stored. Not at
        admission: prompts admitted together but computed one after another (the step
        budget) would otherwise queue their writes ahead of the prompt being computed,
        whose answer waits for its own."""
        if self.store is None:
            return 0
        await seq.computing.wait()
        bs, prompt = self.engine.block_size, seq.prompt
        return await self.store.put_blocks(
            keys, [prompt[i * bs : (i + 1) * bs] for i in range(len(keys))])

    async def _load_remote_kv(self, tokens: list[int], keys: list[int]) -> int:
        """Decode side: bring the prefill's blocks in from the store, looked up by this
        engine's own block keys (an engine of another namespace finds none and
        recomputes)."""
        if self.store is None or not keys:
            return 0
        engine = self.engine
        bs = engine.block_size
        have = engine.cache.match(keys)
        want = keys[have:]
        if not want:
            return 0
        started = time.monotonic()
        got = await self.store.get_blocks(want)
        blocks: list[list[int]] = []
        for i, g in enumerate(got):
            j = have + i
            if g is None or g[1] != tokens[j * bs : (j + 1) * bs]:
                break
            blocks.append(g[1])
        if not blocks:
            return 0
        parent = keys[have - 1] if have else None
        n = engine.insert_blocks(want[: len(blocks)], parent, blocks)
        self.transferred_blocks += n
        # the modelled transfer is a deadline: the store's own wall time counts in it
        t = (engine.cost.transfer_time(n * bs) * self.settings.time_scale
             - (time.monotonic() - started))
        if t > 0:
            await asyncio.sleep(t)
        return n


def _event_faults_on_signals(publisher: KVEventPublisher) -> None:
    """Fault injection for drills, the alert tests and the chaos suite: each SIGUSR1
    starts or stops dropping KV-event batches (``KVEventPublisher.dropping``), each
    SIGUSR2 sending them out of order (``KVEventPublisher.reordering``)."""
    def drop() -> None:
        publisher.dropping = not publisher.dropping
        log.warning("KV-event batches are %s (SIGUSR1)",
                    "dropped" if publisher.dropping else "published again")

    def reorder() -> None:
        publisher.reordering = not publisher.reordering
        log.warning("KV-event batches are sent %s (SIGUSR2)",
                    "out of order" if publisher.reordering else "in order again")

    loop = asyncio.get_running_loop()
    for sig, toggle in ((signal.SIGUSR1, drop), (signal.SIGUSR2, reorder)):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, toggle)


async def serve(settings: WorkerSettings, ready: Callable[[int], None] | None = None) -> None:
    """Run a worker (or, with ``engine_url``, a relay in front of a real engine) until
    cancelled."""
    app: web.Application
    if settings.engine_url:
        from .relay import EngineRelay

        relay = EngineRelay(settings)
        app, publisher = relay.app, relay.publisher
    else:
        worker = Worker(settings)
        app, publisher = worker.app, worker.publisher
    if publisher is not None:
        _event_faults_on_signals(publisher)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
    await site.start()
    port = settings.port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(port)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
