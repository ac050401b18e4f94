"""The handshakes (``mooncake_gateway.handshake``): the fields each one gives the two halves
of a request, and the SGLang one sent at once over real HTTP. What each produces is fed to
the engine's own code in ``tests/conformance``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from mooncake_gateway.handshake import (
    HANDSHAKES,
    ROOM_BITS,
    Bootstrap,
    KVTransferParams,
    Store,
    Transfer,
    handshake,
)
from mooncake_gateway.settings import Endpoint, ModelSettings
from pydantic import ValidationError

from .scripted import Call, engines, model, prompt_ids, running_gateway

POD = Endpoint(url="http://10.1.2.3:8000", name="ns/llama-prefill-abc-0",
               pod="ns/llama-prefill-abc-0")


def test_kv_transfer_params_name_the_prefill_engine_and_its_bootstrap_server() -> None:
    t = Transfer.new(POD, 8998)
    hs = KVTransferParams()
    assert hs.prefill_fields(t) == {"kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": t.id}}
    assert hs.decode_fields(t) == {"kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_engine_id": "llama-prefill-abc-0",  # the pod's name: vLLM's engine_id
        "remote_bootstrap_addr": "http://10.1.2.3:8998", "transfer_id": t.id}}
    assert not hs.concurrent


def test_an_ipv6_prefill_engine_and_one_without_a_pod() -> None:
    v6 = Endpoint(url="http://[fd00::7]:8000", name="p")
    t = Transfer.new(v6, None)  # no bootstrap port: the engine's own (ours answers there)
    kvp = KVTransferParams().decode_fields(t)["kv_transfer_params"]
    assert kvp["remote_bootstrap_addr"] == "http://[fd00::7]:8000"
    assert kvp["remote_engine_id"] == "p"
    assert Bootstrap().prefill_fields(t)["bootstrap_host"] == "fd00::7"


def test_transfers_are_fresh_and_rooms_fit_a_signed_64_bit_int() -> None:
    ts = [Transfer.new(POD, 1) for _ in range(200)]
    assert len({t.id for t in ts}) == 200
    assert all(0 <= t.room < 1 << ROOM_BITS for t in ts) and ROOM_BITS == 63
    assert len({t.room for t in ts}) == 200
    moved = ts[0].with_prefill(Endpoint(url="http://10.9.9.9:1", name="q"))
    assert (moved.id, moved.room, moved.host) == (ts[0].id, ts[0].room, "10.9.9.9")


def test_the_store_handshake_sends_nothing_and_bootstrap_the_same_to_both() -> None:
    t = Transfer.new(POD, 8998)
    assert Store().prefill_fields(t) == Store().decode_fields(t) == {}
    fields = {"bootstrap_host": "10.1.2.3", "bootstrap_port": 8998, "bootstrap_room": t.room}
    assert Bootstrap().prefill_fields(t) == Bootstrap().decode_fields(t) == fields
    assert Bootstrap.concurrent


def test_names_and_refusals() -> None:
    assert set(HANDSHAKES) == {"kv-transfer-params", "store", "bootstrap"}
    assert handshake("store") is HANDSHAKES["store"]
    with pytest.raises(ValueError, match="unknown handshake 'nixl'"):
        handshake("nixl")
    with pytest.raises(ValidationError, match="handshake"):
        ModelSettings(name="m", handshake="nixl")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="bootstrap_port"):
        ModelSettings(name="m", bootstrap_port=0)


BOOTSTRAP = {"handshake": "bootstrap", "bootstrap_port": 8998}


def _completion(stream: bool) -> dict[str, Any]:
    return {"model": "scripted", "prompt": prompt_ids(64), "max_tokens": 5, "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bootstrap_sends_both_halves_at_once(stream: bool) -> None:
    """The prefill engine answers only once the decode half has arrived (as SGLang's waits
    in its bootstrap queue for the decode engine): one after the other never finishes."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0], **BOOTSTRAP)]) as gw:
            p0.hold = asyncio.Event()

            async def release() -> None:
                await d0.arrived.wait()
                assert p0.hold is not None
                p0.hold.set()

            releaser = asyncio.create_task(release())
            status, _h, raw = await asyncio.wait_for(
                gw.post("/v1/completions", _completion(stream)), 10)
            await releaser
            assert status == 200, raw
            (prefill,), (decode,) = p0.calls, d0.calls
            room = prefill.body["bootstrap_room"]
            want = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                    "bootstrap_room": room}
            assert {k: prefill.body[k] for k in want} == want
            assert {k: decode.body[k] for k in want} == want
            assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
            assert decode.body == {**_completion(stream), **want}
            assert "kv_transfer_params" not in prefill.body | decode.body
            st = await gw.state()
            assert [p["inflight"] for p in st["prefill"]] == [0]
            assert [d["inflight"] for d in st["decode"]] == [0]

    asyncio.run(main())


def test_a_failed_prefill_cancels_the_waiting_decode_and_is_reported() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), \
                running_gateway([model([p0, p1], [d0], conductor={"policy": "round-robin"},
                                       **BOOTSTRAP)]) as gw:
            p0.status = p1.status = 500
            d0.hold = asyncio.Event()  # the decode engine waits for a KV that never comes
            status, _h, raw = await asyncio.wait_for(
                gw.post("/v1/completions", _completion(False)), 10)
            assert status == 502, raw
            assert "prefill failed" in json.loads(raw)["error"]["message"]
            # one attempt: the decode engine was told which prefill engine to meet
            assert len(p0.calls) + len(p1.calls) == 1 and len(d0.calls) == 1
            st = await gw.state()
            assert [d["inflight"] for d in st["decode"]] == [0]

    asyncio.run(main())


def test_a_refused_decode_is_not_retried_elsewhere_under_bootstrap() -> None:
    async def main() -> None:
        async with engines("p0", "d0", "d1") as (p0, d0, d1), \
                running_gateway([model([p0], [d0, d1], conductor={"policy": "round-robin"},
                                       **BOOTSTRAP)]) as gw:
            d0.status = d1.status = 503

            async def ok_prefill(_r: web.Request, call: Call) -> web.StreamResponse:
                return web.json_response({**p0.decode_json(call), "usage": {
                    "prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65}})

            p0.answer = ok_prefill
            status, _h, raw = await gw.post("/v1/completions", _completion(False))
            assert status == 502, raw
            assert len(d0.calls) + len(d1.calls) == 1

    asyncio.run(main())
