"""The cap on request bytes held at once (``mooncake_gateway/bodies.py``): a body that
does not fit is refused with 503 before it is read, small requests pass beside a large
one, and every reservation comes back (served, refused, handed over, or abandoned)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from mooncake_gateway.bodies import BodyBudget
from mooncake_gateway.settings import GatewaySettings

from .scripted import MODEL, engines, model, prompt_ids, running_gateway

CMPL = "/v1/completions"
BODY_MAX = 4000
BUFFER_MAX = 6000


def test_a_budget_reserves_and_gives_back() -> None:
    b = BodyBudget(100)
    assert b.take(60) and b.take(40)
    assert not b.take(1) and b.refused == 1
    b.give(60)
    assert b.take(50) and b.held == 90 and b.peak == 100


def test_the_cap_must_hold_one_whole_body() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        GatewaySettings(max_body_bytes=1000, max_buffered_bytes=999)


def _padded(size: int, **fields: Any) -> bytes:
    """A valid completion body of exactly ``size`` bytes (JSON padded with spaces)."""
    raw = json.dumps({"model": MODEL, "prompt": prompt_ids(20), "max_tokens": 2, **fields})
    assert len(raw) <= size
    return (raw + " " * (size - len(raw))).encode()


async def _open(port: int, body: bytes, send: int) -> tuple[asyncio.StreamReader,
                                                            asyncio.StreamWriter]:
    """A raw connection that sent the head and the first ``send`` bytes of ``body``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:send])
    await writer.drain()
    return reader, writer


async def _status(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), 10)
    return int(line.split()[1])


@pytest.mark.parametrize("fast_front", [True, False], ids=["fast-front", "aiohttp"])
def test_a_body_that_does_not_fit_is_refused_before_it_is_read(fast_front: bool) -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], max_body_bytes=BODY_MAX,
                max_buffered_bytes=BUFFER_MAX, fast_front=fast_front) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            big = _padded(BODY_MAX)
            # a large body arriving slowly holds its reservation
            reader, writer = await _open(port, big, 100)
            await asyncio.sleep(0.2)
            for stream in (False, True):
                status, headers, raw = await gw.post(CMPL, _padded(3000, stream=stream))
                assert status == 503, raw
                err = json.loads(raw)["error"]
                assert (err["type"], err["code"]) == ("service_unavailable", "server_busy")
                assert headers["Retry-After"] == "1"
            assert d0.decodes == []  # refused before any engine call
            small, _h, raw = await gw.post(CMPL, _padded(500))
            assert small == 200, raw  # fits beside the large one
            # the large body completes and is served; its bytes come back
            writer.write(big[100:])
            await writer.drain()
            assert await _status(reader) == 200
            writer.close()
            status, _h, raw = await gw.post(CMPL, _padded(3000))
            assert status == 200, raw
            # a client that leaves mid-body gives its reservation back too
            reader, writer = await _open(port, big, 10)
            await asyncio.sleep(0.2)
            writer.close()
            await asyncio.sleep(0.2)
            status, _h, raw = await gw.post(CMPL, _padded(3000))
            assert status == 200, raw
            metrics = await gw.text("/metrics")
            assert "mooncake_gateway_buffered_request_bytes 0.0" in metrics
            assert "mooncake_gateway_buffer_refusals_total 2.0" in metrics

    asyncio.run(main())


def test_a_request_without_a_valid_key_reserves_nothing(tmp_path: Any) -> None:
    """Slow bodies of clients without a key cannot hold the cap: they get 401 unread."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "alice").write_text("sk-alice-0123456789")

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], max_body_bytes=BODY_MAX, max_buffered_bytes=BUFFER_MAX,
                auth={"keys_dir": str(keys)}) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            held = [await _open(port, _padded(BODY_MAX), 10) for _ in range(3)]
            for reader, _w in held:
                assert await _status(reader) == 401
            status, _h, raw = await gw.post(CMPL, _padded(BODY_MAX),
                                            {"Authorization": "Bearer sk-alice-0123456789"})
            assert status == 200, raw  # the cap is all there for a keyed request
            for _r, writer in held:
                writer.close()

    asyncio.run(main())
