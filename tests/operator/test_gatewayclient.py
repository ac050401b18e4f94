"""The operator's gateway client: a call the sidecar cannot answer goes to the gateway
Service (another replica's gateway); a refusal does not."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from mooncake_operator.gatewayclient import GatewayClient

HOST = "127.0.0.1"


@asynccontextmanager
async def gateway(status: int, name: str) -> AsyncIterator[str]:
    async def registry(request: web.Request) -> web.Response:
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        return web.json_response({"model": request.query["model"], "from": name})

    app = web.Application()
    app.router.add_get("/conductor/registry", registry)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return f"http://{HOST}:{s.getsockname()[1]}"  # closed once we leave


async def _ask(primary: str, fallback: str) -> tuple[dict[str, object] | None, int]:
    client = GatewayClient(primary, 2.0, fallback_url=fallback)
    try:
        return await client.registry("m"), client.fallbacks
    finally:
        await client.close()


@pytest.mark.parametrize(("status", "answered_by"), [
    (200, "sidecar"), (503, "service"), (500, "service"), (404, None), (401, None)])
def test_only_a_sidecar_that_fails_is_replaced(status: int, answered_by: str | None) -> None:
    async def main() -> None:
        async with gateway(status, "sidecar") as side, gateway(200, "service") as svc:
            data, fallbacks = await _ask(side, svc)
        if answered_by is None:
            assert data is None and fallbacks == 0
        else:
            assert data is not None and data["from"] == answered_by
            assert fallbacks == (answered_by == "service")
    asyncio.run(main())


def test_an_unreachable_sidecar_is_replaced_by_the_service() -> None:
    async def main() -> None:
        async with gateway(200, "service") as svc:
            data, fallbacks = await _ask(closed_port_url(), svc)
        assert data == {"model": "m", "from": "service"} and fallbacks == 1
    asyncio.run(main())


def test_without_a_fallback_or_with_the_same_url_none_is_asked() -> None:
    async def main() -> None:
        down = closed_port_url()
        assert await _ask(down, "") == (None, 0)
        assert GatewayClient(down + "/", 1.0, fallback_url=down).fallback_url == ""
    asyncio.run(main())
