"""Prefill → decode wiring of one request, against scripted engines over real HTTP.

What goes to the prefill engine (the client's body with ``max_tokens=1``, no stream and
the handshake's ``kv_transfer_params``: ``do_remote_decode`` and a transfer id), what
goes to the decode engine (the client's body intact plus the parameters that name the
prefill engine that served it and the same transfer id: vLLM's MooncakeConnector shape,
``mooncake_gateway.handshake``; checked against vLLM's own connector in
``tests/conformance``), what comes back to the client (the decode answer as it came), a
client's own ``kv_transfer_params`` refused, and a failed prefill or decode retried
elsewhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import pytest
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
)


def prefill_kvp(call: Call) -> dict[str, Any]:
    """What the prefill half must carry: the handshake's fields, with the transfer id the
    gateway chose (a fresh one per request)."""
    tid = call.body["kv_transfer_params"]["transfer_id"]
    assert isinstance(tid, str) and tid.startswith("xfer-") and len(tid) == 5 + 32
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}


def decode_kvp(prefill: Call, served_by: ScriptedEngine) -> dict[str, Any]:
    """What the decode half must carry: where to pull the prefill's transfer from."""
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": served_by.name,
            "remote_bootstrap_addr": served_by.url,  # no bootstrap port: the engine's own
            "transfer_id": prefill.body["kv_transfer_params"]["transfer_id"]}
EXPLAIN = {"x-conductor-explain": "1"}


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def _completion(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(100), "max_tokens": 7, "temperature": 0.5,
            "seed": 3, "user": "u-1", "stream": stream, "logprobs": None}


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "tell me " * 40}],
            "max_completion_tokens": 5, "temperature": 0.2, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


def _body(chat: bool, stream: bool) -> dict[str, Any]:
    return _chat(stream) if chat else _completion(stream)


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _the_one(*calls: list[Any]) -> Any:
    every = [c for cs in calls for c in cs]
    assert len(every) == 1, every
    return every[0]


@pytest.mark.parametrize("explain", [False, True], ids=["plain", "explain"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_decode_gets_the_client_body_and_exactly_the_prefill_kv_transfer_params(
        chat: bool, stream: bool, explain: bool) -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0])]) as gw:
            p1.kv_transfer_params = {"remote_block_ids": [9, 9]}  # what no engine says
            body = _body(chat, stream)
            sent = json.dumps(body, indent=1).encode() + b"\n"  # as no encoder of ours would
            status, headers, raw = await gw.post(_path(chat), sent,
                                                 EXPLAIN if explain else None)
            assert status == 200, raw
            prefill = _the_one(p0.prefills, p1.prefills, d0.prefills)
            served_by = p0 if p0.prefills else p1
            decode = _the_one(d0.decodes, p0.decodes, p1.decodes)
            assert d0.decodes == [decode]
            # the prefill: the client's request, one token, not streamed, remote decode
            want_prefill = {**body, "stream": False, "stream_options": None, "max_tokens": 1,
                            "kv_transfer_params": prefill_kvp(prefill)}
            if chat:
                want_prefill["max_completion_tokens"] = None
            assert prefill.path == decode.path == _path(chat)
            assert prefill.body == want_prefill
            # the decode: the client's request intact, plus where to pull the prefill's KV
            assert decode.body == {**body, "kv_transfer_params": decode_kvp(prefill, served_by)}
            # both spliced onto the client's bytes, not re-encoded
            assert prefill.raw.startswith(sent.rstrip()[:-1])
            assert decode.raw.startswith(sent.rstrip()[:-1])
            # the client: the decode answer as the engine sent it
            if stream:
                assert headers["Content-Type"].startswith("text/event-stream")
                assert headers["Cache-Control"] == "no-cache"
                assert raw == d0.sse(decode)
            elif explain:
                got = json.loads(raw)
                assert got.pop("conductor")["decode"] == "d0"
                assert got == d0.decode_json(decode)
            else:
                assert json.loads(raw) == d0.decode_json(decode)
            # a plain one is served by the fast front end (no aiohttp Server header); a
            # stream or an explained one by aiohttp
            assert ("Server" in headers) == (stream or explain)
            if explain:
                decision = json.loads(headers["x-conductor-decision"])
                assert decision["prefill"] == served_by.name and decision["decode"] == "d0"
            else:
                assert "x-conductor-decision" not in headers

    run(main())


