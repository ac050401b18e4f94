"""The lean upstream client against scripted HTTP servers, and the engine-metrics reader."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
from mooncake_gateway.enginemetrics import parse_engine_metrics
from mooncake_gateway.upstream import UpstreamCallError, UpstreamPool

HOST = "127.0.0.1"
#: a connection handler: reads one request, writes what the test scripts
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def _server(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and a list of accepted connection ids."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, HOST, 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://{HOST}:{port}", accepted
    finally:
        srv.close()


Run = Callable[[Coroutine[Any, Any, None]], None]


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    import uvloop  # a dependency on Linux (pyproject.toml)

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine on asyncio's loop, then (second parameter) on uvloop's."""
    factory = _uvloop_factory() if request.param == "uvloop" else None

    def go(coro: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(coro)

    return go


def _pool(timeout_s: float = 5.0, keepalive_s: float = 5.0) -> UpstreamPool:
    return UpstreamPool(connect_timeout_s=timeout_s, request_timeout_s=timeout_s,
                        keepalive_s=keepalive_s)


def _answer(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def test_content_length_answers_reuse_one_connection(run: Run) -> None:
    seen: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await _read_request(reader)
            seen.append(head)
            # the answer in two writes: the client must wait for the whole body
            out = _answer(200, b'{"echo":' + body + b"}")
            writer.write(out[:30])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(out[30:])
            await writer.drain()

    async def main() -> None:
        async with _server(echo) as (url, accepted):
            pool = _pool()
            for i in range(3):
                status, body = await pool.post(url, "/v1/completions", f'{{"i":{i}}}'.encode())
                assert status == 200 and body == f'{{"echo":{{"i":{i}}}}}'.encode()
            assert len(accepted) == 1
            assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nContent-Length: 7\r\n" in seen[0]
            assert f"\r\nHost: {url[len('http://'):]}\r\n".encode() in seen[0]
            pool.close()

    run(main())


def test_chunked_answers_with_trailers_and_1xx_are_read_whole(run: Run) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"5;ext=1\r\nhello\r\n", b"1", b"\r\n \r\n6\r\nworld!\r\n",
                     b"0\r\nX-Trailer: 1\r\n", b"\r\n"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.005)
        await reader.read()

    async def main() -> None:
        async with _server(chunked) as (url, _):
            pool = _pool()
            assert await pool.post(url, "/x", b"{}") == (404, b"hello world!")
            pool.close()

    run(main())


def test_connection_close_and_http10_answers_are_not_reused(run: Run) -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n{\"until\":\"eof\"}")
        await writer.drain()

    async def main() -> None:
        async with _server(closing) as (url, accepted):
            pool = _pool()
            for _ in range(2):
                assert await pool.post(url, "/x", b"{}") == (200, b'{"until":"eof"}')
            assert len(accepted) == 2
            pool.close()

    run(main())


def test_a_connection_closed_by_the_engine_leaves_the_pool(run: Run) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_answer(200, b"{}"))
        await writer.drain()  # then the handler returns and the server closes

    async def main() -> None:
        async with _server(once) as (url, accepted):
            pool = _pool()
            assert await pool.post(url, "/x", b"{}") == (200, b"{}")
            await asyncio.sleep(0.05)  # the FIN arrives; the pooled connection is dropped
            assert await pool.post(url, "/x", b"{}") == (200, b"{}")
            assert len(accepted) == 2
            pool.close()

    run(main())


def test_idle_connections_past_keepalive_are_not_reused(run: Run) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(_answer(200, b"{}"))
            await writer.drain()

    async def main() -> None:
        async with _server(echo) as (url, accepted):
            pool = _pool(keepalive_s=0.05)
            await pool.post(url, "/x", b"{}")
            await asyncio.sleep(0.1)
            await pool.post(url, "/x", b"{}")
            assert len(accepted) == 2
            pool.close()

    run(main())


GARBAGE = b"SSH-2.0-OpenSSH_9.6p1 not-an-http-server-at-all-but-longer"


def test_failures_raise_upstream_call_error(run: Run) -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # never answers

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(GARBAGE + b"\r\n\r\n")
        await reader.read()

    async def main() -> None:
        async with _server(hang) as (url, _):
            with pytest.raises(UpstreamCallError, match="TimeoutError"):
                await _pool(timeout_s=0.1).post(url, "/x", b"{}")
        async with _server(reset) as (url, _):
            with pytest.raises(UpstreamCallError):
                await _pool().post(url, "/x", b"{}")
        async with _server(garbage) as (url, _):
            with pytest.raises(UpstreamCallError) as bad:
                await _pool().post(url, "/x", b"{}")
            # the first 40 bytes of what came instead of a status line
            assert str(bad.value) == f"bad HTTP answer: status line {GARBAGE[:40]!r}"
        async with _server(hang) as (url, _):
            pass  # closed: nothing listens on its port any more
        with pytest.raises(UpstreamCallError, match="Error"):
            await _pool().post(url, "/x", b"{}")

    run(main())


