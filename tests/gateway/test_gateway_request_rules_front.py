"""The fast front end of an in-process gateway over raw sockets: requests pipelined in one
write or cut in pieces, the answer's head (status line, own headers, ``Connection:
close``), HTTP/1.0 and a client's end of input, handing a connection to aiohttp (another
route, a stream, an oversized head) with the bytes it already read, a client hanging up
mid-request, and the sweep of idle keep-alive connections."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from .scripted import MODEL, GatewayClient, engines, model, prompt_ids, running_gateway, until

WAIT_S = 10.0


def _request(path: str, body: Any | None = None, method: str = "POST",
             extra: str = "", version: str = "HTTP/1.1") -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else \
        json.dumps(body).encode()
    head = f"{method} {path} {version}\r\nHost: gw\r\n{extra}"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return (head + "\r\n").encode() + data


def _completion(first: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(40, first), "max_tokens": 3, **extra}


class _Conn:
    """One client connection: writes bytes, reads whole answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, gw: GatewayClient) -> _Conn:
        u = urlsplit(gw.url)
        assert u.hostname is not None and u.port is not None
        return cls(*await asyncio.open_connection(u.hostname, u.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> tuple[str, dict[str, str], bytes]:
        """The status line, the headers (lower-case names) and the body."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT_S)
        lines = head[:-4].decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            assert k.lower() not in headers, lines  # no header twice
            headers[k.lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    return lines[0], headers, body
                body += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
        length = int(headers.get("content-length", "0"))
        return lines[0], headers, await self.reader.readexactly(length)

    async def closed(self, within: float = WAIT_S) -> bool:
        """Whether the gateway closes the connection within ``within`` seconds (reading
        nothing else)."""
        try:
            got = await asyncio.wait_for(self.reader.read(1), within)
        except TimeoutError:
            return False
        assert got == b"", got
        return True

    def close(self) -> None:
        self.writer.close()


def _front_served(headers: dict[str, str]) -> bool:
    """The front end's own head: a length, a date, and none of aiohttp's server header."""
    return "content-length" in headers and "date" in headers and "server" not in headers


def test_pipelined_requests_are_answered_in_order_then_aiohttp_takes_over() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(1))
                         + _request("/v1/chat/completions", {
                             "model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]})
                         + _request("/health", method="GET"))
            for i, path in enumerate(("/v1/completions", "/v1/chat/completions")):
                line, headers, body = await c.answer()
                assert line == "HTTP/1.1 200 OK"
                assert _front_served(headers) and "connection" not in headers
                assert headers["content-type"].startswith("application/json")
                assert int(headers["content-length"]) == len(body)
                assert d0.decodes[i].path == path
                assert json.loads(body) == d0.decode_json(d0.decodes[i])
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and "server" in headers  # aiohttp's
            assert json.loads(body) == {"status": "ok"}
            # aiohttp serves the rest of the connection, completions too
            await c.send(_request("/v1/completions", _completion(2)))
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and "server" in headers
            assert json.loads(body) == d0.decode_json(d0.decodes[2])
            c.close()

    asyncio.run(main())


def test_a_request_in_pieces_is_served_once_whole() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            c = await _Conn.open(gw)
            raw = _request("/v1/completions", _completion(3))
            head_end = raw.index(b"\r\n\r\n")
            for a, b in ((0, 10), (10, head_end + 2), (head_end + 2, head_end + 4),
                         (head_end + 4, head_end + 9), (head_end + 9, len(raw))):
                await c.send(raw[a:b])
                await asyncio.sleep(0.02)
                if b < len(raw):
                    assert d0.calls == [] and p0.calls == []
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and _front_served(headers)
            assert json.loads(body) == d0.decode_json(d0.decodes[0])
            assert p0.prefills[0].body["prompt"] == prompt_ids(40, 3)
            # and the connection serves the next one
            await c.send(_request("/v1/completions", _completion(4)))
            line, _h, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and len(d0.decodes) == 2
            c.close()

    asyncio.run(main())


def test_http10_and_connection_close_close_after_the_answer() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            for raw in (_request("/v1/completions", _completion(5), version="HTTP/1.0"),
                        _request("/v1/completions", _completion(6),
                                 extra="Connection: close\r\n")):
                c = await _Conn.open(gw)
                await c.send(raw)
                line, headers, body = await c.answer()
                assert line == "HTTP/1.1 200 OK" and _front_served(headers)
                assert headers["connection"] == "close"
                assert json.loads(body) == d0.decode_json(d0.decodes[-1])
                assert await c.closed()
                c.close()
            # HTTP/1.0 asking for keep-alive keeps it
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(8), version="HTTP/1.0",
                                  extra="Connection: keep-alive\r\n"))
            line, headers, _b = await c.answer()
            assert line == "HTTP/1.1 200 OK" and "connection" not in headers
            assert not await c.closed(within=0.1)
            c.close()

    asyncio.run(main())


def test_errors_from_the_front_end_have_their_reason_phrase_and_json() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(9, model="nope")))
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 404 Not Found" and _front_served(headers)
            assert headers["content-type"].startswith("application/json")
            assert json.loads(body)["error"]["code"] == "model_not_found"
            await c.send(_request("/v1/completions", b"{"))
            d0.status = 499  # relayed as it came: a status without a reason phrase
            await c.send(_request("/v1/completions", _completion(10)))
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 400 Bad Request"
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 499 Unknown" and _front_served(headers)
            assert json.loads(body)["error"]["message"] == "d0 says 499"
            c.close()

    asyncio.run(main())


def test_a_stream_is_handed_to_aiohttp_with_the_bytes_already_read() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            c = await _Conn.open(gw)
            # a stream, then a plain request in the same write: aiohttp gets both
            await c.send(_request("/v1/completions", _completion(11, stream=True))
                         + _request("/v1/completions", _completion(12)))
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK"
            assert headers["content-type"] == "text/event-stream"
            assert body == d0.sse(d0.decodes[0])
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and "server" in headers
            assert json.loads(body) == d0.decode_json(d0.decodes[1])
            c.close()
            # the explain header: aiohttp's
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(13),
                                  extra="x-conductor-explain: 1\r\n"))
            line, headers, body = await c.answer()
            assert line == "HTTP/1.1 200 OK" and "x-conductor-decision" in headers
            assert "conductor" in json.loads(body)
            c.close()

    asyncio.run(main())


def test_an_oversized_head_and_a_client_hanging_up_early() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            c = await _Conn.open(gw)
            await c.send(b"POST /v1/completions HTTP/1.1\r\nX-Long: " + b"a" * 9000)
            line, _h, _b = await c.answer()  # aiohttp's refusal, not a hang
            assert line.split(" ")[1] == "400", line
            c.close()
            # a client that sends a head and hangs up: nothing served, nothing left over
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(14))[:-5])
            c.writer.write_eof()
            assert await c.closed()
            c.close()
            assert p0.calls == [] and d0.calls == []
            # a whole request and the end of input: as aiohttp, the connection closes
            # (a request in progress is cancelled) and no answer comes
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(7)))
            c.writer.write_eof()
            assert await c.closed()
            c.close()

    asyncio.run(main())


def test_a_client_hanging_up_cancels_its_request() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            p0.hold = asyncio.Event()
            c = await _Conn.open(gw)
            await c.send(_request("/v1/completions", _completion(15)))
            await asyncio.wait_for(p0.arrived.wait(), WAIT_S)
            c.close()

            async def cancelled() -> bool:
                text = await gw.text("/metrics")
                return ('mooncake_gateway_requests_total{endpoint="completions",'
                        f'model="{MODEL}",outcome="cancelled"}} 1.0') in text
            await until(cancelled)
            st = await gw.state()
            assert st["decode"][0]["inflight"] == 0 and d0.calls == []

    asyncio.run(main())


IDLE_S = 0.3


def test_idle_keep_alive_connections_are_swept_busy_and_handed_over_ones_are_not() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], front_idle_s=IDLE_S) as gw:
            await asyncio.sleep(2 * IDLE_S)  # the sweep runs again and again
            served = await _Conn.open(gw)
            await served.send(_request("/v1/completions", _completion(16)))
            await served.answer()
            answered = time.monotonic()
            fresh = await _Conn.open(gw)  # never sends anything
            opened = time.monotonic()
            handed = await _Conn.open(gw)
            await handed.send(_request("/health", method="GET"))
            await handed.answer()
            # a request in flight past the idle time is answered
            d0.hold = asyncio.Event()
            busy = await _Conn.open(gw)
            await busy.send(_request("/v1/completions", _completion(17)))
            assert await served.closed()
            assert time.monotonic() - answered >= IDLE_S * 0.9
            assert await fresh.closed()
            assert time.monotonic() - opened >= IDLE_S * 0.9
            assert not await busy.closed(within=IDLE_S)
            d0.hold.set()
            line, _h, _b = await busy.answer()
            assert line == "HTTP/1.1 200 OK"
            await handed.send(_request("/health", method="GET"))
            line, _h, _b = await handed.answer()  # aiohttp's keep-alive, not the sweep's
            assert line == "HTTP/1.1 200 OK"
            for c in (served, fresh, handed, busy):
                c.close()

    asyncio.run(main())


def test_a_connection_in_use_is_not_swept() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], front_idle_s=IDLE_S) as gw:
            c = await _Conn.open(gw)
            end = time.monotonic() + 3 * IDLE_S
            n = 0
            while time.monotonic() < end:
                n += 1
                await c.send(_request("/v1/completions", _completion(100 + n)))
                line, _h, _b = await c.answer()
                assert line == "HTTP/1.1 200 OK"
                await asyncio.sleep(IDLE_S / 10)
            assert len(d0.decodes) == n
            c.close()

    asyncio.run(main())


def test_a_slow_reader_of_a_handed_over_stream_gets_it_all() -> None:
    """Megabytes of events to a client that reads late: the handed-over connection's
    writes pause and resume (aiohttp's flow control through the front end's protocol)."""
    event = b'data: {"choices": [{"text": "' + b"x" * 1000 + b'"}]}\n\n'
    count = 3000

    async def answer(request: Any, _call: Any) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(count // 100):
            await resp.write(event * 100)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            d0.answer = answer
            u = urlsplit(gw.url)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (u.hostname, u.port))
            c = _Conn(*await asyncio.open_connection(sock=sock))
            await c.send(_request("/v1/completions", _completion(30, stream=True)))
            await asyncio.sleep(0.3)  # nothing read: the gateway's buffer fills
            line, _h, body = await asyncio.wait_for(c.answer(), WAIT_S)
            assert line == "HTTP/1.1 200 OK"
            assert body == event * count + b"data: [DONE]\n\n"
            c.close()

    asyncio.run(main())
