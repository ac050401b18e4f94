"""The P/D handshake between two worker processes, with and without Mooncake Store: the
gateway's own fields (:mod:`mooncake_gateway.handshake`, vLLM's MooncakeConnector shape),
answered as vLLM answers them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_contract.tokenizer import Tokenizer
from mooncake_gateway.handshake import KVTransferParams, Transfer
from mooncake_gateway.settings import Endpoint
from worker_fixtures import Master, WorkerProc, run_worker

MODEL = "llama3-70b-sim"
PROMPT = " ".join(f"context{i % 97} piece{i}" for i in range(150))  # 300 tokens
MAX_TOKENS = 12


def client(w: WorkerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=w.base_url, api_key="x", max_retries=0, timeout=30)


def transfer_of(prefill: WorkerProc) -> Transfer:
    return Transfer.new(Endpoint(url=f"http://127.0.0.1:{prefill.port}", name="p",
                                 pod="serving/prefill-0"), None)


def handshake(prefill: WorkerProc, decode: WorkerProc, stream: bool = False,
              ) -> tuple[str, str, Any, dict[str, Any]]:
    """The gateway's two calls: the prefill with ``max_tokens=1`` and a transfer id, then
    the decode told which engine to pull that transfer from."""
    hs, t = KVTransferParams(), transfer_of(prefill)
    p = client(prefill).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, stream=False,
        extra_body=hs.prefill_fields(t))
    # like vLLM's MooncakeConnector, the prefill engine answers with no parameters
    assert (p.model_extra or {}).get("kv_transfer_params", "absent") is None
    kvp = hs.decode_fields(t)["kv_transfer_params"]
    if stream:
        chunks = list(client(decode).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"kv_transfer_params": kvp},
        ))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        d = client(decode).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
            extra_body={"kv_transfer_params": kvp},
        )
        text, usage = d.choices[0].text, d.usage
    return p.choices[0].text, text, usage, kvp


@pytest.fixture(scope="module")
def reference() -> Iterator[str]:
    with run_worker("--time-scale", "0", "--role", "both") as w:
        yield client(w).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS
        ).choices[0].text


def test_pd_without_store_recomputes(reference: str) -> None:
    with run_worker("--time-scale", "0", "--role", "prefill") as pw, \
            run_worker("--time-scale", "0", "--role", "decode") as dw:
        first, text, usage, kvp = handshake(pw, dw)
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_bootstrap_addr"] == f"http://127.0.0.1:{pw.port}"
        assert kvp["remote_engine_id"] == "prefill-0"
        assert len(first.split()) == 1
        assert text == reference and text.startswith(first)
        assert usage.prompt_tokens_details.cached_tokens == 0  # no store: decode recomputed
        _, streamed, _, _ = handshake(pw, dw, stream=True)
        assert streamed == reference


@pytest.mark.store
def test_pd_through_mooncake_store(mooncake_master: Master, reference: str) -> None:
    store = ("--store", mooncake_master.rpc, "--store-metadata", mooncake_master.metadata)
    with run_worker("--time-scale", "0", "--role", "prefill", *store) as pw, \
            run_worker("--time-scale", "0", "--role", "decode", *store) as dw:
        first, text, usage, _ = handshake(pw, dw)
        tokens = Tokenizer().encode(PROMPT)
        nfull = len(tokens) // 16
        # the decode worker never saw this prompt: its cached tokens came from the store
        assert usage.prompt_tokens_details.cached_tokens == nfull * 16
        assert text == reference and text.startswith(first)
        # and its KV events announce the transferred blocks
        held = set(dw.get("/kv/blocks")["keys"])
        assert set(block_keys(tokens, 16, namespace_seed(MODEL, 16))) <= held
        _, streamed, usage2, _ = handshake(pw, dw, stream=True)
        assert streamed == reference
        assert usage2.prompt_tokens_details.cached_tokens == nfull * 16


@pytest.mark.store
def test_store_handoff_charges_transfer_time(mooncake_master: Master) -> None:
    """With time-scale > 0 the decode side waits the modelled transfer time."""
    import time

    store = ("--store", mooncake_master.rpc, "--store-metadata", mooncake_master.metadata)
    with run_worker("--time-scale", "0", *store) as pw, \
            run_worker("--time-scale", "20", *store) as dw:
        hs, t = KVTransferParams(), transfer_of(pw)
        client(pw).completions.create(model=MODEL, prompt=PROMPT + " transfer", max_tokens=1,
                                      extra_body=hs.prefill_fields(t))
        t0 = time.monotonic()
        client(dw).completions.create(model=MODEL, prompt=PROMPT + " transfer", max_tokens=1,
                                      extra_body=hs.decode_fields(t))
        elapsed = time.monotonic() - t0
        from mooncake_conductor.cost import CostModel

        cm = CostModel()
        n = len(Tokenizer().encode(PROMPT + " transfer"))
        nfull = n // 16
        # the pull, then the recomputed last token as a decode step (the partial block came
        # with the transfer: test_worker_engine)
        want = 20 * (cm.transfer_time(nfull * 16) + cm.decode_step_time(1, n))
        assert elapsed >= want * 0.9


def test_unreachable_store_fails_fast() -> None:
    import subprocess

    from worker_fixtures import free_port, worker_command

    port = free_port()
    r = subprocess.run(
        [*worker_command(), "--port", str(port), "--store", f"127.0.0.1:{free_port()}",
         "--store-metadata", f"http://127.0.0.1:{free_port()}/metadata",
         "--store-connect-timeout", "1.5"],
        capture_output=True, timeout=60,
    )
    assert r.returncode == 1
    assert b"not reachable" in r.stderr
