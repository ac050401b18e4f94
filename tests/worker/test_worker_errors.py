"""Bad input and overload: OpenAI-style JSON errors, 429 with Retry-After, disconnects."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

import openai
import pytest
from worker_fixtures import HOST, WorkerProc, run_worker

MODEL = "llama3-70b-sim"


def raw_post(w: WorkerProc, path: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    conn = http.client.HTTPConnection(HOST, w.port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read())
    headers = dict(r.getheaders())
    conn.close()
    return r.status, data, headers


def assert_error(status: int, body: dict[str, Any], want: int, param: str | None = None) -> None:
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"text"'])
def test_malformed_json(worker: WorkerProc, path: str, body: bytes) -> None:
    status, data, _ = raw_post(worker, path, body)
    assert_error(status, data, 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 12}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1.5, 2]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stream_options": []}, "stream_options"),
        ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "model": 7}, "model"),
        ({"prompt": "hi", "kv_transfer_params": "x"}, "kv_transfer_params"),
    ],
)
def test_completions_bad_fields(worker: WorkerProc, body: dict[str, Any], param: str) -> None:
    status, data = worker.post("/v1/completions", body)
    assert_error(status, data, 400, param)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "hello"},
        {"messages": ["hello"]},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": [], "content": "x"}]},  # unhashable: found by the gateway fuzz
        {"messages": [{"role": {"a": 1}, "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    ],
)
def test_chat_bad_fields(worker: WorkerProc, body: dict[str, Any]) -> None:
    status, data = worker.post("/v1/chat/completions", body)
    assert_error(status, data, 400)


def test_tokenize_bad(worker: WorkerProc) -> None:
    assert_error(*worker.post("/tokenize", {}), 400)
    assert_error(*worker.post("/tokenize", {"prompt": 3}), 400)
    assert_error(*worker.post("/tokenize", {"messages": [{"role": 1}]}), 400)


def test_context_window(worker: WorkerProc) -> None:
    # the module worker runs with --max-model-len 4096
    status, data = worker.post("/v1/completions", {"prompt": [300] * 4096, "max_tokens": 1})
    assert_error(status, data, 400, "prompt")
    assert data["error"]["code"] == "context_length_exceeded"
    status, data = worker.post("/v1/completions", {"prompt": [300] * 4000, "max_tokens": 100})
    assert_error(status, data, 400, "max_tokens")
    c = openai.OpenAI(base_url=worker.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w " * 5000}], max_tokens=1
        )


def test_unknown_model(worker: WorkerProc) -> None:
    c = openai.OpenAI(base_url=worker.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as ei:
        c.completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    assert ei.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )


def test_unknown_route_and_method(worker: WorkerProc) -> None:
    assert_error(*worker.post("/v1/nothing", {}), 404)
    conn = http.client.HTTPConnection(HOST, worker.port, timeout=10)
    conn.request("GET", "/v1/completions")
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 405 and "error" in body


def test_queue_full_is_429_with_retry_after() -> None:
    # slow engine: 1 running, 1 waiting; the rest must be refused at once
    with run_worker("--time-scale", "1", "--max-running", "1", "--max-waiting", "1") as w:
        results: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        body = json.dumps({"prompt": "hello there", "max_tokens": 40}).encode()

        def call() -> None:
            results.append(raw_post(w, "/v1/completions", body))

        threads = [threading.Thread(target=call) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        statuses = sorted(r[0] for r in results)
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
        for status, data, headers in results:
            if status == 429:
                assert_error(status, data, 429)
                assert int(headers["Retry-After"]) >= 0
        c = openai.OpenAI(base_url=w.base_url, api_key="x", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


def test_client_disconnect_mid_stream_frees_kv_and_slot() -> None:
    with run_worker("--time-scale", "1", "--max-running", "4") as w:
        body = json.dumps(
            {"prompt": " ".join(["tok"] * 100), "max_tokens": 2000, "stream": True}
        ).encode()
        s = socket.create_connection((HOST, w.port))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        got = b""
        deadline = time.monotonic() + 10
        while got.count(b"data: ") < 3 and time.monotonic() < deadline:
            got += s.recv(65536)
        assert got.count(b"data: ") >= 3
        assert w.metric("vllm:num_requests_running") == 1
        assert w.get("/kv/blocks")["used_blocks"] > 0
        s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if (w.metric("vllm:num_requests_running") == 0
                    and w.get("/kv/blocks")["used_blocks"] == 0):
                break
            time.sleep(0.05)
        assert w.metric("vllm:num_requests_running") == 0
        assert w.get("/kv/blocks")["used_blocks"] == 0
        assert w.metric("vllm:kv_cache_usage_perc") == 0


def test_client_disconnect_while_waiting_non_stream_frees_kv() -> None:
    with run_worker("--time-scale", "1") as w:
        body = json.dumps({"prompt": " ".join(["tok"] * 100), "max_tokens": 2000}).encode()
        s = socket.create_connection((HOST, w.port))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        deadline = time.monotonic() + 5
        while w.metric("vllm:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.metric("vllm:num_requests_running") == 1
        s.close()
        deadline = time.monotonic() + 5
        while w.metric("vllm:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.metric("vllm:num_requests_running") == 0
        assert w.get("/kv/blocks")["used_blocks"] == 0


def test_body_too_large_is_413_json() -> None:
    with run_worker("--time-scale", "0", "--max-body-bytes", "10000") as w:
        status, data, _ = raw_post(w, "/v1/completions",
                                   json.dumps({"prompt": "x " * 20000}).encode())
        assert_error(status, data, 413)
