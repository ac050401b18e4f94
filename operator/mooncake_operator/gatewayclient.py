"""The operator's calls to the gateway: its registry (which pods it routes to, what each
holds) and its hot prefixes. A failed call returns ``None``: the caller treats the gateway
as unknown, never as "no pods registered"."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]


class GatewayClient:
    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def _get(self, path: str, params: dict[str, str]) -> JsonDict | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(self.base_url + path, params=params) as resp:
                if resp.status != 200:
                    log.debug("gateway %s -> %s", path, resp.status)
                    return None
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else {"items": data}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("gateway %s unreachable: %s", path, exc)
            return None

    async def registry(self, model: str) -> JsonDict | None:
        return await self._get("/conductor/registry", {"model": model})

    async def hot_prefixes(self, model: str, limit: int) -> JsonDict | None:
        return await self._get("/conductor/hot-prefixes",
                               {"model": model, "tokens": "1", "limit": str(limit)})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
