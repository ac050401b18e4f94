"""The prefill half of a P/D request against scripted engines over real HTTP: the
measured prefill time handed to the Conductor's calibration (in modelled seconds, only
for answered prefills), the engine's usage counted with its defaults, the decode's
``kv_transfer_params`` when the prefill's answer carries none usable, and both HTTP
clients (the lean one and aiohttp) sending JSON and naming what failed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from mooncake_conductor.engine import CalibrationConfig

from .scripted import MODEL, Call, ScriptedEngine, engines, model, prompt_ids, running_gateway

CMPL = "/v1/completions"
DELAY_S = 0.3
#: the gateway's own time around an engine call (HTTP on loopback, a loaded 2-core host)
OVERHEAD_S = 2.0
#: a prompt whose predicted prefill (about 0.2 s) keeps one calibration step well inside
#: the scale's clamp even with OVERHEAD_S on top
LONG_PROMPT = 2048


def _body(first: int, stream: bool = False, n: int = 40) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(n, first), "max_tokens": 3,
            "stream": stream}


def _prefill_answer(engine: ScriptedEngine, call: Call, **fields: Any) -> web.Response:
    """The scripted prefill answer with ``fields`` replaced (``None``: left out)."""
    body = engine.decode_json(call)
    body["kv_transfer_params"] = engine.kv_transfer_params
    body["usage"] = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                     "prompt_tokens_details": {"cached_tokens": 32}}
    for k, v in fields.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return web.json_response(body)


@pytest.mark.parametrize("time_scale", [1.0, 0.5])
def test_a_prefill_time_calibrates_the_model_in_modelled_seconds(
        time_scale: float) -> None:
    """p0 answers its prefill after DELAY_S: the Conductor's prefill scale takes one step
    (its calibration rate) towards the modelled time (wall / time_scale) over the
    placement's predicted TTFT. A refused prefill on p1 (retried on p0) is not observed."""
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])], time_scale=time_scale) as gw:
            async def slow(_request: web.Request, call: Call) -> web.StreamResponse:
                if not call.is_prefill:
                    return web.json_response(p0.decode_json(call))
                await asyncio.sleep(DELAY_S)
                return _prefill_answer(p0, call)

            async def refuse(_request: web.Request, _call: Call) -> web.StreamResponse:
                return web.json_response({"error": {"message": "busy"}}, status=503)
            p0.answer = slow
            p1.answer = refuse
            status, _h, raw = await gw.post(CMPL, _body(1, n=LONG_PROMPT))
            assert status == 200, raw
            [rec] = await gw.get(f"/conductor/decisions?model={MODEL}")
            last = rec["attempts"][-1]
            assert (last["prefill"], last["status"]) == ("p0", 200)
            predicted = rec["predicted"]["ttft_s"]
            assert predicted > 0.05
            # what the calibration learnt from, in the decision: modelled seconds
            assert last["predicted_s"] == pytest.approx(predicted)
            assert DELAY_S / time_scale <= last["answered_s"] <= \
                (DELAY_S + OVERHEAD_S) / time_scale
            cal = (await gw.state())["calibration"]
            assert cal["observed_prefills"] == 1
            rate = CalibrationConfig().rate
            low = (DELAY_S / time_scale / predicted) ** rate
            high = ((DELAY_S + OVERHEAD_S) / time_scale / predicted) ** rate
            assert high < CalibrationConfig().max_scale  # the bounds stay clear of the clamp
            assert low <= cal["prefill_scale"] <= high, (cal, low, high)
            assert len(p1.calls) == (1 if rec["attempts"][0]["prefill"] == "p1" else 0)

    asyncio.run(main())


