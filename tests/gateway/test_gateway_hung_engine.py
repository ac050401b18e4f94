"""A prefill engine that accepts connections and never answers (a hung process): once
its health checks fail it is marked down, and the prefill waiting on it is retried on
another instance within seconds, not after ``request_timeout_s``."""

from __future__ import annotations

import asyncio
import json
import time

from .scripted import engines, model, prompt_ids, running_gateway

#: health checks fast enough to mark an engine down in well under a second
HEALTH = {"health_interval_s": 0.1, "health_timeout_s": 0.2, "unhealthy_after": 2}
#: what the gateway would wait without the down signal
REQUEST_TIMEOUT_S = 300.0


def test_a_prefill_on_a_hung_engine_moves_on_when_it_is_marked_down() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])], request_timeout_s=REQUEST_TIMEOUT_S,
                **HEALTH) as gw:
            for e in (p0, p1):
                e.hold = asyncio.Event()  # neither answers until told
            body = {"model": "scripted", "prompt": prompt_ids(40), "max_tokens": 2}
            started = time.monotonic()
            sent = asyncio.create_task(gw.post("/v1/completions", body,
                                               {"x-conductor-explain": "1"}))
            await asyncio.wait_for(asyncio.wait(
                [asyncio.create_task(e.arrived.wait()) for e in (p0, p1)],
                return_when=asyncio.FIRST_COMPLETED), 10)
            hung, other = (p0, p1) if p0.calls else (p1, p0)
            hung.healthy = False  # its health checks fail from now on; it never answers
            assert other.hold is not None
            other.hold.set()
            status, _headers, raw = await asyncio.wait_for(sent, 20)
            waited = time.monotonic() - started
            assert status == 200, raw
            assert len(other.prefills) == 1 and len(d0.decodes) == 1
            attempts = json.loads(raw)["conductor"]["attempts"]
            assert attempts[0] == {"prefill": hung.name,
                                   "error": "marked down while the call waited"}, attempts
            assert waited < 5.0, waited  # the health checks' time, not request_timeout_s

    asyncio.run(main())