# -- a client's own kv_transfer_params ---------------------------------------------------------
@pytest.mark.parametrize("explain", [False, True], ids=["plain", "explain"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_client_kv_transfer_params_is_refused_before_any_engine_call(
        chat: bool, stream: bool, explain: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            injected = {"do_remote_prefill": True, "remote_engine_id": "evil",
                        "remote_host": "10.0.0.66", "remote_port": 1, "remote_block_ids": [1]}
            body = {**_body(chat, stream), "kv_transfer_params": injected}
            status, headers, raw = await gw.post(_path(chat), body,
                                                 EXPLAIN if explain else None)
            assert status == 400, raw
            assert headers["Content-Type"].startswith("application/json")
            err = json.loads(raw)["error"]
            assert err["param"] == "kv_transfer_params"
            assert err["type"] == "invalid_request_error"
            assert "kv_transfer_params" in err["message"]
            assert p0.calls == [] and d0.calls == []
            # null is "not set": served, with the gateway's own handshake
            ok = {**_body(chat, stream), "kv_transfer_params": None}
            status, _h, raw = await gw.post(_path(chat), ok, EXPLAIN if explain else None)
            assert status == 200, raw
            prefill = p0.prefills[0]
            assert prefill.body["kv_transfer_params"] == prefill_kvp(prefill)
            assert d0.decodes[0].body["kv_transfer_params"] == decode_kvp(prefill, p0)

    run(main())


# -- retries -----------------------------------------------------------------------------------
ROUND_ROBIN = {"conductor": {"policy": "round-robin"}}


async def _refusing(e: ScriptedEngine, how: str) -> None:
    """Make ``e`` refuse completions: an HTTP 503, or nothing listening (its health
    already passed, and the gateway checks health rarely: it stays routable)."""
    if how == "503":
        e.status = 503
    else:
        await e.stop()


LEAN = pytest.mark.parametrize("lean", [True, False], ids=["lean", "aiohttp"])


@LEAN
@pytest.mark.parametrize("how", ["503", "refused"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_refused_decode_is_retried_on_the_other_decode_instance(stream: bool, how: str,
                                                                   lean: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d-bad", "d-good") as (p0, bad, good), running_gateway(
                [model([p0], [bad, good], **ROUND_ROBIN)], lean_upstream=lean) as gw:
            await _refusing(bad, how)
            for i in range(2):  # round robin: the first one tries d-bad first
                body = {**_completion(stream), "prompt": prompt_ids(64, first=i + 1)}
                status, _h, raw = await gw.post("/v1/completions", body)
                assert status == 200, raw
                served = good.decodes[-1]
                assert served.body == {**body, "kv_transfer_params":
                                       decode_kvp(p0.prefills[-1], p0)}
                if stream:
                    assert raw == good.sse(served)
                else:
                    assert json.loads(raw) == good.decode_json(served)
            assert len(good.decodes) == 2
            if how == "503":
                assert len(bad.decodes) == 1  # tried once, with the same body
                assert bad.decodes[0].body == good.decodes[0].body
            decisions = await gw.get(f"/conductor/decisions?model={MODEL}")
            first = decisions[0]
            assert first["decode"] == "d-good" and first["outcome"] == "ok"
            assert [a.get("decode") for a in first["attempts"] if "decode" in a] == ["d-bad"]
            assert first["attempts"][-1]["error"].startswith("HTTP 503" if how == "503" else "")
            st = await gw.state()
            assert [d["inflight"] for d in st["decode"]] == [0, 0]
            assert [d["batch"] for d in st["decode"]] == [0, 0]

    run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_every_decode_refusing_is_a_502_after_trying_each_once(stream: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0", "d1") as (p0, d0, d1), \
                running_gateway([model([p0], [d0, d1], **ROUND_ROBIN)]) as gw:
            d0.status = d1.status = 503
            status, _h, raw = await gw.post("/v1/completions", _completion(stream))
            assert status == 502, raw
            err = json.loads(raw)["error"]
            assert err["code"] == "upstream_failed" and "decode failed" in err["message"]
            assert len(d0.decodes) == len(d1.decodes) == 1

    run(main())


@LEAN
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_decode_engine_4xx_is_relayed_not_retried(stream: bool, lean: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0", "d1") as (p0, d0, d1), running_gateway(
                [model([p0], [d0, d1], **ROUND_ROBIN)], lean_upstream=lean) as gw:
            d0.status = 422
            status, _h, raw = await gw.post("/v1/completions", _completion(stream))
            assert status == 422, raw
            assert json.loads(raw)["error"]["message"] == "d0 says 422"
            assert len(d0.decodes) == 1 and d1.calls == []

    run(main())


@LEAN
@pytest.mark.parametrize("how", ["503", "refused"])
def test_a_refused_prefill_is_retried_and_decode_gets_the_retry_kv_transfer_params(
        how: str, lean: bool) -> None:
    async def main() -> None:
        async with engines("p-bad", "p-good", "d0") as (bad, good, d0), running_gateway(
                [model([bad, good], [d0], **ROUND_ROBIN)], lean_upstream=lean) as gw:
            await _refusing(bad, how)
            body = _completion(False)
            status, _h, raw = await gw.post("/v1/completions", body)
            assert status == 200, raw
            assert json.loads(raw) == d0.decode_json(d0.decodes[0])
            assert len(good.prefills) == 1
            if how == "503":
                assert len(bad.prefills) == 1
            # the retry's own transfer: the decode pulls from the engine that served it
            retried = good.prefills[0]
            assert d0.decodes[0].body == {**body, "kv_transfer_params":
                                          decode_kvp(retried, good)}
            if how == "503":
                assert bad.prefills[0].body["kv_transfer_params"]["transfer_id"] == \
                    retried.body["kv_transfer_params"]["transfer_id"]
            d = (await gw.get(f"/conductor/decisions?model={MODEL}"))[0]
            assert [a.get("prefill") for a in d["attempts"]] == ["p-bad", "p-good"]
            assert d["attempts"][-1]["status"] == 200
            st = await gw.state()
            assert [(p["inflight"], p["queued"], p["pending_blocks"]) for p in st["prefill"]] \
                == [(0, 0, 0), (0, 0, 0)]
            # a failed call does not calibrate the cost model: only the retry's answer
            assert st["calibration"]["observed_prefills"] == 1
            assert st["decode"][0]["inflight"] == 0

    run(main())


def test_every_prefill_refusing_is_a_502_and_nothing_reaches_decode() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0])]) as gw:
            p0.status = p1.status = 500
            status, _h, raw = await gw.post("/v1/completions", _completion(False))
            assert status == 502, raw
            err = json.loads(raw)["error"]
            assert err["code"] == "upstream_failed" and "prefill failed" in err["message"]
            assert len(p0.prefills) == len(p1.prefills) == 1 and d0.calls == []

    run(main())


def test_a_prefill_engine_4xx_is_relayed_and_nothing_reaches_decode() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0], **ROUND_ROBIN)]) as gw:
            p0.status = 400
            status, _h, raw = await gw.post("/v1/chat/completions", _chat(False))
            assert status == 400, raw
            assert json.loads(raw)["error"]["message"] == "p0 says 400"
            assert len(p0.prefills) == 1 and p1.calls == [] and d0.calls == []

    run(main())