@pytest.mark.parametrize("usage, cached, prompt", [
    ({"prompt_tokens": 70, "completion_tokens": 1, "total_tokens": 71}, 0, 70),
    ({"prompt_tokens_details": None}, 0, 40),
    ({"prompt_tokens_details": {"cached_tokens": 16}, "prompt_tokens": 0}, 16, 40),
    (None, 0, 40),
], ids=["no-details", "null-details", "zero-prompt-tokens", "no-usage"])
def test_the_engine_usage_is_counted_with_its_defaults(usage: Any, cached: int,
                                                       prompt: int) -> None:
    """What the prefill engine says it had cached and computed; a missing count of cached
    tokens is none, a missing (or zero) prompt count is the gateway's own."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            async def answer(_request: web.Request, call: Call) -> web.StreamResponse:
                return _prefill_answer(p0, call, usage=usage)
            p0.answer = answer
            status, _h, raw = await gw.post(CMPL, _body(2))
            assert status == 200, raw
            [rec] = await gw.get(f"/conductor/decisions?model={MODEL}")
            assert rec["engine_cached_tokens"] == cached
            tokens = (await gw.state())["tokens"]
            assert (tokens["engine_cached"], tokens["engine_prompt"]) == (cached, prompt)
            metrics = await gw.text("/metrics")
            assert (f'mooncake_gateway_engine_cached_tokens_total{{model="{MODEL}"}} '
                    f'{float(cached)}') in metrics

    asyncio.run(main())


@pytest.mark.parametrize("kvp", [None, [1, 2], "params", {"remote_host": "10.0.0.9"}],
                         ids=["missing", "list", "string", "another-connector"])
def test_whatever_the_prefill_answers_the_decode_gets_the_handshake(kvp: Any) -> None:
    """vLLM's MooncakeConnector answers no parameters: the decode half's come from the
    handshake (the prefill engine that served it, the transfer id it was sent), never from
    the prefill's answer."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            async def answer(_request: web.Request, call: Call) -> web.StreamResponse:
                return _prefill_answer(p0, call, kv_transfer_params=kvp)
            p0.answer = answer
            for first, stream in ((3, False), (4, True)):
                status, _h, raw = await gw.post(CMPL, _body(first, stream))
                assert status == 200, raw
                sent = p0.prefills[-1].body["kv_transfer_params"]
                assert d0.decodes[-1].body["kv_transfer_params"] == {
                    "do_remote_decode": False, "do_remote_prefill": True,
                    "remote_engine_id": "p0", "remote_bootstrap_addr": p0.url,
                    "transfer_id": sent["transfer_id"]}

    asyncio.run(main())


@pytest.mark.parametrize("lean, refused", [(True, "ConnectionRefusedError"),
                                           (False, "ClientConnectorError")],
                         ids=["lean-client", "aiohttp-client"])
def test_both_clients_send_json_and_name_what_failed(lean: bool, refused: str) -> None:
    """Prefill and unary decode go out as JSON through the lean client or, with it off,
    through aiohttp; an engine out of reach is named with the client's error."""
    async def main() -> None:
        seen: list[tuple[str, str, str | None]] = []
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])], lean_upstream=lean) as gw:
            def recording(engine: ScriptedEngine) -> Any:
                async def answer(request: web.Request, call: Call) -> web.StreamResponse:
                    seen.append((engine.name, request.content_type,
                                 request.headers.get("Accept")))
                    if call.is_prefill:
                        return _prefill_answer(engine, call)
                    return web.json_response(engine.decode_json(call))
                return answer
            for e in (p0, p1, d0):
                e.answer = recording(e)
            status, _h, raw = await gw.post(CMPL, _body(5))
            assert status == 200, raw
            assert len(seen) == 2 and {c for _n, c, _a in seen} == {"application/json"}
            if lean:  # aiohttp sends its own Accept
                assert {a for _n, _c, a in seen} == {"*/*"}
            assert json.loads(raw)["choices"][0]["text"] == "decoded by d0"
            await p0.stop()
            await p1.stop()
            status, _h, raw = await gw.post(CMPL, _body(6))
            assert status == 502, raw
            recs = await gw.get(f"/conductor/decisions?model={MODEL}")
            attempts = recs[-1]["attempts"]
            assert sorted(a["prefill"] for a in attempts) == ["p0", "p1"]
            assert {a["error"] for a in attempts} == {refused}
            assert json.loads(raw)["error"]["message"] == (
                f"prefill failed on every instance tried ({attempts[-1]['prefill']}: "
                f"{refused})")

    asyncio.run(main())


def test_refusals_on_every_prefill_instance_name_the_last_one() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0])]) as gw:
            p0.status = p1.status = 503
            status, _h, raw = await gw.post(CMPL, _body(7))
            assert status == 502, raw
            [rec] = await gw.get(f"/conductor/decisions?model={MODEL}")
            tried = [a["prefill"] for a in rec["attempts"]]
            assert sorted(tried) == ["p0", "p1"]
            assert [(a["prefill"], a["status"]) for a in rec["attempts"]] == \
                [(n, 503) for n in tried]
            err = json.loads(raw)["error"]
            assert (err["message"], err["code"]) == (
                f"prefill failed on every instance tried ({tried[-1]}: HTTP 503)",
                "upstream_failed")
            assert d0.calls == []

    asyncio.run(main())


@pytest.mark.parametrize("lean", [True, False], ids=["lean-client", "aiohttp-client"])
def test_an_engine_error_that_is_not_json_is_named_by_its_status(lean: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], lean_upstream=lean) as gw:
            async def plain(_request: web.Request, _call: Call) -> web.StreamResponse:
                return web.Response(status=418, text="<html>teapot</html>",
                                    content_type="text/html")
            for engine in (p0, d0):
                engine.answer = plain
                status, _h, raw = await gw.post(CMPL, _body(8 + len(engine.calls)))
                assert status == 418, raw
                assert json.loads(raw)["error"]["message"] == "engine answered HTTP 418"
                engine.answer = None

    asyncio.run(main())
