"""``ReplayConfig.keep_outcomes`` and ``on_start``: every request's outcome with its send
and end times (what the chaos suite bins per second), against a stub gateway."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from mooncake_cli.main import main
from mooncake_gateway.replay import ReplayConfig, replay
from mooncake_sim.trace import TraceRecord

from .scripted import serving

#: the stub gateway's ``/conductor/state``: one model, counters that never move
STATE = {"models": [{"policy": "stub", "counters": {"id": "x", "since": 0.0},
                     "tokens": {"prompt": 0, "reused_predicted": 0, "engine_prompt": 0,
                                "engine_cached": 0, "prefill_seconds": 0.0}}]}


async def _conductor_state(_r: web.Request) -> web.Response:
    return web.json_response(STATE)


def _replay_three(completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
                  **cfg: Any) -> dict[str, Any]:
    """Three requests 0.1 s apart (each prompt one block of its own) replayed against
    a stub gateway answering completions with ``completions``; every outcome kept."""
    records = [TraceRecord(timestamp_ms=i * 100.0, input_length=32, output_length=4,
                           hash_ids=(i + 1,)) for i in range(3)]

    async def main() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/conductor/state", _conductor_state)
        app.router.add_post("/v1/completions", completions)
        async with serving(app) as url:
            return await replay(records, ReplayConfig(
                url=url, model="m", speed=1.0, keep_outcomes=True, **cfg))

    return asyncio.run(main())


def test_replay_keeps_each_requests_outcome_and_times() -> None:
    """A stub gateway: the first prompt streams two tokens, the second is refused with
    429, the third gets an SSE error."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        first = body["prompt"][0]
        kind = seen.setdefault(first, len(seen))
        if kind == 1:
            return web.json_response({"error": "busy"}, status=429)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if kind == 2:
            await resp.write(b'data: {"error": {"message": "engine gone"}}\n\n')
            return resp
        for text in ("a", "b"):
            chunk = {"choices": [{"text": text}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    seen: dict[int, int] = {}
    starts: list[float] = []
    res = _replay_three(completions, on_start=starts.append)
    assert len(starts) == 1
    outs = res["outcomes"]
    assert [o["status"] for o in outs] == ["ok", "rejected", "failed"]
    assert (res["completed"], res["rejected"], res["failed"]) == (1, 1, 1)
    assert "engine gone" in outs[2]["error"]
    for i, o in enumerate(outs):
        assert abs(o["sent_s"] - i * 0.1) < 0.08, o
        assert o["done_s"] >= o["sent_s"]
    assert outs[0]["ttft_s"] > 0 and math.isnan(outs[1]["ttft_s"])


def test_replay_sends_again_only_what_got_no_answer() -> None:
    """A gateway that dies before answering loses nothing the client sends again, as the
    OpenAI client does; one that dies mid-stream loses that stream, never sent twice.

    Prompt 1 is cut off before any answer on its first two sends, then served; prompt 2
    streams a token and is cut off; prompt 3 is cut off on every send."""
    sends: dict[int, int] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        first = body["prompt"][0]
        kind = order.setdefault(first, len(order))
        sends[kind] = sends.get(kind, 0) + 1
        resp = web.StreamResponse()
        if (kind == 0 and sends[kind] <= 2) or kind == 2:
            assert request.transport is not None
            request.transport.abort()  # gone before the status line
            return resp
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if kind == 1:
            await asyncio.sleep(0.01)
            assert request.transport is not None
            request.transport.abort()  # gone mid-stream
            return resp
        await resp.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
        return resp

    order: dict[int, int] = {}
    res = _replay_three(completions, retries=2, retry_delay_s=0.05)
    outs = res["outcomes"]
    assert [o["status"] for o in outs] == ["ok", "failed", "failed"]
    assert [o["retries"] for o in outs] == [2, 0, 2]
    assert sends == {0: 3, 1: 1, 2: 3}
    assert outs[0]["ttft_s"] >= 0.05 + 0.1  # the waits before each send count in TTFT
    assert outs[2]["error"] == "ServerDisconnectedError"
    assert res["retried"] == 2 and res["failed"] == 2


@pytest.mark.parametrize("flag", [["--retries", "-1"], ["--counter-sample", "-1"]])
def test_replay_refuses_negative_counts(flag: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--url", "http://127.0.0.1:9", *flag]) == 2
    assert "--counter-sample and --retries must be 0 or positive" in capsys.readouterr().err
