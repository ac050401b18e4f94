"""A lean keep-alive HTTP/1.1 client for the gateway's non-streamed engine calls.

The prefill call and a non-streamed decode are one ``POST`` of a JSON body whose answer is
read whole. aiohttp's client spends about 0.1 ms of CPU per such call in request and
response objects, header multidicts, URL handling and timers; this client writes the
request bytes straight to a pooled connection and parses the status line, the headers and
a ``Content-Length`` or ``chunked`` body from one buffer. The background health checks and
``/metrics`` scrapes (``GET``) use it too. Streamed answers and ``https`` engines still go
through aiohttp.

Like aiohttp, a ``POST`` is never retried here (the engine may have started it): a closed
or reset connection, a timeout or a malformed answer raises :class:`UpstreamCallError` and
the gateway decides whether another instance should be tried. Connections idle for longer
than ``keepalive_s`` are not reused (engines close idle ones; uvicorn after 5 s), and a
connection the engine closed leaves the pool at once. Cancelling a call (the client hung
up) closes its connection, which aborts the request on the engine.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import cast
from urllib.parse import urlsplit

#: default port of an ``http://`` URL without one
HTTP_PORT = 80
#: statuses whose answers carry no body (RFC 9110)
NO_BODY_STATUSES = frozenset({204, 304})
#: first status of the informational (1xx) answers, which precede the real one
INFORMATIONAL_MIN = 100
INFORMATIONAL_END = 200
#: length of ``HTTP/1.1 200`` up to and including the status code
STATUS_LINE_MIN = 12
HEADER_END = b"\r\n\r\n"
CRLF = b"\r\n"
CHUNK_RADIX = 16


class UpstreamCallError(Exception):
    """The call failed before a complete answer arrived; the message names the cause."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight."""

    def __init__(self, pool: UpstreamPool, origin: tuple[str, int]) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.WriteTransport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._header_end = -1
        self._length: int | None = None  # Content-Length; None: chunked or until close
        self._chunked = False
        self._keep_alive = True
        self._chunk_pos = 0  # chunked: where the next chunk-size line starts
        self._chunks: list[bytes] = []

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's
        self.transport = cast(asyncio.WriteTransport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        self._buf += data
        try:
            self._parse()
        except (ValueError, IndexError) as exc:
            self._fail(UpstreamCallError(f"bad HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        if self._waiter is not None and self._header_end >= 0 and self._length is None \
                and not self._chunked:
            self._keep_alive = False  # a body delimited by the connection's end
            self._finish(bytes(self._buf[self._header_end:]))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        name = type(exc).__name__ if exc is not None else "ServerDisconnectedError"
        self._fail(UpstreamCallError(name))

    # -- calls -----------------------------------------------------------------------------
    def start(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        waiter: asyncio.Future[tuple[int, bytes]] = self.pool.loop.create_future()
        self._waiter = waiter
        self._buf.clear()
        self._header_end = -1
        self._length = None
        self._chunked = False
        self._keep_alive = True
        self._chunks = []
        self.transport.write(request)
        return waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def timed_out(self) -> None:
        self._fail(UpstreamCallError("TimeoutError"))
        self.close()

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        while self._header_end < 0:
            end = buf.find(HEADER_END)
            if end < 0:
                return
            self._head(bytes(buf[:end]))
            if INFORMATIONAL_MIN <= self._status < INFORMATIONAL_END:
                del buf[: end + len(HEADER_END)]  # 100 Continue & co: the answer follows
                continue
            self._header_end = end + len(HEADER_END)
            self._chunk_pos = self._header_end
            if self._status in NO_BODY_STATUSES:
                self._length = 0
        if self._chunked:
            self._parse_chunks()
        elif self._length is not None and len(buf) - self._header_end >= self._length:
            start = self._header_end
            if len(buf) - start > self._length:  # bytes past the answer: do not reuse
                self._keep_alive = False
            self._finish(bytes(buf[start : start + self._length]))

    def _head(self, head: bytes) -> None:
        lines = head.split(CRLF)
        status_line = lines[0]
        if len(status_line) < STATUS_LINE_MIN or not status_line.startswith(b"HTTP/1."):
            raise ValueError(f"status line {status_line[:40]!r}")
        self._status = int(status_line[9:12])
        self._keep_alive = status_line[7:8] != b"0"  # HTTP/1.0: close unless told otherwise
        self._length = None
        self._chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            key = name.strip().lower()
            if key == b"content-length":
                self._length = int(value.strip())
            elif key == b"transfer-encoding":
                self._chunked = value.strip().lower().endswith(b"chunked")
            elif key == b"connection":
                token = value.strip().lower()
                if token == b"close":
                    self._keep_alive = False
                elif token == b"keep-alive":
                    self._keep_alive = True
        if self._chunked:
            self._length = None

    def _parse_chunks(self) -> None:
        buf = self._buf
        while True:
            line_end = buf.find(CRLF, self._chunk_pos)
            if line_end < 0:
                return
            size = int(bytes(buf[self._chunk_pos:line_end]).split(b";", 1)[0], CHUNK_RADIX)
            data_start = line_end + len(CRLF)
            if size == 0:  # the last chunk, then optional trailers and an empty line
                if buf.find(HEADER_END, line_end) < 0:
                    return
                self._finish(b"".join(self._chunks))
                return
            if len(buf) < data_start + size + len(CRLF):
                return
            self._chunks.append(bytes(buf[data_start : data_start + size]))
            self._chunk_pos = data_start + size + len(CRLF)

    def _finish(self, body: bytes) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body))

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self.closed


class UpstreamPool:
    """Idle keep-alive connections per ``(host, port)``, newest reused first."""

    def __init__(self, connect_timeout_s: float, request_timeout_s: float,
                 keepalive_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.keepalive_s = keepalive_s
        # dicts used as ordered sets: popitem() takes the newest, del drops a closed one
        self._idle: dict[tuple[str, int], dict[_Connection, None]] = {}
        self._origins: dict[str, tuple[tuple[str, int], bytes]] = {}

    @staticmethod
    def supports(base_url: str) -> bool:
        return base_url.startswith("http://")

    def _origin(self, base_url: str) -> tuple[tuple[str, int], bytes]:
        known = self._origins.get(base_url)
        if known is None:
            parts = urlsplit(base_url)
            host = parts.hostname or ""
            port = parts.port or HTTP_PORT
            netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            known = ((host, port), f"Host: {netloc}\r\n".encode("ascii"))
            self._origins[base_url] = known
        return known

    async def post(self, base_url: str, path: str, body: bytes,
                   content_type: bytes = b"application/json") -> tuple[int, bytes]:
        """``POST`` ``body`` to ``base_url + path``: the answer's status and whole body."""
        origin, host_header = self._origin(base_url)
        request = b"".join((
            b"POST ", path.encode("ascii"), b" HTTP/1.1\r\n", host_header,
            b"Content-Type: ", content_type, b"\r\nContent-Length: ",
            str(len(body)).encode("ascii"), b"\r\nAccept: */*\r\n\r\n", body,
        ))
        return await self._call(origin, request, self.request_timeout_s,
                                self.connect_timeout_s)

    async def get(self, base_url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
        """``GET`` ``base_url + path`` within ``timeout_s`` (connecting included): the
        answer's status and whole body. The background health checks and ``/metrics``
        scrapes: ~0.1 ms of CPU less per call than aiohttp's client, which at hundreds of
        engines is most of what the gateway spends at rest."""
        origin, host_header = self._origin(base_url)
        request = b"".join((b"GET ", path.encode("ascii"), b" HTTP/1.1\r\n", host_header,
                            b"Accept: */*\r\n\r\n"))
        started = self.loop.time()
        return await self._call(origin, request, timeout_s,
                                min(timeout_s, self.connect_timeout_s), started)

    async def _call(self, origin: tuple[str, int], request: bytes, timeout_s: float,
                    connect_timeout_s: float, started: float | None = None
                    ) -> tuple[int, bytes]:
        """Send ``request`` on a pooled (or new) connection to ``origin``; ``timeout_s``
        from ``started`` (default: once connected)."""
        conn = await self._acquire(origin, connect_timeout_s)
        left = timeout_s if started is None else timeout_s - (self.loop.time() - started)
        timer = self.loop.call_later(max(0.0, left), conn.timed_out)
        try:
            status, answer = await conn.start(request)
        except BaseException:  # failure, timeout or cancellation: the connection is spent
            conn.close()
            raise
        finally:
            timer.cancel()
        if conn.reusable:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, {})[conn] = None
        else:
            conn.close()
        return status, answer

    async def _acquire(self, origin: tuple[str, int], connect_timeout_s: float) -> _Connection:
        idle = self._idle.get(origin)
        if idle:
            oldest_ok = time.monotonic() - self.keepalive_s
            while idle:
                conn, _ = idle.popitem()
                if conn.idle_since >= oldest_ok and not conn.closed:
                    return conn
                conn.close()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, proto = await self.loop.create_connection(
                    lambda: _Connection(self, origin), origin[0], origin[1])
        except TimeoutError:
            raise UpstreamCallError("ConnectTimeoutError") from None
        except OSError as exc:
            raise UpstreamCallError(type(exc).__name__) from exc
        return proto

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle is not None:
            idle.pop(conn, None)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
        self._idle.clear()
