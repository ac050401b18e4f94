"""The fast front end over raw sockets: pipelining, keep-alive, and handing a connection to
aiohttp (other routes, streams, chunked bodies, HTTP/1.0) mid-connection."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from aiohttp import web
from mooncake_gateway.front import FrontServer, PlainJson, _Date, _parse_head

from .conftest import Cluster
from .gateway_fixtures import HOST, MODEL

TIMEOUT_S = 20


def _request(path: str, body: Any | None = None, method: str = "POST",
             extra: str = "", version: str = "HTTP/1.1") -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} {version}\r\nHost: gw\r\n{extra}"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return (head + "\r\n").encode() + data


class _Reader:
    """Reads HTTP/1.1 answers (Content-Length or chunked) from one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        got = self.sock.recv(65536)
        if not got:
            raise EOFError
        self.buf += got

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            self._fill()
        out, self.buf = self.buf.split(sep, 1)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        head = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in head[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self._until(b"\r\n")
                    return status, headers, body
                body += self._exactly(size)
                self._exactly(2)
        return status, headers, self._exactly(int(headers.get("content-length", "0")))

    def closed(self) -> bool:
        try:
            self._fill()
        except EOFError:
            return True
        return False


def _connect(c: Cluster) -> tuple[socket.socket, _Reader]:
    sock = socket.create_connection((HOST, c.gateway.port), timeout=TIMEOUT_S)
    return sock, _Reader(sock)


COMPLETION = {"model": MODEL, "prompt": "the front end answers this", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_pipelined_requests_then_other_routes_on_one_connection(cluster: Cluster) -> None:
    sock, r = _connect(cluster)
    with sock:
        sock.sendall(_request("/v1/completions", COMPLETION)
                     + _request("/v1/chat/completions", CHAT)
                     + _request("/v1/completions", {**COMPLETION, "max_tokens": -1}))
        first, second, bad = r.answer(), r.answer(), r.answer()
        assert first[0] == 200 and json.loads(first[2])["object"] == "text_completion"
        assert "date" in first[1] and first[1]["content-type"].startswith("application/json")
        assert second[0] == 200 and json.loads(second[2])["object"] == "chat.completion"
        assert bad[0] == 400 and json.loads(bad[2])["error"]["param"] == "max_tokens"
        # another route: aiohttp takes the connection over and keeps serving it
        sock.sendall(_request("/health", method="GET"))
        assert r.answer()[0] == 200
        sock.sendall(_request("/v1/completions", COMPLETION))
        assert r.answer()[0] == 200
        sock.sendall(_request("/v1/nothing", COMPLETION))
        status, _, body = r.answer()
        assert status == 404 and "error" in json.loads(body)


def test_a_stream_is_handed_to_aiohttp_and_the_connection_goes_on(cluster: Cluster) -> None:
    sock, r = _connect(cluster)
    with sock:
        sock.sendall(_request("/v1/completions", {**COMPLETION, "stream": True}))
        status, headers, body = r.answer()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body.rstrip().endswith(b"data: [DONE]")
        sock.sendall(_request("/v1/completions", COMPLETION))
        assert r.answer()[0] == 200


def test_explain_chunked_bodies_and_http10(cluster: Cluster) -> None:
    sock, r = _connect(cluster)
    with sock:
        sock.sendall(_request("/v1/completions", COMPLETION, extra="x-conductor-explain: 1\r\n"))
        status, headers, body = r.answer()
        assert status == 200 and "x-conductor-decision" in headers
        assert "conductor" in json.loads(body)
    sock, r = _connect(cluster)
    with sock:
        data = json.dumps(COMPLETION).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
        assert r.answer()[0] == 200
    sock, r = _connect(cluster)
    with sock:
        sock.sendall(_request("/v1/completions", COMPLETION, version="HTTP/1.0"))
        status, headers, _ = r.answer()
        assert status == 200 and headers.get("connection") == "close"
        assert r.closed()


def test_request_heads_the_front_end_serves_itself() -> None:
    big = 1000

    def head(text: str) -> tuple[bool, int, bool] | None:
        parsed = _parse_head(text.encode(), big)
        if parsed is None:
            return None
        assert parsed[3] is None  # no credential sent
        return parsed[:3]

    assert head("POST /v1/completions HTTP/1.1\r\nContent-Length: 10") == (False, 10, True)
    assert head("POST /v1/chat/completions HTTP/1.0\r\ncontent-length: 5\r\n"
                "Connection: keep-alive") == (True, 5, True)
    assert head("POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n"
                "Connection: close") == (False, 1, False)
    for other in (
        "GET /v1/completions HTTP/1.1\r\nContent-Length: 1",  # method
        "POST /v1/completions?x=1 HTTP/1.1\r\nContent-Length: 1",  # query string
        "POST /v1/completions HTTP/2\r\nContent-Length: 1",  # version
        "POST /v1/completions HTTP/1.1",  # no length
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1001",  # over the limit
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: -1",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nExpect: 100-continue",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n folded",
        "POST /v1/completions HTTP/1.1\r\nContent-Length : 1",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nno colon",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nConnection: Upgrade",
        "POST  /v1/completions HTTP/1.1\r\nContent-Length: 1",  # two spaces
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nX-A : 1",  # space, colon
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n x: y",  # folded, colon
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n: no name",
    ):
        assert head(other) is None, other
    # the limit itself is served; Connection is a comma list, its value may hold colons
    assert head(f"POST /v1/completions HTTP/1.1\r\nContent-Length: {big}") == \
        (False, big, True)
    for value in ("close,keep-alive", "keep-alive ,CLOSE", "close, a:b"):
        assert head("POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n"
                    f"Connection: {value}") == (False, 1, False), value
    assert head("POST /v1/completions HTTP/1.0\r\nContent-Length: 1\r\n"
                "Connection: x,keep-alive") == (False, 1, True)
    # the credential travels with the request; two of them go to aiohttp
    assert _parse_head(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n"
                       b"Authorization:  Bearer k-1 ", big) == (False, 1, True, "Bearer k-1")
    assert _parse_head(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n"
                       b"Authorization: Bearer a\r\nauthorization: Bearer b", big) is None


@pytest.mark.parametrize("keep_alive", [True, False])
def test_a_plain_json_answer_is_written_as_its_aiohttp_response_would_be(
        keep_alive: bool) -> None:
    """The fast path's :class:`PlainJson` skips building an aiohttp ``Response``; the bytes
    on the wire stay the same."""
    front = FrontServer.__new__(FrontServer)  # encode() needs the Date header only
    front._date = _Date()
    body = b'{"id":"cmpl-1","choices":[{"text":"x"}]}'
    as_aiohttp = web.Response(body=body, content_type="application/json")
    assert front.encode(PlainJson(body), keep_alive) == front.encode(as_aiohttp, keep_alive)
