"""What the gateway refuses before any engine call, and what it lets through, end to end
over HTTP against scripted engines: an OpenAI-shaped 4xx naming the field, nothing sent
upstream; the accepted neighbours of each refusal served."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from mooncake_contract.tokenizer import VOCAB_SIZE

from .scripted import MODEL, ScriptedEngine, engines, model, prompt_ids, running_gateway, until

MAX_LEN = 256
DEFAULT_MAX_TOKENS = 16
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hello there"}]


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(20), "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


REFUSED: list[tuple[str, Any, int, str | None, str | None]] = [
    # path, body, status, param, code
    (CMPL, b"{not json", 400, None, None),
    (CMPL, b"[1, 2]", 400, None, None),
    (CMPL, _c(model=5), 400, "model", None),
    (CMPL, _c(model="nope"), 404, "model", "model_not_found"),
    (CMPL, _c(stream="yes"), 400, "stream", None),
    (CMPL, _c(stream_options=1), 400, "stream_options", None),
    (CMPL, _c(n=2), 400, "n", None),
    (CMPL, _c(n=True), 400, "n", None),
    (CMPL, _c(max_tokens=0), 400, "max_tokens", None),
    (CMPL, _c(max_tokens=True), 400, "max_tokens", None),
    (CMPL, _c(max_tokens=2.5), 400, "max_tokens", None),
    (CMPL, _c(prompt=""), 400, "prompt", None),
    (CMPL, _c(prompt=" \n"), 400, "prompt", None),  # no tokens
    (CMPL, _c(prompt=[]), 400, "prompt", None),
    (CMPL, _c(prompt=[1, -5]), 400, "prompt", None),
    (CMPL, _c(prompt=[1, VOCAB_SIZE]), 400, "prompt", None),
    (CMPL, _c(prompt=[1, 2.5]), 400, "prompt", None),
    (CMPL, _c(prompt=True), 400, "prompt", None),
    (CMPL, _c(prompt=["a", "b"]), 400, "prompt", None),
    (CMPL, _c(prompt=[[1, 2], [3]]), 400, "prompt", None),
    (CMPL, _without(_c(), "prompt"), 400, "prompt", None),
    # the context window: prompt + max_tokens (or the model's default) past it
    (CMPL, _c(prompt=prompt_ids(200), max_tokens=MAX_LEN - 199), 400, "max_tokens",
     "context_length_exceeded"),
    (CMPL, _without(_c(prompt=prompt_ids(MAX_LEN - DEFAULT_MAX_TOKENS + 1)), "max_tokens"),
     400, "max_tokens", "context_length_exceeded"),
    (CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    (CHAT, _chat(max_tokens=-1), 400, "max_tokens", None),
    (CHAT, _chat(messages=[]), 400, "messages", None),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages", None),
    (CHAT, _chat(messages="hi"), 400, "messages", None),
    (CHAT, _chat(max_completion_tokens=MAX_LEN), 400, "max_tokens",
     "context_length_exceeded"),
]


def _id(i: int, case: tuple[str, Any, int, str | None, str | None]) -> str:
    path, _body, status, param, _code = case
    return f"{i}-{path.rsplit('/', 1)[-1]}-{status}-{param}"


@pytest.mark.parametrize("case", REFUSED, ids=[_id(i, c) for i, c in enumerate(REFUSED)])
def test_a_refused_request_is_an_openai_4xx_naming_the_field_and_reaches_no_engine(
        case: tuple[str, Any, int, str | None, str | None]) -> None:
    path, body, status, param, code = case

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], max_model_len=MAX_LEN,
                       default_max_tokens=DEFAULT_MAX_TOKENS)]) as gw:
            for stream in (False, True):
                sent = body
                if isinstance(body, dict) and stream and "stream" not in body:
                    sent = {**body, "stream": True}
                got, headers, raw = await gw.post(path, sent)
                assert got == status, raw
                assert headers["Content-Type"].startswith("application/json")
                err = json.loads(raw)["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"] == ("not_found_error" if status == 404
                                       else "invalid_request_error")
                if param is not None or sent is body:
                    assert err["param"] == param, err
                assert err["code"] == code, err
            assert p0.calls == [] and d0.calls == []

    asyncio.run(main())


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (CMPL, _without(_c(), "model")),  # the one model served
    (CMPL, _c(stream=None, n=1, stream_options=None, max_tokens=None)),
    (CMPL, _c(prompt=[prompt_ids(20)])),  # a batch of one
    (CMPL, _c(prompt=["a batch of one string"])),
    (CMPL, _c(prompt=[0, VOCAB_SIZE - 1])),
    (CMPL, _c(prompt=prompt_ids(200), max_tokens=MAX_LEN - 200)),  # the window exactly
    (CMPL, _without(_c(prompt=prompt_ids(MAX_LEN - DEFAULT_MAX_TOKENS)), "max_tokens")),
    (CHAT, _chat(max_completion_tokens=3)),
    (CHAT, _chat(max_tokens=3, max_completion_tokens=None)),
    (CHAT, _chat(max_completion_tokens=4, max_tokens=0)),  # as vLLM: the first one wins
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])),
]


@pytest.mark.parametrize("path,body", ACCEPTED,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, _b) in
                              enumerate(ACCEPTED)])
def test_the_accepted_neighbours_are_served(path: str, body: dict[str, Any]) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], max_model_len=MAX_LEN,
                       default_max_tokens=DEFAULT_MAX_TOKENS)]) as gw:
            status, _h, raw = await gw.post(path, body)
            assert status == 200, raw
            assert json.loads(raw) == d0.decode_json(d0.decodes[0])
            got = dict(d0.decodes[0].body)
            assert got.pop("kv_transfer_params")["remote_engine_id"] == "p0"
            assert got == body

    asyncio.run(main())


@pytest.mark.parametrize("value,explained", [("1", True), ("TRUE", True), ("Yes", True),
                                             ("0", False), ("no", False), ("", False)])
def test_the_explain_header_values(value: str, explained: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            for path, body in ((CMPL, _c()), (CMPL, _c(stream=True)), (CHAT, _chat())):
                status, headers, raw = await gw.post(path, body,
                                                     {"x-conductor-explain": value})
                assert status == 200, raw
                assert ("x-conductor-decision" in headers) == explained
                if not body.get("stream"):
                    assert ("conductor" in json.loads(raw)) == explained

    asyncio.run(main())


@pytest.mark.parametrize("via", ["front", "stream", "explain"])
def test_a_scheduler_rejection_is_a_429_with_retry_after_and_reaches_no_engine(
        via: str) -> None:
    async def main() -> None:
        strict = {"policy": "conductor", "slo": {"ttft_s": 1e-9}}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], conductor=strict)], retry_after_s=7) as gw:
            body = _c(stream=True) if via == "stream" else _c()
            status, headers, raw = await gw.post(
                CMPL, body, {"x-conductor-explain": "1"} if via == "explain" else None)
            assert status == 429, raw
            assert headers["Retry-After"] == "7"
            err = json.loads(raw)["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "ttft_slo")
            assert p0.calls == [] and d0.calls == []
            metrics = await gw.text("/metrics")
            assert f'mooncake_gateway_rejections_total{{model="{MODEL}",reason="ttft-slo"}} 1.0' \
                in metrics
            assert (f'mooncake_gateway_requests_total{{endpoint="completions",model="{MODEL}",'
                    'outcome="rejected"} 1.0') in metrics
            # the gateway's own time to the 429: one, refused at once, within the last bucket
            assert (f'mooncake_gateway_rejection_seconds_count{{model="{MODEL}",'
                    'path="at-once"} 1.0') in metrics
            assert (f'mooncake_gateway_rejection_seconds_count{{model="{MODEL}",'
                    'path="after-hold"} 0.0') in metrics
            assert (f'mooncake_gateway_rejection_seconds_bucket{{le="60.0",model="{MODEL}",'
                    'path="at-once"} 1.0') in metrics

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_body_over_the_limit_is_a_413_and_reaches_no_engine(stream: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], max_body_bytes=2000) as gw:
            status, _h, raw = await gw.post(CMPL, _c(prompt=prompt_ids(500), stream=stream))
            assert status == 413, raw
            err = json.loads(raw)["error"]
            assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
            assert p0.calls == [] and d0.calls == []
            status, _h, raw = await gw.post(CMPL, _c(prompt=prompt_ids(50), stream=stream))
            assert status == 200, raw

    asyncio.run(main())


class _SmallDecode(ScriptedEngine):
    """A decode engine whose ``/metrics`` says it has KV room for 2 blocks (32 tokens): one
    request of 20 prompt + 4 output tokens at a time."""

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text='vllm:cache_config_info{block_size="16",num_gpu_blocks="2"} 1',
                            content_type="text/plain")


@pytest.mark.parametrize("holding", [True, False], ids=["holding", "no-holding"])
def test_a_request_refused_for_decode_room_waits_for_it_with_holding(holding: bool) -> None:
    """The first request decodes (its answer held back); the second finds no decode room.
    With holding it waits, reaches no engine, and is served once the first ends; without,
    it is a 429 ``tbt_slo`` at once."""
    async def main() -> None:
        d0 = await _SmallDecode("d0").start()
        d0.hold = asyncio.Event()
        conductor: dict[str, Any] = {"policy": "conductor",
                                     "holding": {"enabled": holding}}
        try:
            async with engines("p0") as (p0,), running_gateway(
                    [model([p0], [d0], conductor=conductor)], metrics_interval_s=0.05) as gw:
                async def scraped() -> bool:
                    st = await gw.state()
                    return bool(st["decode"][0]["engine"].get("num_gpu_blocks") == 2)
                await until(scraped)
                first = asyncio.ensure_future(gw.post(CMPL, _c()))
                await until(lambda: _asyncly(bool(d0.calls)))
                second = asyncio.ensure_future(gw.post(CMPL, _c(prompt=prompt_ids(21))))
                if not holding:
                    status, _h, raw = await second
                    assert status == 429, raw
                    assert json.loads(raw)["error"]["code"] == "tbt_slo"
                else:
                    await asyncio.sleep(0.3)
                    assert not second.done()
                    assert len(p0.calls) + len(d0.calls) == 2  # the first's, nothing more
                d0.hold.set()
                assert (await first)[0] == 200
                if holding:
                    status, _h, raw = await second
                    assert status == 200, raw
                    metrics = await gw.text("/metrics")
                    assert (f'mooncake_gateway_held_total{{model="{MODEL}",outcome="placed"}}'
                            ' 1.0') in metrics
        finally:
            await d0.stop()

    asyncio.run(main())


async def _asyncly(value: bool) -> bool:
    return value
