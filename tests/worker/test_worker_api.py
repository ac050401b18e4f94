"""The OpenAI-compatible API through the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest
from mooncake_contract.tokenizer import Tokenizer
from worker_fixtures import WorkerProc

MODEL = "llama3-70b-sim"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the window."


@pytest.fixture(scope="module")
def client(worker: WorkerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.base_url, api_key="none", max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_non_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == len(Tokenizer().encode(PROMPT))
    assert len(r.choices[0].text.split()) == 7
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)
    assert again.choices[0].text == r.choices[0].text  # deterministic


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9).choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=9, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_token_id_prompt(client: openai.OpenAI) -> None:
    ids = Tokenizer().encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5).choices[0].text
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5).choices[0].text
    assert by_ids == by_text


def test_longer_output_extends_shorter(client: openai.OpenAI) -> None:
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].text
    long = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20).choices[0].text
    assert long.startswith(short)


def test_chat_non_stream_and_stream(client: openai.OpenAI) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    content = r.choices[0].message.content
    assert content and len(content.split()) == 6
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


def test_chat_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
    ))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_prefix_cache_hit_reported(client: openai.OpenAI, worker: WorkerProc) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(200))
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    hits_before = worker.metric("vllm:prefix_cache_hits_total")
    r = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 192  # 12 full blocks of 16
    assert worker.metric("vllm:prefix_cache_hits_total") - hits_before == 192


def test_tokenize(worker: WorkerProc) -> None:
    status, body = worker.post("/tokenize", {"prompt": PROMPT})
    assert status == 200
    assert body["tokens"] == Tokenizer().encode(PROMPT)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096
    status, chat = worker.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert chat["tokens"] == Tokenizer().encode_chat([{"role": "user", "content": "hi"}])


def test_health_and_metrics(worker: WorkerProc) -> None:
    import urllib.request

    with urllib.request.urlopen(worker.url + "/health") as r:
        assert r.status == 200
    with urllib.request.urlopen(worker.url + "/metrics") as r:
        text = r.read().decode()
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    info = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
    assert info and 'block_size="16"' in info[0]
