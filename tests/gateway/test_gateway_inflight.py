"""The Conductor's view of requests in flight, read from ``/conductor/state`` while
scripted prefill engines hold their answers: per prefill instance the in-flight and
queued prefills and the blocks they will have written (pending prefixes), per decode
instance the requests it was chosen for; all of it gone once the engines answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .scripted import BLOCK, MODEL, engines, model, prompt_ids, running_gateway, until

# long enough that the predicted prefills (about 2 s each under the paper's cost model)
# outlast the reads below on a loaded host: at 1024 tokens (0.13 s) the predicted wait
# had run out before the state was read
PROMPT_TOKENS = 16_384
REQUESTS = 4


def _view(st: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(p["inflight"], p["queued"], p["pending_blocks"]) for p in st["prefill"]]


def test_in_flight_prefills_and_pending_prefixes_show_per_instance_until_answered() -> None:
    """Every prefill sent at once (``prefill_dispatch_depth`` 0: no late binding, so the
    engines hold all of them; tests/gateway/test_gateway_late_binding.py holds them in
    the gateway)."""
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0])], prefill_dispatch_depth=0) as gw:
            p0.hold, p1.hold, d0.hold = asyncio.Event(), asyncio.Event(), asyncio.Event()
            bodies = [{"model": MODEL, "prompt": prompt_ids(PROMPT_TOKENS, first=i + 1),
                       "max_tokens": 3} for i in range(REQUESTS)]
            sent = [asyncio.create_task(gw.post("/v1/completions", b)) for b in bodies]

            async def all_arrived() -> bool:
                return len(p0.calls) + len(p1.calls) == REQUESTS
            await until(all_arrived)
            blocks = PROMPT_TOKENS // BLOCK
            n0, n1 = len(p0.calls), len(p1.calls)
            st = await gw.state()
            assert _view(st) == [(n0, n0, n0 * blocks), (n1, n1, n1 * blocks)]
            for p, n in zip(st["prefill"], (n0, n1), strict=True):
                assert (p["predicted_wait_s"] > 0) == (n > 0)
            # the decode instance counts them from the decision on, before decoding
            assert st["decode"][0]["inflight"] == REQUESTS
            assert st["decode"][0]["batch"] == 0 and d0.calls == []
            # the requests a prefill instance has in flight are the ones it got
            held = await gw.get(f"/conductor/decisions?model={MODEL}")
            assert sorted(d["prefill"] for d in held) == sorted(["p0"] * n0 + ["p1"] * n1)

            first, second = (p0, p1) if n0 else (p1, p0)
            assert first.hold is not None and second.hold is not None
            first.hold.set()  # one instance answers; the other's stay in flight

            async def first_done() -> bool:
                return _view(await gw.state())[0 if first is p0 else 1] == (0, 0, 0)
            await until(first_done)
            st = await gw.state()
            rest = len(second.calls)
            assert _view(st)[1 if first is p0 else 0] == (rest, rest, rest * blocks)
            second.hold.set()

            async def decoding() -> bool:
                return len(d0.calls) == REQUESTS
            await until(decoding)  # every prefill answered; the decode engine holds
            st = await gw.state()
            assert _view(st) == [(0, 0, 0), (0, 0, 0)]
            d = st["decode"][0]
            assert (d["inflight"], d["batch"]) == (REQUESTS, REQUESTS)
            assert d["context_tokens"] == REQUESTS * PROMPT_TOKENS
            assert d["reserved_tokens"] == REQUESTS * 3
            d0.hold.set()
            results = await asyncio.gather(*sent)
            assert [r[0] for r in results] == [200] * REQUESTS
            for status, _h, raw in results:
                assert json.loads(raw)["choices"][0]["text"] == "decoded by d0", status
            st = await gw.state()
            assert _view(st) == [(0, 0, 0), (0, 0, 0)]
            assert (st["decode"][0]["inflight"], st["decode"][0]["batch"]) == (0, 0)
            assert st["decode"][0]["context_tokens"] == st["decode"][0]["reserved_tokens"] == 0

    asyncio.run(main())
