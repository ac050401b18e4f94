"""Fuzz: random JSON (mostly almost-valid requests) never gets a 5xx and never hangs."""

from __future__ import annotations

import json
import socket
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Cluster
from .gateway_fixtures import MODEL

TIMEOUT_S = 20
SERVER_ERROR = 500

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=False), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12)
small_tokens = st.integers(min_value=1, max_value=8)
prompt = st.one_of(st.text(max_size=200), st.lists(st.integers(-5, 140000), max_size=50),
                   st.lists(st.text(max_size=20), max_size=3), json_value)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), json_value)},
    optional={"content": st.one_of(st.text(max_size=100), st.none(), json_value,
                                   st.lists(st.fixed_dictionaries(
                                       {"type": st.just("text"), "text": st.text(max_size=30)}),
                                       max_size=2))})
common = {
    "model": st.one_of(st.just(MODEL), json_value),
    "max_tokens": st.one_of(small_tokens, json_value),
    "stream": st.one_of(st.booleans(), json_value),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                json_value),
    "temperature": st.one_of(st.floats(0, 2), json_value),
    "n": st.one_of(st.just(1), json_value),
}
completion = st.fixed_dictionaries({"prompt": prompt},
                                   optional=common)
chat = st.fixed_dictionaries({
                              "messages": st.one_of(st.lists(message, max_size=4), json_value)},
                             optional={**common, "max_completion_tokens": small_tokens})


def _post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    """Raw HTTP/1.1 so that any status and any body (SSE included) is read to the end."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data


def _check(cluster: Cluster, path: str, body: bytes) -> None:
    status, data = _post(cluster.gateway.port, path, body)
    assert status < SERVER_ERROR, data[:500]
    if status >= 400:
        payload = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert set(payload["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=completion)
def test_completions_fuzz(cluster: Cluster, body: dict[str, Any]) -> None:
    _check(cluster, "/v1/completions", json.dumps(body).encode())


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chat)
def test_chat_fuzz(cluster: Cluster, body: dict[str, Any]) -> None:
    _check(cluster, "/v1/chat/completions", json.dumps(body).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies_fuzz(cluster: Cluster, raw: bytes, path: str) -> None:
    _check(cluster, path, raw)


def test_openapi_description_is_served(cluster: Cluster) -> None:
    spec = cluster.gateway.get("/openapi.json")
    assert spec["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/conductor/state"} <= set(spec["paths"])


header_name = st.sampled_from([
    "Content-Length", "content-length", "Transfer-Encoding", "Connection", "Expect",
    "X-Conductor-Explain", "Host", "Content-Type", " Folded", "Bad Name", "X-Junk",
])
header_value = st.one_of(
    st.sampled_from(["0", "5", "17", "-1", "1e3", "999999999999", "chunked", "close",
                     "keep-alive, Upgrade", "100-continue", "1", ""]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["POST", "GET", "PUT", "post"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                             "/nope", "/v1/completions?x=1"]),
       version=st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1 x"]),
       headers=st.lists(st.tuples(header_name, header_value), max_size=5),
       body=st.one_of(st.just(json.dumps({"model": MODEL, "prompt": "hi",
                                          "max_tokens": 2}).encode()),
                      st.binary(max_size=40)))
def test_request_heads_fuzz(cluster: Cluster, method: str, path: str, version: str,
                            headers: list[tuple[str, str]], body: bytes) -> None:
    """Odd request heads (the fast front end parses the plain ones itself and hands the
    rest to aiohttp) and bodies shorter or longer than declared: never a 5xx, never a
    hang — every connection is answered or closed once the client stops sending."""
    head = f"{method} {path} {version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers)
    with socket.create_connection(("127.0.0.1", cluster.gateway.port),
                                  timeout=TIMEOUT_S) as s:
        s.sendall(head.encode("latin-1") + b"\r\n" + body)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):  # a hang raises socket.timeout
            data += chunk
    statuses = [int(line.split(b" ", 2)[1]) for line in data.split(b"\r\n")
                if line.startswith(b"HTTP/1.") and line[9:12].isdigit()]
    assert all(code < SERVER_ERROR for code in statuses), data[:500]
