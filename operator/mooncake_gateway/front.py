"""The gateway's fast front end: plain completion requests without aiohttp's server.

aiohttp's server costs about 90 µs of CPU per request (request and response objects,
header multidicts, a task, the router and middleware chain) — a quarter of what the
gateway spends on a short non-streamed completion. This protocol parses the common case
itself: ``POST /v1/completions`` or ``/v1/chat/completions``, HTTP/1.x, a
``Content-Length`` body, no ``Transfer-Encoding``/``Expect``/``Upgrade`` and no explain
header; :meth:`Gateway.serve_plain <mooncake_gateway.server.Gateway.serve_plain>` answers
it (errors included, OpenAI-shaped) and the answer goes back with a ``Content-Length``.

Everything else — another route or method, a malformed or unusual request, a body over
``max_body_bytes``, a request that asks for a stream, the explain header — is handed to
aiohttp: the bytes received so far (from the start of that request) are fed to an aiohttp
``RequestHandler``, which owns the connection from then on. Nothing has been written or
sent upstream for that request at that point, so aiohttp serves it exactly as it would
have from the start. Requests on one connection are answered in order; a client that
hangs up cancels its request (the upstream connection closes, the engine aborts).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol, cast

from aiohttp import web

from .bodies import BodyBudget

log = logging.getLogger(__name__)

#: request targets served here, and whether they are chat
FAST_PATHS = {b"/v1/completions": False, b"/v1/chat/completions": True}
#: the longest request head (request line + headers) parsed here; longer goes to aiohttp
MAX_HEAD_BYTES = 8190
#: headers whose presence sends a request to aiohttp
HAND_OVER_HEADERS = frozenset({b"transfer-encoding", b"expect", b"upgrade",
                               b"x-conductor-explain"})
#: headers of an answer the front end writes itself
OWN_HEADERS = frozenset({"content-length", "connection", "transfer-encoding", "date"})
HEAD_END = b"\r\n\r\n"
CRLF = b"\r\n"


class _Date:
    """The ``Date`` header value, formatted once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode("ascii")
        return self._value


class PlainJson:
    """A ``200 application/json`` answer for the front end: the engine's bytes as they
    came, without building an aiohttp ``Response`` (~4 µs) and reading it back (~5 µs);
    :meth:`FrontServer.encode` writes the same bytes it would have for that ``Response``."""

    __slots__ = ("body",)
    status = 200

    def __init__(self, body: bytes) -> None:
        self.body = body


#: the head of a :class:`PlainJson` answer up to its ``Date`` header
PLAIN_JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: "


class FrontProtocol(asyncio.Protocol):
    def __init__(self, front: FrontServer) -> None:
        self.front = front
        self.transport: asyncio.WriteTransport | None = None
        self._buf = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._delegate: asyncio.Protocol | None = None
        self._eof = False
        self.idle_since = front.loop.time()
        #: bytes of the current request's body reserved from the gateway's cap (bodies.py)
        self._reserved: int | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.WriteTransport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._delegate is not None:
            self._delegate.data_received(data)
            return
        self._buf += data
        if self._task is None:
            self._next()

    def eof_received(self) -> bool | None:
        if self._delegate is not None:
            return self._delegate.eof_received()
        self._eof = True
        return None  # as aiohttp: the transport closes, a request in progress is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        if self._task is None:
            self._release()  # a body that never arrived whole (a running task releases)
        if self._delegate is not None:
            self._delegate.connection_lost(exc)
            return
        if self._task is not None:
            self._task.cancel()  # the client went away: abort the upstream call

    def pause_writing(self) -> None:
        if self._delegate is not None:
            self._delegate.pause_writing()

    def resume_writing(self) -> None:
        if self._delegate is not None:
            self._delegate.resume_writing()

    @property
    def idle(self) -> bool:
        """Between requests on a connection the front end still serves."""
        return self._delegate is None and self._task is None

    # -- requests --------------------------------------------------------------------------
    def _next(self) -> None:
        """Start the next complete request in the buffer, or hand the connection over."""
        buf = self._buf
        end = buf.find(HEAD_END)
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                self._hand_over()
            return
        parsed = _parse_head(bytes(buf[:end]), self.front.max_body_bytes)
        if parsed is None:
            self._hand_over()
            return
        chat, length, keep_alive, authorization = parsed
        if self._reserved is None:
            # a request without a valid key reserves nothing (it could hold the cap with
            # slow bodies): aiohttp's middleware answers it 401; one over the cap, 503
            if not self.front.gateway.admits(chat, authorization) \
                    or not self.front.gateway.bodies.take(length):
                self._hand_over()
                return
            self._reserved = length
        start = end + len(HEAD_END)
        if len(buf) < start + length:
            return  # the body is still coming
        body = bytes(buf[start : start + length])
        self.idle_since = 0.0  # busy
        self._task = self.front.loop.create_task(
            self._serve(body, chat, keep_alive, start + length, authorization))

    def _release(self) -> None:
        if self._reserved is not None:
            self.front.gateway.bodies.give(self._reserved)
            self._reserved = None

    async def _serve(self, body: bytes, chat: bool, keep_alive: bool, consumed: int,
                     authorization: str | None) -> None:
        try:
            try:
                resp = await self.front.gateway.serve_plain(body, chat, authorization)
            finally:
                self._release()
            self._task = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            if resp is None:  # a stream: aiohttp serves it, from this request on
                self._hand_over()
                return
            del self._buf[:consumed]
            self.idle_since = self.front.loop.time()
            keep_alive = keep_alive and not self._eof
            transport.write(self.front.encode(resp, keep_alive))
            if not keep_alive:
                transport.close()
            elif self._buf:
                self._next()
        except Exception:  # a bug here must not leave the client waiting
            log.exception("front end failed; closing the connection")
            if self.transport is not None:
                self.transport.close()

    def _hand_over(self) -> None:
        self._release()  # aiohttp's middleware reserves the body again
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        handler = self.front.make_handler()
        self._delegate = handler
        handler.connection_made(transport)
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            handler.data_received(data)
        if self._eof:
            handler.eof_received()


