"""How the gateway calls its engines: one aiohttp session (streams, and every call when
the lean client is off) and the lean pool of ``upstream.py`` for plain calls.

Each call's failure that another instance may not share (a refused or broken connection,
a timeout) is an :class:`UpstreamError`; the engine's own HTTP status is returned, not
raised.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import aiohttp

from . import fastjson
from .errors import ApiError
from .instances import Instance
from .settings import GatewaySettings
from .upstream import UpstreamCallError, UpstreamPool

JSON_HEADERS = {"Content-Type": "application/json"}
#: engine answers that another instance may serve (the call is retried elsewhere)
UPSTREAM_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class UpstreamError(Exception):
    """An engine call failed in a way another instance may not."""


class EngineCalls:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None  # non-streamed calls (lean_upstream)

    async def start(self) -> None:
        s = self.settings
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s,
                                          sock_connect=s.connect_timeout_s),
        )
        if s.lean_upstream:
            self.upstream = UpstreamPool(s.connect_timeout_s, s.request_timeout_s,
                                         s.upstream_keepalive_s)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            self.upstream.close()

    async def post_json(self, inst: Instance, path: str, body: bytes) -> tuple[int, Any]:
        status, parsed, _raw = await self.post(inst, path, body)
        return status, parsed

    async def post(self, inst: Instance, path: str, body: bytes,
                   parse: bool = True) -> tuple[int, Any, bytes]:
        """POST ``body``; the status, the parsed JSON (``None`` when not asked or not JSON)
        and the raw answer."""
        url = inst.endpoint.url
        if self.upstream is not None and self.upstream.supports(url):
            try:
                status, raw = await self.upstream.post(url, path, body)
            except UpstreamCallError as exc:
                raise UpstreamError(str(exc)) from exc
        else:
            assert self.session is not None
            try:
                async with self.session.post(url + path, data=body,
                                             headers=JSON_HEADERS) as resp:
                    status = resp.status
                    raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                raise UpstreamError(type(exc).__name__) from exc
        parsed = None
        if parse or status != 200:
            with contextlib.suppress(ValueError):
                parsed = fastjson.loads(raw) if raw else None
        return status, parsed, raw

    async def open_stream(self, url: str, body: bytes) -> aiohttp.ClientResponse:
        """A streamed POST's answer head (the caller reads and releases it)."""
        assert self.session is not None
        try:
            return await self.session.post(url, data=body, headers=JSON_HEADERS)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise UpstreamError(type(exc).__name__) from exc

    async def healthy(self, url: str) -> bool:
        """Whether the engine at ``url`` answers ``/health`` with 200 in time."""
        timeout = self.settings.health_timeout_s
        if self.upstream is not None and self.upstream.supports(url):
            try:
                status, _ = await self.upstream.get(url, "/health", timeout)
            except UpstreamCallError:
                return False
            return status == 200
        assert self.session is not None
        with contextlib.suppress(Exception):
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        return False

    async def metrics_page(self, url: str) -> str | None:
        """The engine's ``/metrics`` page; ``None`` when it did not answer 200 in time."""
        timeout = self.settings.health_timeout_s
        try:
            if self.upstream is not None and self.upstream.supports(url):
                status, raw = await self.upstream.get(url, "/metrics", timeout)
                if status != 200:
                    return None
                return raw.decode("utf-8", "replace")
            assert self.session is not None
            async with self.session.get(
                    url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except Exception:
            return None


def splice_json(raw: bytes, overrides: dict[str, Any]) -> bytes:
    """The client's JSON object ``raw`` with ``overrides`` appended as later duplicate keys
    (JSON parsers keep the last): a long token-id prompt is forwarded without re-encoding
    it, and the gateway keeps no parsed copy of it (a list of ints, ~4x its JSON) while
    the request runs. ``raw`` must be a JSON object, as a parsed request body is."""
    body = raw.rstrip()
    if not body.endswith(b"}"):
        raise ValueError("the request body is not a JSON object")
    head = body[:-1]  # the client's bytes up to its closing brace, kept as they are
    extra = json.dumps(overrides, separators=(",", ":")).encode()
    # the object's last character before its closing brace: its opening one when empty
    return head + (b"" if head.rstrip().endswith(b"{") else b",") + extra[1:]


def relayed_error(status: int, resp: Any) -> ApiError:
    """An engine's own 4xx (bad input the gateway did not catch), passed on."""
    err = resp.get("error") if isinstance(resp, dict) else None
    if not isinstance(err, dict):
        err = {}
    out = status if 400 <= status < 500 else 502
    return ApiError(out, str(err.get("message") or f"engine answered HTTP {status}"),
                    err.get("param"), err.get("code"))