# -- what a failure says about the engine ------------------------------------------------------
DOWN_AT_ONCE: dict[str, Any] = {"unhealthy_after": 1}


@pytest.mark.parametrize("how", ["503", "refused"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_refused_connection_marks_the_engine_down_an_http_error_does_not(
        role: str, how: str) -> None:
    """An engine that answers (even 503) is alive; one that cannot be reached is not."""
    async def main() -> None:
        async with engines("p-bad", "p-good", "d-bad", "d-good") as (pb, pg, db, dg):
            prefill, decode = ([pb, pg], [dg]) if role == "prefill" else ([pg], [db, dg])
            bad = pb if role == "prefill" else db
            async with running_gateway([model(prefill, decode, **ROUND_ROBIN)],
                                       **DOWN_AT_ONCE) as gw:
                await _refusing(bad, how)
                for i in range(3):
                    body = {**_completion(False), "prompt": prompt_ids(64, first=i + 1)}
                    status, _h, raw = await gw.post("/v1/completions", body)
                    assert status == 200, raw
                st = await gw.state()
                view = st[role][0]
                assert view["name"] == bad.name
                assert (view["healthy"], view["routable"]) == ((True, True) if how == "503"
                                                               else (False, False))
                # a 503 keeps it in the rotation (tried again); down, it is not
                decisions = await gw.get(f"/conductor/decisions?model={MODEL}")
                tried = [d["id"] for d in decisions
                         if any(a.get(role) == bad.name for a in d["attempts"])]
                if how == "503":
                    assert len(bad.calls) == len(tried) >= 2 and tried[0] == 1
                else:
                    assert tried == [1] and bad.calls == []

    run(main())


async def _truncated(request: web.Request, call: Call) -> web.StreamResponse:
    """A stream that stops after one event, without ``[DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "text": "half"}]}\n\n')
    await resp.write_eof()
    return resp


async def _reset(request: web.Request, call: Call) -> web.StreamResponse:
    """A stream whose connection breaks after one event."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "text": "half"}]}\n\n')
    assert request.transport is not None
    request.transport.abort()
    return resp


@pytest.mark.parametrize("answer", [_truncated, _reset], ids=["no-done", "reset"])
def test_a_decode_stream_that_breaks_ends_with_an_error_event_and_the_engine_down(
        answer: Any) -> None:
    async def main() -> None:
        async with engines("p0", "d0", "d1") as (p0, d0, d1), running_gateway(
                [model([p0], [d0, d1], **ROUND_ROBIN)], **DOWN_AT_ONCE) as gw:
            d0.answer = answer
            status, headers, raw = await gw.post("/v1/completions", _completion(True))
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
            first, *rest = [e for e in raw.split(b"\n\n") if e]
            assert first == b'data: {"choices": [{"index": 0, "text": "half"}]}'
            (last,) = rest  # no [DONE]: the client knows it did not complete
            err = json.loads(last[len(b"data: "):])["error"]
            assert err["code"] == "upstream_failed" and "d0" in err["message"]
            assert len(d0.decodes) == 1 and d1.calls == []  # too late to retry
            st = await gw.state()
            assert [(d["healthy"], d["routable"]) for d in st["decode"]] == \
                [(False, False), (True, True)]
            assert [d["inflight"] for d in st["decode"]] == [0, 0]
            # the next ones go to the other instance
            status, _h, raw = await gw.post("/v1/completions", _completion(True))
            assert status == 200 and raw == d1.sse(d1.decodes[0])

    run(main())


# -- what /metrics counts ----------------------------------------------------------------------
def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_metrics_count_outcomes_retries_tokens_and_stream_timings() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0", "d1") as (p0, p1, d0, d1), running_gateway(
                [model([p0, p1], [d0, d1], **ROUND_ROBIN)]) as gw:
            p0.status = d0.status = 503  # each tried first once, then the other
            body = _completion(False)
            assert (await gw.post("/v1/completions", body))[0] == 200
            p0.status = d0.status = 200
            assert (await gw.post("/v1/chat/completions", _chat(True)))[0] == 200
            assert (await gw.post("/v1/completions", {**body, "n": 2}))[0] == 400
            assert (await gw.post("/v1/completions", {**body, "model": "x"}))[0] == 404
            m = _samples(await gw.text("/metrics"))
            prefix = "mooncake_gateway_"

            def val(name: str, **labels: str) -> float:
                return m.get((prefix + name, tuple(sorted(labels.items()))), 0.0)
            assert val("requests_total", model=MODEL, endpoint="completions",
                       outcome="ok") == 1
            assert val("requests_total", model=MODEL, endpoint="chat", outcome="ok") == 1
            assert val("requests_total", model="unknown", endpoint="completions",
                       outcome="bad_request") == 1
            assert val("requests_total", model="unknown", endpoint="completions",
                       outcome="not_found") == 1
            assert val("retries_total", model=MODEL, role="prefill") == 1
            assert val("retries_total", model=MODEL, role="decode") == 1
            # two answered prefills, each: 100 prompt tokens, 32 of them cached
            assert val("engine_prompt_tokens_total", model=MODEL) == 200
            assert val("engine_cached_tokens_total", model=MODEL) == 64
            st = await gw.state()
            assert (st["tokens"]["engine_prompt"], st["tokens"]["engine_cached"]) == (200, 64)
            assert st["tokens"]["prompt"] == val("prompt_tokens_total", model=MODEL,
                                                 kind="computed") > 100
            # the stream: its first token is a TTFT, the second one a TBT; [DONE] neither
            assert val("time_to_first_token_seconds_count", model=MODEL) == 1
            assert val("time_between_tokens_seconds_count", model=MODEL) == 1
            assert val("decision_seconds_count", model=MODEL) == 2
            for role, name in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"),
                               ("decode", "d1")):
                assert val("instance_up", model=MODEL, role=role, instance=name) == 1
                assert val("instance_inflight", model=MODEL, role=role, instance=name) == 0
            # answered prefills per instance: p0's 503 is none
            assert val("instance_prefills_total", model=MODEL, instance="p0") == 1
            assert val("instance_prefills_total", model=MODEL, instance="p1") == 1

    run(main())