def _parse_head(head: bytes,
                max_body: int) -> tuple[bool, int, bool, str | None] | None:
    """(chat, body length, keep-alive, ``Authorization`` value) of a request the front end
    serves, else ``None``."""
    lines = head.split(CRLF)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    chat = FAST_PATHS.get(parts[1])
    if chat is None:
        return None
    keep_alive = parts[2] == b"HTTP/1.1"
    length: int | None = None
    authorization: str | None = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:].isspace() or line[:1].isspace():
            return None  # malformed or folded: aiohttp decides
        key = name.lower()
        if key == b"content-length":
            value = value.strip()
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif key == b"authorization":
            if authorization is not None:
                return None  # two credentials: aiohttp decides
            authorization = value.strip().decode("latin-1")
        elif key in HAND_OVER_HEADERS:
            return None
        elif key == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
            if b"upgrade" in tokens:
                return None
    if length is None or length > max_body:
        return None
    return chat, length, keep_alive, authorization


class FrontDoor(Protocol):
    """What the front end needs of the gateway (:class:`~.server.Gateway`)."""

    @property
    def bodies(self) -> BodyBudget: ...

    def admits(self, chat: bool, authorization: str | None) -> bool: ...

    async def serve_plain(self, raw: bytes, chat: bool, authorization: str | None = None
                          ) -> web.Response | PlainJson | None: ...


class FrontServer:
    """What every :class:`FrontProtocol` shares: the gateway, aiohttp's handler factory."""

    def __init__(self, gateway: FrontDoor, make_handler: Callable[[], asyncio.Protocol],
                 max_body_bytes: int, idle_s: float) -> None:
        self.gateway = gateway
        self.make_handler = make_handler
        self.max_body_bytes = max_body_bytes
        self.idle_s = idle_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[FrontProtocol] = set()
        self._date = _Date()
        self._sweeper = self.loop.call_later(idle_s, self._sweep)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for ``idle_s`` (handed-over ones are
        aiohttp's to time out); runs every ``idle_s``."""
        oldest = self.loop.time() - self.idle_s
        for conn in list(self.connections):
            if conn.idle and 0 < conn.idle_since < oldest and conn.transport is not None:
                conn.transport.close()
        self._sweeper = self.loop.call_later(self.idle_s, self._sweep)

    def protocol(self) -> FrontProtocol:
        return FrontProtocol(self)

    def encode(self, resp: web.Response | PlainJson, keep_alive: bool) -> bytes:
        if isinstance(resp, PlainJson):
            plain = resp.body
            return b"".join((PLAIN_JSON_HEAD, self._date.get(), b"\r\nContent-Length: ",
                             str(len(plain)).encode("ascii"),
                             b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n",
                             plain))
        body = resp.body
        if not isinstance(body, bytes | bytearray):
            body = b""
        status = resp.status
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        head = [f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")]
        for name, value in resp.headers.items():
            if name.lower() not in OWN_HEADERS:
                head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"Date: " + self._date.get() + b"\r\nContent-Length: "
                    + str(len(body)).encode("ascii") + b"\r\n")
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(CRLF)
        head.append(bytes(body))
        return b"".join(head)

    def close(self) -> None:
        self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        self.connections.clear()
