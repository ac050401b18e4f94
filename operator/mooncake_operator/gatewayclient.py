"""The operator's calls to the gateway: its registry (which pods it routes to, what each
holds) and its hot prefixes. A failed call returns ``None``: the caller treats the gateway
as unknown, never as "no pods registered". With the gateway's admin keys mounted, each call
carries the first of them (by file name), read again every time: a rotation needs no
restart.

With a ``fallback_url`` (the chart: the gateway Service, which spreads over every operator
pod's gateway), a call the sidecar cannot answer (unreachable, or a 5xx) is asked there
instead: while the sidecar restarts, another replica's gateway, which discovers the same
pods, answers, so the cluster does not turn ``GatewayUnreachable`` while the Service
serves."""

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
                 admin_keys_dir: Path | None = None, fallback_url: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        fallback = fallback_url.rstrip("/")
        self.fallback_url = fallback if fallback != self.base_url else ""
        #: calls answered by the fallback (the sidecar could not)
        self.fallbacks = 0
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
        data, retry = await self._get_from(self.base_url, path, params)
        if retry and self.fallback_url:
            data, _ = await self._get_from(self.fallback_url, path, params)
            if data is not None:
                self.fallbacks += 1
        return data

    async def _get_from(self, base: str, path: str, params: dict[str, str]
                        ) -> tuple[JsonDict | None, bool]:
        """The answer of ``base`` (``None`` when there is none), and whether another
        gateway may answer instead: ``base`` was unreachable or failed (5xx), not a
        refusal or an unknown model, which every replica would give alike."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(base + path, params=params,
                                         headers=self._headers()) as resp:
                if resp.status != 200:
                    log.debug("gateway %s%s -> %s", base, path, resp.status)
                    return None, resp.status >= 500
                data = await resp.json(content_type=None)
                return (data if isinstance(data, dict) else {"items": data}), False
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("gateway %s%s unreachable: %s", base, path, exc)
            return None, True

    async def registry(self, model: str) -> JsonDict | None:
        return await self._get("/conductor/registry", {"model": model})

    async def hot_prefixes(self, model: str, limit: int) -> JsonDict | None:
        return await self._get("/conductor/hot-prefixes",
                               {"model": model, "tokens": "1", "limit": str(limit)})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
