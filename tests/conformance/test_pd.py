"""The P/D handshake: what our gateway sends the two halves of a request is exactly what
the selected connector reads, checked with the engine's own code.

A real gateway (the product's ``serve``, configured with the model document the
operator's builders make for the cluster) routes a request over two scripted engines and
records both bodies; the engine's probe then feeds them to the engine's own request
classes and, for vLLM, through ``MooncakeConnector``'s scheduler side on the producer's
and the consumer's own configurations, built from the generated pods. A field of the
wrong name or shape, a missing transfer id, an engine id or bootstrap address other than
the one the prefill engine has: each shows as a transfer that never happens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mooncake_conformance import runner
from mooncake_operator import builders
from mooncake_operator.engines import Handshake, release_of
from mooncake_worker.relay import warm_body

from ..gateway.scripted import MODEL, engines, model, prompt_ids, running_gateway, until
from .conftest import cli_results, installed
from .matrix import RELEASE_IDS, Built, Case

PROMPT = prompt_ids(40)  # 2 full blocks of 16 and a partial one
MAX_TOKENS = 7


def _route(built: Built, chat: bool, hold_prefill: bool) -> tuple[dict[str, Any],
                                                                 dict[str, Any], str]:
    """One request through a gateway whose model document is the cluster's; the bodies
    the prefill and the decode engine got, and the prefill engine's URL host."""
    doc = builders.gateway_model(built.ref, built.spec)
    prefill_pod = f"{built.ref.namespace}/{built.pod['metadata']['name']}"
    body: dict[str, Any] = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_completion_tokens": MAX_TOKENS} if chat else
                            {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS})

    async def main() -> tuple[dict[str, Any], dict[str, Any], str]:
        async with engines("p0", "d0") as (p0, d0):
            p0.kv_transfer_params = None  # type: ignore[assignment]  # as vLLM answers
            if hold_prefill:  # the prefill answers only once the decode half has arrived
                p0.hold = asyncio.Event()
                d0.arrived.clear()

                async def release() -> None:
                    await d0.arrived.wait()
                    assert p0.hold is not None
                    p0.hold.set()

                releaser = asyncio.create_task(release())
            doc_model = model([p0.endpoint(pod=prefill_pod)], [d0],
                              handshake=doc["handshake"],
                              bootstrap_port=doc["bootstrap_port"])
            async with running_gateway([doc_model]) as gw:
                path = "/v1/chat/completions" if chat else "/v1/completions"
                status, _, raw = await asyncio.wait_for(gw.post(path, body), 30)
                assert status == 200, raw
                await until(lambda: _true(p0.calls and d0.calls))
            if hold_prefill:
                await releaser
            return p0.calls[0].body, d0.calls[0].body, p0.url.split("//")[1].split(":")[0]

    return asyncio.run(main())


async def _true(v: Any) -> bool:
    return bool(v)


def _case(kind: str, store: bool, role: str) -> Case:
    release = next(r for r in RELEASE_IDS.values() if r.kind.value == kind)
    return Case(release, store=store, protocol="tcp", block_size=16, tp=1, role=role)


def test_vllm_mooncake_connector_transfers_what_the_gateway_hands_over() -> None:
    producer, consumer = _case("vllm", False, "prefill"), _case("vllm", False, "decode")
    env = installed(producer.release)
    p, d = producer.build(), consumer.build()
    assert release_of(p.spec).handshake(False) is Handshake.KV_TRANSFER_PARAMS
    for chat in (False, True):
        pbody, dbody, host = _route(p, chat, hold_prefill=False)
        got = runner.run(env, "pd", {"producer": p.engine.probe_pod(),
                                     "consumer": d.engine.probe_pod(),
                                     "prefill_body": pbody, "decode_body": dbody,
                                     "prompt_token_ids": PROMPT, "chat": chat})
        assert got["ok"], got
        prod, cons = got["producer"], got["consumer"]
        # the prefill engine holds the prompt's blocks for this transfer, one token long
        transfer = pbody["kv_transfer_params"]["transfer_id"]
        assert list(prod["to_send"].values()) == [transfer]
        assert prod["holds_blocks"] is True and prod["max_tokens"] == 1
        assert prod["returned_params"] is None  # vLLM answers with none of its own
        assert prod["data_parallel_size"] == 1  # its engine id is the one configured
        # the decode engine pulls all of it from that engine, through its bootstrap server
        port = cli_results(producer.release)[_matching(producer)][1]["bootstrap_port"]
        assert cons["load_async"] is True
        assert cons["external_tokens"] == cons["prompt_tokens"] == len(PROMPT)
        assert cons["pulls"] == [{"engine": prod["engine_id"], "transfer_id": transfer,
                                  "remote_engine_id": prod["engine_id"],
                                  "remote_bootstrap_addr": f"http://{host}:{port}"}]


def _matching(case: Case) -> str:
    """A case of the matrix with the same connector and role (its probe result)."""
    for cid, (built, _) in cli_results(case.release).items():
        c = built.case
        if (c.store, c.role) == (case.store, case.role):
            return cid
    raise KeyError(case)


def test_vllm_store_connector_gets_no_parameters_to_misread() -> None:
    prefill = _case("vllm", True, "prefill")
    env = installed(prefill.release)
    p = prefill.build()
    assert release_of(p.spec).handshake(True) is Handshake.STORE
    pbody, dbody, _ = _route(p, chat=False, hold_prefill=False)
    assert "kv_transfer_params" not in pbody and "kv_transfer_params" not in dbody
    assert pbody["max_tokens"] == 1 and dbody["max_tokens"] == MAX_TOKENS
    got = runner.run(env, "store_reads", {})
    assert got["ok"], got
    # MooncakeStoreConnector's modules never read kv_transfer_params: the decode engine
    # finds the prompt's blocks in the store by their hashes
    assert got["modules"] and got["reading"] == []


def test_sglang_bootstrap_fields_reach_both_halves_sent_at_once() -> None:
    prefill = _case("sglang", False, "prefill")
    env = installed(prefill.release)
    p = prefill.build()
    assert release_of(p.spec).handshake(False) is Handshake.BOOTSTRAP
    # the prefill engine answers only after the decode half arrived: sent one after the
    # other, the request would never finish
    pbody, dbody, host = _route(p, chat=False, hold_prefill=True)
    warm = warm_body("sglang", "m", PROMPT)  # the relay's, warming a hot prefix
    got = runner.run(env, "pd", {"prefill_body": pbody, "decode_body": dbody,
                                 "warm_body": warm, "chat": False})
    assert got["ok"], got
    port = cli_results(prefill.release)[_matching(prefill)][1]["bootstrap_port"]
    for side in ("prefill", "decode"):
        internal = got[side]["internal"]  # GenerateReqInput, as SGLang's server makes it
        assert (internal["bootstrap_host"], internal["bootstrap_port"]) == (host, port)
        assert 0 <= internal["bootstrap_room"] < 1 << 63
    assert got["prefill"]["internal"]["bootstrap_room"] == \
        got["decode"]["internal"]["bootstrap_room"]
    assert got["prefill"]["max_tokens"] == 1 and not got["prefill"]["stream"]
    assert got["decode"]["max_tokens"] == MAX_TOKENS
    # a warm-up names no decode engine: SGLang's own stand-in host, whose KV goes nowhere
    assert got["warm"]["internal"]["bootstrap_host"] == got["fake_bootstrap_host"]
    assert got["warm"]["internal"]["bootstrap_room"] is not None
    assert got["warm"]["max_tokens"] == 1
