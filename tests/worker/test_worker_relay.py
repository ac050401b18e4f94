"""Relay mode: the worker in front of an engine that speaks vLLM's formats (here a
simulated worker stands in for vLLM): API proxied, KV events relayed unchanged, metrics
merged, the agent warms prefixes through the engine."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import openai
import zmq
import zmq.asyncio
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_contract.annotations import REPLICA_ANNOTATION
from worker_fixtures import WorkerProc, run_worker

MODEL = "llama3-70b-sim"


def relay_args(engine: WorkerProc, *extra: str) -> tuple[str, ...]:
    return ("--engine-url", engine.url, "--engine-kv-events", engine.kv_endpoint,
            "--engine-kv-replay", engine.replay_endpoint, *extra)


def test_relay_proxies_api_events_and_metrics(tmp_path: Path) -> None:
    ann = tmp_path / "annotations"
    tokens = list(range(7000, 7000 + 64))
    keys = block_keys(tokens, 16, namespace_seed(MODEL, 16))
    with run_worker("--time-scale", "0") as engine, \
            run_worker(*relay_args(engine, "--annotations-file", str(ann),
                                   "--agent-poll", "0.05")) as relay:
        direct = openai.OpenAI(base_url=engine.base_url, api_key="x", max_retries=0)
        via = openai.OpenAI(base_url=relay.base_url, api_key="x", max_retries=0)
        prompt = "relay this prompt please " * 10

        r = via.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
        assert r.choices[0].text == direct.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5).choices[0].text

        async def replay_all(endpoint: str) -> list[bytes]:
            ctx = zmq.asyncio.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            out = []
            while True:
                msg = await asyncio.wait_for(dealer.recv_multipart(), 5)
                if msg[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                out.append(msg[3])
            dealer.close(0)
            ctx.term()
            return out

        async def both() -> tuple[list[bytes], list[bytes]]:
            return await replay_all(engine.replay_endpoint), await replay_all(
                relay.replay_endpoint)

        end = time.monotonic() + 10
        from_engine, from_relay = asyncio.run(both())
        while from_relay != from_engine and time.monotonic() < end:
            time.sleep(0.1)
            from_engine, from_relay = asyncio.run(both())
        assert from_engine and from_relay == from_engine  # payloads relayed byte for byte

        # streaming passes through
        chunks = list(via.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        # errors pass through with their status
        try:
            via.completions.create(model="nope", prompt="x", max_tokens=1)
            raise AssertionError("expected 404")
        except openai.NotFoundError:
            pass
        # metrics: the engine's plus the relay's own
        with urllib.request.urlopen(relay.url + "/metrics") as resp:
            text = resp.read().decode()
        assert "vllm:num_requests_running" in text
        assert "mooncake_worker:relayed_batches_total" in text

        # the agent warms a prefix through the engine and sees it in the relayed events
        value = json.dumps([{"prefix": "p", "tokens": tokens}])
        ann.write_text(f'{REPLICA_ANNOTATION}="{value.replace(chr(34), chr(92) + chr(34))}"\n')
        end = time.monotonic() + 10
        state = relay.get("/agent/state")
        while time.monotonic() < end and (
                not state["replicas"] or state["replicas"][0]["state"] != "ready"):
            time.sleep(0.05)
            state = relay.get("/agent/state")
        assert state["replicas"][0]["state"] == "ready", state
        assert state["replicas"][0]["held_blocks"] == 4
        assert set(keys) <= set(engine.get("/kv/blocks")["keys"])


def test_relay_engine_down_is_502_but_the_relay_itself_is_alive() -> None:
    """``/health`` is the engine's (the pod's readiness: not ready while the engine is
    down or loading); ``/livez`` is the relay's own (its liveness: the kubelet must not
    restart the relay for an engine that takes minutes to load)."""
    from worker_fixtures import http_json

    with run_worker("--engine-url", "http://127.0.0.1:9", ready_any=True) as relay:
        code, body = relay.post("/v1/completions", {"prompt": "x"})
        assert code == 502 and body["error"]["code"] == "engine_unavailable"
        assert http_json(relay.url + "/health")[0] == 502
        assert http_json(relay.url + "/livez")[0] == 200


def test_relay_announces_engine_restart() -> None:
    from mooncake_contract.kvevents import AllBlocksCleared, KVEventBatch
    from mooncake_contract.kvevents.subscriber import KVEventSubscriber
    from worker_fixtures import free_port

    port, kv, replay = free_port(), free_port(), free_port()
    fixed = (port, kv, replay)
    eng_url, eng_kv = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv}"
    args = ("--engine-url", eng_url, "--engine-kv-events", eng_kv,
            "--engine-kv-replay", f"tcp://127.0.0.1:{replay}")
    got: list[KVEventBatch] = []
    with run_worker("--time-scale", "0", ports=fixed) as first, run_worker(*args) as relay:
        sub = KVEventSubscriber(relay.kv_endpoint, lambda _s, b: got.append(b),
                                replay_endpoint=relay.replay_endpoint, expected_seq=0)

        async def phase(n: int) -> None:
            task = asyncio.create_task(sub.run())
            await asyncio.sleep(0.3)
            for i in range(n):
                await asyncio.to_thread(
                    relay.post, "/v1/completions", {"prompt": f"restart test {i} " * 10,
                                                    "max_tokens": 1})
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(phase(3))
        assert first.get("/health") is None  # engine up
        first.proc.terminate()
        first.proc.wait(10)
        with run_worker("--time-scale", "0", ports=fixed):
            asyncio.run(phase(1))
    cleared = [b for b in got if any(isinstance(e, AllBlocksCleared) for e in b.events)]
    assert len(cleared) == 1
    assert sub.lost == 0 and sub.restarts == 0  # the relay's own sequence never went back


def test_a_warm_up_is_a_one_token_completion_sglang_with_its_stand_in_bootstrap() -> None:
    """A disaggregated SGLang engine refuses a request without a bootstrap room; SGLang's
    stand-in host makes it keep the KV and send it nowhere (held to SGLang's own constant
    in tests/conformance/test_pd.py)."""
    from mooncake_worker.relay import warm_body

    assert warm_body("vllm", "m", [1, 2]) == {"model": "m", "prompt": [1, 2], "max_tokens": 1}
    assert warm_body("sglang", "m", [3]) == {"model": "m", "prompt": [3], "max_tokens": 1,
                                             "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
