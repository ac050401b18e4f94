"""The P/D handshake and the generation endpoint in-process: a :class:`Worker` served over
real HTTP on 127.0.0.1 (no store here; the store half is ``test_worker_pd_store_unit.py``).

What is pinned: the prefill half's answer (one token, one JSON body, and no
``kv_transfer_params`` of its own, as vLLM's MooncakeConnector answers), when a request
counts as the prefill or the decode half, the shapes of the non-streamed answers, the
429 of a full queue, the 400 of a request the cache can never hold, the 503 of a cache
that cannot hold it now, and the abort of a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
from mooncake_contract.kvevents.codec import KVEvent
from mooncake_worker.engine import Engine, EngineObserver
from mooncake_worker.server import Worker
from worker_inproc import (
    BS,
    MODEL,
    keys_for,
    post,
    prompt,
    serving,
    settings,
    stored_event,
)

#: the gateway's prefill half (mooncake_gateway.handshake, vLLM's MooncakeConnector shape)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}
#: and its decode half
REMOTE_PREFILL = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": "prefill-0", "remote_bootstrap_addr": "http://p:8998",
                  "transfer_id": "xfer-1"}


def test_prefill_half_answers_one_token_and_the_handoff() -> None:
    tokens = prompt(1000, 5 * BS + 3)  # 5 full blocks and a partial one

    async def main() -> tuple[int, dict[str, Any], dict[str, str]]:
        w = Worker(settings())
        async with serving(w) as c:
            # stream and max_tokens are overridden: the prefill half answers one token in JSON
            return await post(c, "/v1/completions", {
                "model": MODEL, "prompt": tokens, "max_tokens": 8, "stream": True,
                "kv_transfer_params": REMOTE_DECODE})

    status, body, headers = asyncio.run(main())
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["prompt_tokens"] == len(tokens)
    assert body["choices"][0]["finish_reason"] == "length"
    # vLLM's MooncakeConnector answers the prefill half with no parameters of its own
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None


def test_prefill_half_of_a_chat_answers_one_token_without_parameters() -> None:
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]

    async def main() -> dict[str, Any]:
        w = Worker(settings(block_size=8, port=9001))
        async with serving(w) as c:
            status, body, _ = await post(c, "/v1/chat/completions", {
                "messages": messages, "max_completion_tokens": 5,
                "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200
        return body

    body = asyncio.run(main())
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"]["completion_tokens"] == 1
    assert body["kv_transfer_params"] is None


def test_only_a_literal_true_makes_a_half() -> None:
    """``do_remote_decode``/``do_remote_prefill`` must be JSON ``true``; anything else (1,
    "true", absent) is an ordinary request: all its tokens, streamed if asked, no handoff."""
    tokens = prompt(3000, 40)

    async def main() -> list[tuple[int, dict[str, Any]]]:
        w = Worker(settings())
        out = []
        async with serving(w) as c:
            for kvp in ({"do_remote_decode": 1}, {"do_remote_decode": "true"}, {},
                        {"do_remote_prefill": 1, "do_remote_decode": False}):
                status, body, _ = await post(c, "/v1/completions", {
                    "prompt": tokens, "max_tokens": 4, "kv_transfer_params": kvp})
                out.append((status, body))
            resp = await c.post("/v1/completions", json={
                "prompt": tokens, "max_tokens": 4, "stream": True,
                "kv_transfer_params": {"do_remote_decode": 1}})
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            await resp.read()
        return out

    for status, body in asyncio.run(main()):
        assert status == 200
        assert body["usage"]["completion_tokens"] == 4
        assert "kv_transfer_params" not in body


def test_plain_answers_have_the_openai_shape() -> None:
    tokens = prompt(5000, 3 * BS + 5)
    n = len(tokens)

    async def main() -> tuple[float, float, list[dict[str, Any]], str]:
        w = Worker(settings())
        bodies = []
        async with serving(w) as c:
            t0 = time.time()
            for path, req in (("/v1/completions", {"prompt": tokens}),
                              ("/v1/completions", {"prompt": tokens}),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hello there"}]})):
                status, body, headers = await post(c, path, {**req, "max_tokens": 6})
                assert status == 200 and headers["Content-Type"] == "application/json; charset=utf-8"  # noqa: E501
                bodies.append(body)
            t1 = time.time()
            resp = await c.post("/v1/completions",
                                json={"prompt": tokens, "max_tokens": 6, "stream": True})
            streamed = await resp.text()
        return t0, t1, bodies, streamed

    t0, t1, (first, again, chat), streamed = asyncio.run(main())
    assert set(first) == {"id", "object", "created", "model", "choices", "usage"}
    text = first["choices"][0]["text"]
    assert first["choices"] == [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": "length", "stop_reason": None}]
    assert first["object"] == "text_completion" and first["model"] == MODEL
    assert first["id"].startswith("cmpl-") and len(first["id"]) == len("cmpl-") + 32
    assert int(t0) <= first["created"] <= t1
    # the text is the decoded generated tokens: what the stream sends piece by piece
    pieces = [line for line in streamed.split("\n") if line.startswith("data: {")]
    assert "".join(json.loads(p[6:])["choices"][0]["text"] for p in pieces) == text
    assert first["usage"] == {"prompt_tokens": n, "completion_tokens": 6, "total_tokens": n + 6,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # the second time the 3 full blocks are cached
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert again["choices"][0]["text"] == text and again["id"] != first["id"]
    content = chat["choices"][0]["message"]["content"]
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": content},
                                "logprobs": None, "finish_reason": "length"}]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert content and set(chat) == set(first)


def test_streamed_chat_chunks_carry_one_id_and_the_usage() -> None:
    messages = [{"role": "user", "content": "stream me something"}]

    async def main() -> tuple[str, dict[str, Any]]:
        w = Worker(settings())
        async with serving(w) as c:
            resp = await c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}})
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
            _, body, _ = await post(c, "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": 5})
        return text, body

    text, body = asyncio.run(main())
    lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    ids = {ch["id"] for ch in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-1])
    assert content == body["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_decode_half_without_a_store_recomputes() -> None:
    tokens = prompt(7000, 4 * BS + 1)
    keys = keys_for(tokens)

    async def main() -> tuple[dict[str, Any], int, Worker]:
        w = Worker(settings())
        async with serving(w) as c:
            status, body, _ = await post(c, "/v1/completions", {
                "prompt": tokens, "max_tokens": 3, "kv_transfer_params": REMOTE_PREFILL})
            assert status == 200
            loaded = await w._load_remote_kv(tokens, keys)
        return body, loaded, w

    body, loaded, w = asyncio.run(main())
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 3 and "kv_transfer_params" not in body
    assert loaded == 0 and w.transferred_blocks == 0


def test_full_queue_is_a_429_with_retry_after() -> None:
    async def main() -> tuple[list[tuple[int, dict[str, Any], dict[str, str]]], str]:
        w = Worker(settings(max_waiting=0, max_running=1, retry_after_s=7))
        out = []
        async with serving(w) as c:
            await w.engine.stop()  # nothing is admitted any more: the next one fills the queue
            w.engine.submit(prompt(100, 20), 1)
            for kvp in ({}, {"do_remote_decode": True}):
                out.append(await post(c, "/v1/completions", {
                    "prompt": prompt(200, 20), "max_tokens": 2, "kv_transfer_params": kvp}))
            metrics = await (await c.get("/metrics")).text()
        return out, metrics

    out, metrics = asyncio.run(main())
    for status, body, headers in out:
        assert status == 429 and headers["Retry-After"] == "7"
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["message"] == (
            "Too many requests: the worker's queue is full, retry later.")
    rejected = re.search(r"^mooncake_worker:requests_rejected_total\{.*\} (\S+)$", metrics, re.M)
    assert rejected is not None and float(rejected.group(1)) == 2


def test_request_the_cache_can_never_hold_is_a_400() -> None:
    async def main() -> tuple[int, dict[str, Any], dict[str, str]]:
        w = Worker(settings(cache_tokens=BS * 4))
        async with serving(w) as c:
            return await post(c, "/v1/completions", {"prompt": prompt(300, 60), "max_tokens": 20})

    status, body, _ = asyncio.run(main())
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "max_tokens"
    assert body["error"]["message"] == "request needs 5 KV blocks; the cache holds 4"


def test_cache_pinned_full_is_a_503_cache_full() -> None:
    """Blocks pinned by the pod agent leave too little room, and nothing running will free
    any: the request fails now (a 503 to retry) instead of waiting forever."""
    pinned = prompt(400, 6 * BS)

    async def main() -> tuple[int, dict[str, Any], dict[str, str]]:
        w = Worker(settings(cache_tokens=BS * 8, retry_after_s=3))
        keys = w.engine.keys_of(pinned)
        w.engine.insert_blocks(keys, None, [pinned[i * BS:(i + 1) * BS] for i in range(6)])
        w.engine.pin(keys)
        async with serving(w) as c:
            return await post(c, "/v1/completions", {"prompt": prompt(900, 40), "max_tokens": 10})

    status, body, headers = asyncio.run(main())
    assert status == 503 and headers["Retry-After"] == "3"
    assert body["error"]["code"] == "cache_full"
    assert body["error"]["message"] == "the KV cache cannot hold this request now"
    assert body["error"]["type"] == "service_unavailable_error"


def test_a_client_gone_mid_request_frees_its_slot_and_blocks() -> None:
    async def main() -> tuple[int, int, int]:
        w = Worker(settings(time_scale=2000))  # a prefill step of ~80 s
        async with serving(w) as c:
            try:
                await c.post("/v1/completions", json={"prompt": prompt(600, 64), "max_tokens": 4},
                             timeout=aiohttp.ClientTimeout(total=0.5))
            except TimeoutError:
                pass
            else:
                raise AssertionError("the request should still be running")
            for _ in range(100):
                if not w.engine.running:
                    break
                await asyncio.sleep(0.02)
            return len(w.engine.running), w.engine.cache.used, w.engine.cache.reserved

    assert asyncio.run(main()) == (0, 0, 0)


# -- the engine's part of the handshake ------------------------------------------------------
class Collect(EngineObserver):
    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def on_events(self, events: list[KVEvent]) -> None:
        self.events.extend(events)


def test_keys_of_follow_the_namespace_and_only_full_blocks() -> None:
    tokens = prompt(800, 3 * BS + 7)
    e = Engine(settings())
    assert e.keys_of(tokens) == keys_for(tokens) and len(keys_for(tokens)) == 3
    salted = Engine(settings(cache_salt="s1", block_size=8))
    assert salted.keys_of(tokens) == keys_for(tokens, bs=8, salt="s1")
    assert salted.keys_of(tokens) != keys_for(tokens, bs=8)


def test_insert_blocks_caches_them_and_announces_them_at_once() -> None:
    tokens = prompt(900, 3 * BS)
    obs = Collect()
    e = Engine(settings(), obs)
    keys = e.keys_of(tokens)
    blocks = [tokens[i * BS:(i + 1) * BS] for i in range(3)]
    assert e.insert_blocks(keys[1:], keys[0], blocks[1:]) == 2
    assert obs.events == [stored_event(keys[1:], keys[0], tokens[BS:])]
    assert not e.cache.events  # flushed to the observer, not left for the next step
    assert e.cache.held_keys() == set(keys[1:])
    assert [e.cache.cached[k].tokens for k in keys[1:]] == [tuple(b) for b in blocks[1:]]
    assert e.insert_blocks(keys, None, blocks) == 3
    assert obs.events[-1] == stored_event([keys[0]], None, tokens[:BS])
