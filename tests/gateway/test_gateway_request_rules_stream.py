"""Streamed decodes and decode retries against scripted engines over real HTTP: what the
decode engine gets (a JSON request), SSE events cut anywhere between the engine's writes,
the TTFT and TBT of a stream in seconds, the cause of a decode that could not be
reached, and which decode instance a retry goes to (the least loaded one left, of the
prefill's group, also without a prefill)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from .scripted import (
    MODEL,
    Call,
    ScriptedEngine,
    engines,
    model,
    prompt_ids,
    running_gateway,
    until,
)

CMPL = "/v1/completions"


def _body(first: int = 1, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(40, first), "max_tokens": 4,
            "stream": stream}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_sse_events_cut_between_writes_are_read_whole() -> None:
    """The engine writes its events in pieces cut inside events (``[DONE]`` too): the
    client gets the bytes as they came, the stream is complete (no error event), and the
    gateway times the first token and the gaps between the next ones."""
    pieces = [b'data: {"choices": [{"text": "a"}]}\n', b'\ndata: {"choi',
              b'ces": [{"text": "b"}]}\n\ndata: {"choices": [{"text": "c"}]}\n\n',
              b'data: {"choices": [{"text": "d"}]}\n\ndata: [DO', b"NE]\n\n"]
    seen: list[str] = []

    async def answer(request: web.Request, call: Call) -> web.StreamResponse:
        seen.append(request.content_type)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in pieces:
            await resp.write(p)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            d0.answer = answer
            status, headers, raw = await gw.post(CMPL, _body())
            assert status == 200
            assert headers["Content-Type"] == "text/event-stream"
            assert headers["Cache-Control"] == "no-cache"
            assert raw == b"".join(pieces)
            assert seen == ["application/json"]
            m = _samples(await gw.text("/metrics"))
            labels = (("model", MODEL),)
            assert m[("mooncake_gateway_time_to_first_token_seconds_count", labels)] == 1
            assert 0 < m[("mooncake_gateway_time_to_first_token_seconds_sum", labels)] < 30
            # b, c and d each after the one before: three gaps of at least 0 s, in all
            # about the time the engine took between its writes
            assert m[("mooncake_gateway_time_between_tokens_seconds_count", labels)] == 3
            assert 0 <= m[("mooncake_gateway_time_between_tokens_seconds_sum", labels)] < 30
            st = await gw.state()
            assert st["decode"][0]["healthy"]

    asyncio.run(main())


def test_a_decode_engine_out_of_reach_is_named_with_the_cause() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            await d0.stop()
            for stream in (True, False):
                status, _h, raw = await gw.post(CMPL, _body(2, stream))
                assert status == 502, raw
                err = json.loads(raw)["error"]
                assert err["code"] == "upstream_failed"
                cause = err["message"].removeprefix("decode failed (d0: ").removesuffix(")")
                # the client's error: aiohttp's for a stream, the lean client's otherwise
                assert cause == ("ClientConnectorError" if stream
                                 else "ConnectionRefusedError"), err
                got = (await gw.get(f"/conductor/decisions?model={MODEL}"))[-1]
                assert {"decode": "d0", "error": cause} in got["attempts"]

    asyncio.run(main())


class LoadedEngine(ScriptedEngine):
    """A scripted engine whose ``/metrics`` says how many requests wait there."""

    def __init__(self, name: str, waiting: int) -> None:
        super().__init__(name)
        self.waiting = waiting

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_waiting {self.waiting}\n",
                            content_type="text/plain")


async def _loaded(waits: list[int]) -> list[LoadedEngine]:
    out = [LoadedEngine(f"d{i}", w) for i, w in enumerate(waits)]
    for e in out:
        await e.start()
    return out


def test_a_failed_decode_goes_to_the_least_loaded_other_instance() -> None:
    async def main() -> None:
        waits = [0, 5, 3, 4]
        decodes = await _loaded(waits)

        async def refuse_once(_request: web.Request, _call: Call) -> web.StreamResponse:
            for d in decodes:
                d.answer = None  # the next calls are answered as usual
            return web.json_response({"error": {"message": "busy"}}, status=503)
        try:
            for direct, stream in ((False, False), (True, True)):
                extra = {"direct": {"uncached_tokens_below": 100_000}} if direct else {}
                async with engines("p0") as (p0,), running_gateway(
                        [model([p0], decodes, **extra)], metrics_interval_s=0.05) as gw:
                    async def scraped() -> bool:
                        st = await gw.state()
                        return [d["engine"]["waiting"] for d in st["decode"]] == waits
                    await until(scraped)
                    for d in decodes:
                        d.calls.clear()
                        d.answer = refuse_once
                    status, _h, raw = await gw.post(CMPL, _body(3, stream))
                    assert status == 200, raw
                    tried = [i for i, d in enumerate(decodes) if d.calls]
                    assert len(tried) == 2, tried
                    # which one refused: the one asked first
                    refused = min(tried, key=lambda i: decodes[i].calls[0].at)
                    retry = next(i for i in tried if i != refused)
                    others = [i for i in range(len(waits)) if i != refused]
                    assert retry == min(others, key=lambda i: (waits[i], i)), (refused, retry)
                    assert len(p0.calls) == (0 if direct else 1)
        finally:
            for d in decodes:
                await d.stop()

    asyncio.run(main())


def test_a_stream_without_done_ends_with_an_openai_error_event() -> None:
    async def answer(request: web.Request, call: Call) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "half"}]}\n\n')
        await resp.write_eof()
        return resp

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])], unhealthy_after=1) as gw:
            d0.answer = answer
            status, _h, raw = await gw.post(CMPL, _body(4))
            assert status == 200
            assert raw.endswith(b"\n\n")
            first, last = _events(raw)
            assert first == b'data: {"choices": [{"text": "half"}]}'
            assert last.startswith(b"data: ")
            assert json.loads(last[len(b"data: "):]) == {"error": {
                "message": "decode failed mid-stream on d0: UpstreamError",
                "type": "upstream_error", "param": None, "code": "upstream_failed"}}
            st = await gw.state()
            assert not st["decode"][0]["healthy"]  # the failure counted against it

    asyncio.run(main())


def test_an_explained_answer_is_json_and_one_that_is_no_object_is_a_502() -> None:
    async def not_an_object(_request: web.Request, _call: Call) -> web.StreamResponse:
        return web.json_response(["not", "an", "object"])

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            explain = {"x-conductor-explain": "1"}
            status, headers, raw = await gw.post(CMPL, _body(5, False), explain)
            assert status == 200, raw
            assert headers["Content-Type"].split(";")[0] == "application/json"
            body = json.loads(raw)
            assert body["conductor"]["decode"] == "d0"
            assert {k: v for k, v in body.items() if k != "conductor"} == \
                d0.decode_json(d0.decodes[0])
            # without explain the answer goes back as it came, with explain it cannot
            d0.answer = not_an_object
            status, _h, raw = await gw.post(CMPL, _body(6, False))
            assert (status, json.loads(raw)) == (200, ["not", "an", "object"])
            status, _h, raw = await gw.post(CMPL, _body(7, False), explain)
            assert status == 502
            assert json.loads(raw)["error"]["message"] == \
                "decode failed (d0: answer is not a JSON object)"

    asyncio.run(main())


def test_prefill_engines_out_of_reach_are_named_in_the_502() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0])]) as gw:
            await p0.stop()
            await p1.stop()
            status, _h, raw = await gw.post(CMPL, _body(8, False))
            assert status == 502
            err = json.loads(raw)["error"]
            got = (await gw.get(f"/conductor/decisions?model={MODEL}"))[-1]
            tried = [a["prefill"] for a in got["attempts"]]
            assert sorted(tried) == ["p0", "p1"]
            assert got["attempts"] == [{"prefill": n, "error": "ConnectionRefusedError"}
                                       for n in tried]
            assert err["message"] == \
                f"prefill failed on every instance tried ({tried[-1]}: ConnectionRefusedError)"
            assert d0.calls == []

    asyncio.run(main())


def test_a_direct_request_reaches_decode_as_the_client_sent_it() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], direct={"uncached_tokens_below": 100_000})]) as gw:
            for stream in (False, True):
                raw = json.dumps(_body(9, stream), indent=2).encode()
                status, _h, _b = await gw.post(CMPL, raw)
                assert status == 200
                assert d0.decodes[-1].raw == raw  # no kv_transfer_params added
            assert p0.calls == []

    asyncio.run(main())


def test_a_decode_retry_after_a_prefill_stays_in_the_prefill_group() -> None:
    async def main() -> None:
        async with engines("p0", "e0", "d0", "d1") as (p0, e0, d0, d1):
            first: list[ScriptedEngine] = []

            async def refuse_once(_request: web.Request, call: Call) -> web.StreamResponse:
                for d in (e0, d0, d1):
                    d.answer = None
                first.append(next(d for d in (e0, d0, d1) if call in d.calls))
                return web.json_response({"error": {"message": "busy"}}, status=503)
            # e0 is of another revision (another engine group) and first in the list
            doc = model([p0.endpoint(revision="r1")],
                        [e0.endpoint(revision="r2"), d0.endpoint(revision="r1"),
                         d1.endpoint(revision="r1")])
            async with running_gateway([doc]) as gw:
                for d in (e0, d0, d1):
                    d.answer = refuse_once
                status, _h, raw = await gw.post(CMPL, _body(10, False))
                assert status == 200, raw
                assert first and first[0] in (d0, d1)
                other = d1 if first[0] is d0 else d0
                assert (len(first[0].calls), len(other.calls), len(e0.calls)) == (1, 1, 0)

    asyncio.run(main())