def test_an_engine_that_does_not_accept_times_out_connecting(run: Run) -> None:
    """A listening socket whose accept queue is full (the engine is stuck): the kernel
    drops the SYN, the connect hangs, and the pool gives up after its connect timeout."""
    async def main() -> None:
        with socket.socket() as srv:
            srv.bind((HOST, 0))
            srv.listen(0)
            port = srv.getsockname()[1]
            fillers = [socket.socket() for _ in range(4)]
            try:
                for c in fillers:
                    c.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        c.connect((HOST, port))
                await asyncio.sleep(0.1)
                started = time.monotonic()
                with pytest.raises(UpstreamCallError, match=r"^ConnectTimeoutError$"):
                    await _pool(timeout_s=0.3).post(f"http://{HOST}:{port}", "/x", b"{}")
                assert 0.25 <= time.monotonic() - started < 5
            finally:
                for c in fillers:
                    c.close()

    run(main())


def test_a_cancelled_call_closes_its_connection(run: Run) -> None:
    closed = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # returns b"" when the client closes
        closed.set()

    async def main() -> None:
        async with _server(slow) as (url, _):
            pool = _pool()
            task = asyncio.create_task(pool.post(url, "/x", b"{}"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(closed.wait(), 2)

    run(main())


def test_get_reads_health_and_metrics_pages_over_one_connection(run: Run) -> None:
    """The background checks' GETs: no body sent, answers read whole, the connection kept."""
    seen: list[bytes] = []

    async def pages(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head)
            body = b"vllm:num_requests_running 1\n" if b" /metrics " in head else b""
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                         + body)
            await writer.drain()

    async def main() -> None:
        async with _server(pages) as (url, accepted):
            pool = _pool()
            assert await pool.get(url, "/health", 1.0) == (200, b"")
            assert await pool.get(url, "/metrics", 1.0) == (
                200, b"vllm:num_requests_running 1\n")
            assert len(accepted) == 1
            assert seen[0] == (f"GET /health HTTP/1.1\r\nHost: {url[len('http://'):]}\r\n"
                               "Accept: */*\r\n\r\n").encode()
            pool.close()

    run(main())


def test_a_get_that_hangs_fails_within_its_own_timeout(run: Run) -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def main() -> None:
        async with _server(hang) as (url, _):
            pool = _pool(timeout_s=30.0)  # the pool's own limits are far longer
            started = time.monotonic()
            with pytest.raises(UpstreamCallError, match="TimeoutError"):
                await pool.get(url, "/health", 0.2)
            assert time.monotonic() - started < 5

    run(main())


def test_only_plain_http_engines_use_the_lean_client() -> None:
    assert UpstreamPool.supports("http://10.0.0.1:8000")
    assert not UpstreamPool.supports("https://engine:8443")


def test_engine_metrics_sum_label_sets_and_read_cache_config() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_waiting Waiting requests",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="a } b"} 2.0 1700000000000',
        'vllm:num_requests_running{engine="0"} 4',
        "vllm:kv_cache_usage_perc 0.25",
        'vllm:kv_cache_usage_perc{engine="1"} 0.5',
        'vllm:prefix_cache_hits_total{engine="0"} 10',
        'vllm:prefix_cache_hits_created{engine="0"} 1.7e9',
        'vllm:prefix_cache_queries_total{engine="0"} 40',
        'vllm:cache_config_info{block_size="16",model_name="x\\"y",num_gpu_blocks="512"} 1.0',
        'vllm:num_requests_running{engine="1"} not-a-number',
        "process_cpu_seconds_total 12.5",
    ])
    st = parse_engine_metrics(text)
    assert (st.waiting, st.running, st.kv_usage) == (5.0, 4.0, 0.5)
    assert (st.prefix_hits, st.prefix_queries) == (10.0, 40.0)
    assert (st.block_size, st.num_gpu_blocks) == (16, 512)
    assert parse_engine_metrics("garbage\n{}").waiting == 0.0


def test_fastjson_accepts_what_json_accepts_with_the_same_errors() -> None:
    import json

    from mooncake_gateway import fastjson

    for text in (b'{"a": 1, "a": 2}', b"[NaN, Infinity]", b"[1e400]", b'"\\ud800"',
                 '{"x": "é"}'.encode("utf-16"), b'{"prompt": [1, 2, 3]}'):
        got, want = fastjson.loads(text), json.loads(text)
        assert json.dumps(got) == json.dumps(want)
    for bad in (b"", b"{", b"[1,]", b"\xff"):
        with pytest.raises(ValueError) as ours:
            fastjson.loads(bad)
        with pytest.raises(ValueError) as theirs:
            json.loads(bad)
        assert str(ours.value) == str(theirs.value)
    assert fastjson.dumps({"a": [1, None, "x"]}) == b'{"a":[1,null,"x"]}'
    assert json.loads(fastjson.dumps({"big": 1 << 70})) == {"big": 1 << 70}
