"""The replay's counters across gateway restarts (``replay.CounterIncrease``): a total is
never negative, a restart loses at most what was counted since the last read, and a
counter owner seen late is counted from its first read or, if it started during the run,
from zero."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_gateway.replay import COUNTERS, CounterIncrease

STARTED = 1000.0


def _state(owner: str, since: float, prefill_s: float, prompt: int = 0) -> dict[str, Any]:
    tokens = dict.fromkeys(COUNTERS, 0.0)
    tokens.update(prefill_seconds=prefill_s, prompt=prompt, engine_prompt=prompt,
                  engine_cached=prompt // 2)
    return {"policy": "conductor", "counters": {"id": owner, "since": since},
            "tokens": tokens}


def test_a_restart_mid_run_counts_from_zero_and_never_goes_negative() -> None:
    c = CounterIncrease(STARTED)
    c.add(_state("a", 10.0, 1200.0, 50_000))  # before the run: a long-lived gateway
    c.add(_state("a", 10.0, 1230.0, 51_000))
    # the gateway restarts: its counters start again from zero under a new owner
    c.add(_state("b", STARTED + 40, 5.0, 300))
    c.add(_state("b", STARTED + 40, 12.0, 700))
    got = c.total()
    assert got["prefill_seconds"] == pytest.approx(30.0 + 12.0)  # not 12 - 1200 = -1188
    assert got["prompt"] == 1000 + 700
    assert got["engine_cached"] == 500 + 350
    assert c.policy == "conductor"


def test_a_replica_first_seen_mid_run_counts_from_its_first_read() -> None:
    c = CounterIncrease(STARTED)
    c.add(_state("a", 10.0, 100.0))
    c.add(_state("r2", 20.0, 400.0))  # up before the run; its earlier counts are not ours
    c.add(_state("r2", 20.0, 410.0))
    c.add(_state("a", 10.0, 103.0))
    assert c.total()["prefill_seconds"] == pytest.approx(3.0 + 10.0)


def test_an_old_gateway_without_owner_ids_still_reads_as_before() -> None:
    c = CounterIncrease(STARTED)
    before, after = _state("", 0.0, 7.0, 100), _state("", 0.0, 9.5, 160)
    for s in (before, after):
        del s["counters"]
        c.add(s)
    assert c.total()["prefill_seconds"] == pytest.approx(2.5)
    assert c.total()["prompt"] == 60


def test_two_replicas_behind_one_address_are_both_counted() -> None:
    """Behind a Service a keep-alive connection stays on one gateway: the replay reads the
    state on new connections, so both replicas have a first and a last read. Here each
    new connection reaches the other replica, and each replica counts 10 prompt tokens
    per completion it serves."""
    import asyncio

    from aiohttp import web
    from mooncake_gateway.replay import ReplayConfig, replay
    from mooncake_sim.trace import TraceRecord

    from .scripted import serving

    served = {"a": 0, "b": 0}
    turn: dict[int, str] = {}  # client port -> replica

    def replica(request: web.Request) -> str:
        peer = request.transport.get_extra_info("peername")[1] if request.transport else 0
        if peer not in turn:
            turn[peer] = "ab"[len(turn) % 2]
        return turn[peer]

    async def state(request: web.Request) -> web.Response:
        r = replica(request)
        tokens = dict.fromkeys(COUNTERS, 0.0)
        # replica b hits its cache on every token, a on none: the hit ratio tells whose
        # counts were read
        tokens.update(prompt=10.0 * served[r], engine_prompt=10.0 * served[r],
                      engine_cached=10.0 * served[r] if r == "b" else 0.0)
        return web.json_response({"models": [{
            "policy": "conductor", "counters": {"id": r, "since": 0.0}, "tokens": tokens}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        served[replica(request)] += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3):
            await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/conductor/state", state)
        app.router.add_post("/v1/completions", completions)
        async with serving(app) as url:
            records = [TraceRecord(timestamp_ms=10.0 * i, input_length=16, output_length=2,
                                   hash_ids=[i]) for i in range(6)]
            return await replay(records, ReplayConfig(url=url, model="m", speed=100.0))

    res = asyncio.run(main())
    assert res["completed"] == 6
    assert served["a"] > 0 and served["b"] > 0, served  # six at once: several connections
    # every completion counted, whichever replica served it
    assert res["token_hit_ratio"] == pytest.approx(served["b"] / 6)
