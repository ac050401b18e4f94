"""Failures and membership: prefill retry, dead workers, new workers, mid-stream decode
failure, replicas agreeing on the index."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request

import openai
import pytest

from .conftest import FAST
from .gateway_fixtures import (
    HOST,
    MODEL,
    endpoint,
    model_config,
    run_gateway,
    run_worker,
    wait_for,
)

PROMPT = " ".join(f"tok{i % 41} item{i}" for i in range(120))
FAST_HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 0.5, "unhealthy_after": 2}


def _complete(url: str, prompt: str = PROMPT, max_tokens: int = 2) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens).choices[0].text


def test_prefill_failure_is_retried_on_another_instance() -> None:
    with run_worker(*FAST) as w, run_worker(*FAST) as gone:
        model = {"name": MODEL, "prefill": [endpoint(gone), endpoint(w)],
                 "decode": [{"url": w.url}], "conductor": {"policy": "round-robin"}}
        # health checks far apart: once registered, the instance that dies stays
        # routable, so requests hit it
        with run_gateway([model], health_interval_s=60) as g:
            wait_for(lambda: all(p["routable"] for p in g.state()["prefill"]))
            gone.proc.kill()
            gone.proc.wait()
            for i in range(6):
                assert _complete(g.url, PROMPT + f" {i}")
            decisions = g.get("/conductor/decisions?limit=6")
            retried = [d for d in decisions if len(d["attempts"]) > 1]
            assert retried, decisions
            assert all(d["attempts"][-1]["status"] == 200 for d in retried)


def test_dead_worker_leaves_routing_and_its_index_entries_go() -> None:
    with run_worker(*FAST) as a, run_worker(*FAST) as d:
        b_ctx = run_worker(*FAST)
        b = b_ctx.__enter__()
        try:
            model = model_config([a, b], [d], conductor={"policy": "round-robin"})
            with run_gateway([model], **FAST_HEALTH) as g:
                for i in range(4):
                    _complete(g.url, PROMPT + f" {i}")
                wait_for(lambda: g.state()["prefill"][1]["index_blocks"] > 0)
                b.proc.kill()
                b.proc.wait()
                t0 = time.monotonic()
                wait_for(lambda: not g.state()["prefill"][1]["routable"], timeout=5)
                assert time.monotonic() - t0 < 3
                st = g.state()
                assert st["prefill"][1]["index_blocks"] == 0
                for i in range(4):  # all go to the survivor
                    assert _complete(g.url, PROMPT + f" after {i}")
        finally:
            b_ctx.__exit__(None, None, None)


def test_new_worker_joins_from_the_endpoints_file() -> None:
    with run_worker(*FAST) as a, run_worker(*FAST) as b:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            with open(path, "w") as f:
                json.dump({"prefill": [endpoint(a)], "decode": [{"url": a.url}]}, f)
            model = {"name": MODEL, "endpoints_file": path,
                     "conductor": {"policy": "round-robin"}}
            with run_gateway([model], discovery_poll_s=0.1) as g:
                assert len(g.state()["prefill"]) == 1
                time.sleep(0.05)
                with open(path, "w") as f:
                    json.dump({"prefill": [endpoint(a), endpoint(b)],
                               "decode": [{"url": a.url}]}, f)
                wait_for(lambda: len(g.state()["prefill"]) == 2)
                for i in range(4):
                    _complete(g.url, PROMPT + f" {i}")
                wait_for(lambda: g.state()["prefill"][1]["index_blocks"] > 0)
                with open(path, "w") as f:
                    json.dump({"prefill": [endpoint(b)], "decode": [{"url": a.url}]}, f)
                wait_for(lambda: not g.state()["prefill"][0]["routable"])
                assert g.state()["prefill"][0]["index_blocks"] == 0
        finally:
            os.unlink(path)


def test_decode_failure_mid_stream_ends_with_an_error_event() -> None:
    with run_worker(*FAST) as p, run_worker("--time-scale", "1") as d:
        model = model_config([p], [d])
        with run_gateway([model]) as g:
            c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)
            stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000,
                                          stream=True)
            got = 0
            with pytest.raises(openai.APIError):
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        got += 1
                        if got == 3:
                            d.proc.kill()
            assert got >= 3


def test_two_replicas_agree_on_the_index_even_when_one_starts_late() -> None:
    with run_worker(*FAST) as a, run_worker(*FAST) as b, run_worker(*FAST) as d:
        model = model_config([a, b], [d], conductor={"policy": "round-robin"})
        with run_gateway([model]) as g1:
            for i in range(6):
                _complete(g1.url, PROMPT + f" {i}")
            with run_gateway([model]) as g2:  # joins after the events: replays them
                def same() -> bool:
                    s1, s2 = g1.state()["index"], g2.state()["index"]
                    return bool(s1["digest"] == s2["digest"] and s1["entries"] > 0)

                wait_for(same)
                for i in range(4):
                    _complete(g2.url, PROMPT + f" via g2 {i}")
                wait_for(same)
                with urllib.request.urlopen(a.url + "/kv/blocks") as r:
                    held = len(json.loads(r.read())["keys"])
                assert g2.state()["prefill"][0]["index_blocks"] == held


def test_client_disconnect_aborts_the_upstream_request() -> None:
    """Streamed (served by aiohttp) and not (the fast front end): closing the client's
    connection aborts the engine's request."""
    import socket

    with run_worker(*FAST) as p, run_worker("--time-scale", "1") as d, \
            run_gateway([model_config([p], [d])]) as g:
        for stream in (True, False):
            body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 5000,
                               "stream": stream}).encode()
            s = socket.create_connection((HOST, g.port), timeout=10)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body)
            if stream:
                assert b"200 OK" in s.recv(65536)
            wait_for(lambda: d.metric("vllm:num_requests_running") == 1)
            s.close()
            wait_for(lambda: d.metric("vllm:num_requests_running") == 0)
            wait_for(lambda: g.state()["decode"][0]["inflight"] == 0)
            assert _complete(g.url)  # still serving


def test_decode_instance_counts_a_request_in_flight_from_its_decision() -> None:
    """The operator retires a draining decode pod once the gateway reports nothing in
    flight on it: a request decided for it whose prefill still runs must count."""
    import threading

    slow = ("--time-scale", "1.0", "--max-model-len", "65536")
    with run_worker(*slow) as pf, run_worker(*FAST) as d, \
            run_gateway([model_config([pf], [d])], time_scale=1.0) as g:
        wait_for(lambda: all(i["routable"] for role in ("prefill", "decode")
                             for i in g.state()[role]))
        long_prompt = " ".join(f"w{i}" for i in range(12000))  # ~1.5 s of prefill
        t = threading.Thread(target=_complete, args=(g.url, long_prompt, 2))
        t.start()
        try:
            def both() -> bool:
                views = {i["role"]: i for m in g.get("/conductor/registry")["models"]
                         for i in m["instances"]}
                return views["prefill"]["inflight"] == 1 and \
                    views["decode"]["inflight"] == 1
            wait_for(both, timeout=5.0)
        finally:
            t.join(60)
        views = [i for m in g.get("/conductor/registry")["models"] for i in m["instances"]]
        assert all(i["inflight"] == 0 for i in views)
