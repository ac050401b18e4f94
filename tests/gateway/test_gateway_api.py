"""The OpenAI API through the gateway (official client), errors, introspection endpoints."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from .conftest import FAST, Cluster
from .gateway_fixtures import MODEL, http_json, model_config, run_gateway, run_worker, wait_for

LONG = " ".join(f"shared{i % 53} word{i}" for i in range(200))  # 400 tokens


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.gateway.base_url, api_key="x", max_retries=0, timeout=30)


def direct(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.decode[0].base_url, api_key="x", max_retries=0, timeout=30)


def test_models_lists_the_served_model(cluster: Cluster) -> None:
    ids = [m.id for m in client(cluster).models.list().data]
    assert ids == [MODEL]


def test_completion_non_stream_matches_a_single_worker(cluster: Cluster) -> None:
    got = client(cluster).completions.create(model=MODEL, prompt=LONG, max_tokens=8)
    ref = direct(cluster).completions.create(model=MODEL, prompt=LONG, max_tokens=8)
    assert got.choices[0].text == ref.choices[0].text
    assert got.usage is not None and got.usage.completion_tokens == 8


def test_completion_stream(cluster: Cluster) -> None:
    chunks = list(client(cluster).completions.create(
        model=MODEL, prompt=LONG + " stream", max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ref = direct(cluster).completions.create(model=MODEL, prompt=LONG + " stream", max_tokens=6)
    assert text == ref.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_chat_non_stream_and_stream(cluster: Cluster) -> None:
    msgs: list[Any] = [{"role": "system", "content": LONG},
                       {"role": "user", "content": "what now?"}]
    c = client(cluster)
    one = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    text = one.choices[0].message.content
    assert text
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                            stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text


def test_repeated_prefix_goes_where_it_is_cached(cluster: Cluster) -> None:
    g = cluster.gateway
    body = {"model": MODEL, "prompt": LONG + " again", "max_tokens": 2}
    status, _h, _b = g.post("/v1/completions", body)
    assert status == 200
    first = g.get("/conductor/decisions?limit=1")[-1]
    # the KV events of the first prefill reach the index
    wait_for(lambda: g.state()["index"]["blocks"] > 0)
    status, headers, data = g.post("/v1/completions", body, {"x-conductor-explain": "1"})
    assert status == 200
    decision = json.loads(headers["x-conductor-decision"])
    assert decision["prefill"] == first["prefill"]
    assert decision["local_blocks"] == 400 // 16
    assert data["conductor"]["candidates"][0]["matched_blocks"] == 400 // 16
    assert {"queue_s", "prefill_s", "ttft_s"} <= set(data["conductor"]["candidates"][0])


def test_state_index_matches_the_workers(cluster: Cluster) -> None:
    g = cluster.gateway
    client(cluster).completions.create(model=MODEL, prompt=LONG + " index", max_tokens=1)

    def agree() -> bool:
        st = g.state()
        held = sum(len(w.get("/kv/blocks")["keys"]) for w in cluster.prefill)
        return bool(st["index"]["entries"] == held and held > 0)

    wait_for(agree)
    st = g.state()
    assert st["block_size"] == 16
    assert all(p["routable"] for p in st["prefill"])


def test_metrics_exposes_gateway_series(cluster: Cluster) -> None:
    client(cluster).completions.create(model=MODEL, prompt="metrics please", max_tokens=1)
    import urllib.request

    with urllib.request.urlopen(cluster.gateway.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ("mooncake_gateway_requests_total", "mooncake_gateway_decision_seconds_bucket",
                 "mooncake_gateway_prompt_tokens_total", "mooncake_gateway_index_blocks",
                 "mooncake_gateway_kv_events_total", "mooncake_gateway_instance_inflight",
                 "mooncake_gateway_time_to_first_token_seconds"):
        assert name in text, name


def test_hot_prefixes_lists_a_popular_prefix(cluster: Cluster) -> None:
    g = cluster.gateway
    prompt = LONG + " hot"
    for _ in range(12):
        g.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    hot = g.get("/conductor/hot-prefixes")
    assert hot, "no hot prefix"
    top = hot[0]
    assert {"prefix", "rate_per_s", "holders", "blocks"} <= set(top)
    assert top["holders"]
    assert "token_ids" not in top
    # with tokens=1: the prefix's token ids (what an agent in front of vLLM warms), and
    # the holders' predicted waits
    from mooncake_contract.tokenizer import Tokenizer

    hot = g.get(f"/conductor/hot-prefixes?model={MODEL}&tokens=1")
    top = next(h for h in hot if h["prefix"] == top["prefix"])
    want = Tokenizer().encode(prompt)[: top["blocks"] * 16]
    assert top["token_ids"] == want and len(want) == top["tokens"]
    assert set(top["holders_predicted_wait_s"]) == set(top["holders"])
    assert all(w >= 0 for w in top["holders_predicted_wait_s"].values())
    urls = {w.url for w in cluster.prefill}
    assert set(top["holders"]) <= urls  # static endpoints: named by their URL
    assert http_json(g.url + "/conductor/hot-prefixes?tokens=maybe")[0] == 400


@pytest.mark.parametrize("body,status,param", [
    (b"not json", 400, None),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, -5]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
])
def test_bad_input_is_an_openai_error(cluster: Cluster, body: Any, status: int,
                                      param: str | None) -> None:
    got, _h, data = cluster.gateway.post("/v1/completions", body)
    assert got == status
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


def test_unknown_route_is_json_404(cluster: Cluster) -> None:
    status, _h, data = cluster.gateway.post("/v1/nothing", {})
    assert status == 404 and "error" in data


def test_openai_client_sees_a_429_with_retry_after() -> None:
    with run_worker(*FAST) as w:
        strict = model_config([w], [w], conductor={"policy": "conductor",
                                                   "slo": {"ttft_s": 1e-9}})
        with run_gateway([strict], retry_after_s=3, max_body_bytes=100_000) as g:
            status, _h, data = g.post("/v1/completions",
                                      {"model": MODEL, "prompt": "x " * 100_000})
            assert status == 413 and set(data["error"]) == {"message", "type", "param", "code"}
            status, headers, data = g.post("/v1/completions",
                                           {"model": MODEL, "prompt": LONG, "max_tokens": 2})
            assert status == 429
            assert headers["Retry-After"] == "3"
            assert data["error"]["type"] == "rate_limit_error"
            assert data["error"]["code"] == "ttft_slo"
            c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
            wait_for(lambda: "ttft-slo" in _metric_text(g.url))


def _metric_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def test_one_gateway_serves_two_models() -> None:
    with run_worker(*FAST) as a, run_worker(*FAST, "--model", "other-sim") as b:
        models = [model_config([a], [a]), model_config([b], [b], name="other-sim",
                                                       conductor={"policy": "round-robin"})]
        with run_gateway(models) as g:
            c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
            assert sorted(m.id for m in c.models.list().data) == [MODEL, "other-sim"]
            for name in (MODEL, "other-sim"):
                r = c.completions.create(model=name, prompt="hello there", max_tokens=2)
                assert r.model == name
            assert g.state("other-sim")["policy"] == "round-robin"


def test_short_uncached_prompts_skip_disaggregation() -> None:
    with run_worker(*FAST) as p, run_worker(*FAST) as d:
        model = model_config([p], [d], direct={"uncached_tokens_below": 64})
        with run_gateway([model]) as g:
            c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
            c.completions.create(model=MODEL, prompt="short one", max_tokens=2)
            c.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
            short, long_ = g.get("/conductor/decisions?limit=2")
            assert short["direct"] is True and short["attempts"] == []
            assert long_["direct"] is False and long_["attempts"][0]["status"] == 200
            # only the long prompt was prefilled on the prefill worker
            assert p.metric("vllm:prefix_cache_queries_total") == long_["prompt_tokens"]
            # the decode engine now holds the long prompt (its KV events say so): the same
            # prompt again has nothing uncached there and goes straight to decode
            wait_for(lambda: g.state()["decode"][0]["index_blocks"] >= 400 // 16)
            c.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
            again = g.get("/conductor/decisions?limit=1")[-1]
            assert again["direct"] is True and again["decode_held_blocks"] == 400 // 16


def test_engine_tokenizer_mode_routes_like_the_local_one() -> None:
    with run_worker(*FAST) as w, run_gateway([model_config([w], [w])], tokenizer="engine") as g:
        c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": LONG}]
        for _ in range(2):  # the second is served from the whole-prompt cache
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
            c.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
        chat, prompt = g.get("/conductor/decisions?limit=4")[:2]
        from mooncake_contract.tokenizer import Tokenizer

        assert chat["prompt_tokens"] == len(Tokenizer().encode_chat(msgs))
        assert prompt["prompt_tokens"] == len(Tokenizer().encode(LONG))


def test_aiohttp_client_and_asyncio_loop_settings_serve_the_same() -> None:
    """``lean_upstream``, ``uvloop`` and ``fast_front`` false (the fallbacks) answer as the
    defaults."""
    with run_worker(*FAST, "--role", "prefill") as p0, \
            run_worker(*FAST, "--role", "decode") as d0:
        model = model_config([p0], [d0], max_model_len=16384)
        answers = []
        for opts in ({}, {"lean_upstream": False, "uvloop": False, "fast_front": False}):
            with run_gateway([model], **opts) as g:
                c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)
                one = c.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
                streamed = "".join(ch.choices[0].text for ch in c.completions.create(
                    model=MODEL, prompt=LONG, max_tokens=4, stream=True) if ch.choices)
                answers.append((one.choices[0].text, streamed))
                log = g.log()
                assert ("upstream client aiohttp" in log) == bool(opts)
                assert ("event loop asyncio" in log) == bool(opts)
                assert ("front end aiohttp" in log) == bool(opts)
        assert answers[0] == answers[1] and answers[0][0] == answers[0][1]
