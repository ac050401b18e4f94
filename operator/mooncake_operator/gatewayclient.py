"""The operator's calls to the gateway: its registry (which pods it routes to, what each
holds) and its hot prefixes. A failed call returns ``None``: the caller treats the gateway
as unknown, never as "no pods registered". With the gateway's admin keys mounted, each call
carries the first of them (by file name), read again every time: a rotation needs no
restart."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
from mooncake_contract.keydir import read_key_dir

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]


class GatewayClient:
    def __init__(self, base_url: str, timeout_s: float,
                 admin_keys_dir: Path | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.admin_keys_dir = admin_keys_dir
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        if self.admin_keys_dir is None:
            return {}
        try:
            keys = read_key_dir(self.admin_keys_dir)
        except OSError as exc:
            log.warning("cannot read the gateway's admin keys from %s (%s)",
                        self.admin_keys_dir, exc.strerror or type(exc).__name__)
            return {}
        if not keys:
            return {}
        return {"Authorization": f"Bearer {next(iter(keys.values()))}"}

    async def _get(self, path: str, params: dict[str, str]) -> JsonDict | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(self.base_url + path, params=params,
                                         headers=self._headers()) as resp:
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
