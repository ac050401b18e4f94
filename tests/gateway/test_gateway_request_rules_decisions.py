"""What each request leaves behind, against scripted engines over real HTTP with the
cache state coming from KV events on real ZeroMQ: the decision record (every field of
``/conductor/decisions`` and of the explain header, a fetch's source), the scheduler's 429
and its record, the token accounting of ``/conductor/state`` and ``/metrics`` (predicted
reuse, computed tokens, prefill GPU seconds), the direct rule's threshold counted against
what the decode instance holds, policies that book their own requests, prefills queued on
one instance with the policy's priority, an internal fault answered as a logged 500, and
the per-outcome request counter."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_contract.kvevents.codec import BlockStored
from mooncake_gateway.settings import GatewaySettings
from prometheus_client.parser import text_string_to_metric_families

from .scripted import (
    BLOCK,
    MODEL,
    ScriptedPublisher,
    engines,
    model,
    prompt_ids,
    running_gateway,
    until,
)

CMPL = "/v1/completions"
EXPLAIN = {"x-conductor-explain": "1"}
RECORD_KEYS = {"id", "time", "model", "policy", "prompt_tokens", "blocks", "prefill",
               "decode", "local_blocks", "fetch_blocks", "source", "predicted",
               "reject_reason", "decision_us", "attempts"}
PREDICTED_KEYS = {"queue_s", "transfer_s", "prefill_s", "ttft_s", "tbt_s"}
#: a decision takes microseconds to (on the first, compiling) about a second; this bound
#: only has to tell a duration from a clock reading
DECISION_US_MAX = 60e6


def _body(tokens: list[int], max_tokens: int = 3) -> dict[str, Any]:
    return {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens}


def _sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name} {labels}")


async def _records(gw: Any) -> list[dict[str, Any]]:
    return list(await gw.get(f"/conductor/decisions?model={MODEL}&limit=100"))


async def _applied(gw: Any, pool: str, seq: int, i: int = 0) -> None:
    """Wait until instance ``i`` of ``pool`` has applied KV events up to ``seq``."""
    async def done() -> bool:
        st = await gw.state()
        return int(st[pool][i]["events"]["last_seq"]) >= seq
    await until(done, what=f"{pool}[{i}] events up to {seq} applied")


async def _marked_down(gw: Any, pool: str) -> None:
    """Wait until the health checks have taken instance 0 of ``pool`` out of routing."""
    async def down() -> bool:
        return not (await gw.state())[pool][0]["routable"]
    await until(down, what=f"{pool}[0] marked down")


def test_a_served_decision_record_names_every_part_of_the_decision() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            before = time.time()
            status, headers, raw = await gw.post(CMPL, _body(prompt_ids(40)), EXPLAIN)
            assert status == 200, raw
            [rec] = await _records(gw)
            assert set(rec) == RECORD_KEYS | {"candidates", "direct", "held_blocks",
                                              "decode_held_blocks", "engine_cached_tokens",
                                              "outcome"}
            assert before <= rec["time"] <= time.time()
            assert (rec["model"], rec["policy"]) == (MODEL, (await gw.state())["policy"])
            assert (rec["prompt_tokens"], rec["blocks"]) == (40, 40 // BLOCK)
            assert (rec["prefill"], rec["decode"], rec["source"]) == ("p0", "d0", None)
            assert (rec["local_blocks"], rec["fetch_blocks"]) == (0, 0)
            pred = rec["predicted"]
            assert set(pred) == PREDICTED_KEYS
            assert pred["prefill_s"] > 0 and pred["tbt_s"] > 0
            assert pred["ttft_s"] == pytest.approx(pred["queue_s"] + pred["transfer_s"]
                                                   + pred["prefill_s"])
            assert rec["reject_reason"] is None
            assert 0 < rec["decision_us"] < DECISION_US_MAX
            assert (rec["direct"], rec["held_blocks"], rec["decode_held_blocks"]) == \
                (False, 0, 0)
            # the scripted prefill answers 32 cached tokens in its usage
            assert rec["engine_cached_tokens"] == 32
            [attempt] = rec["attempts"]
            assert (attempt["prefill"], attempt["status"]) == ("p0", 200)
            assert attempt["predicted_s"] == pytest.approx(pred["ttft_s"])
            assert attempt["answered_s"] > 0
            assert rec["outcome"] == "ok"
            # the explain header: compact JSON of the routing fields of the same decision
            header = headers["x-conductor-decision"]
            assert ", " not in header and '": ' not in header
            view = json.loads(header)
            for key in ("id", "policy", "prefill", "decode", "local_blocks", "fetch_blocks",
                        "direct"):
                assert view[key] == rec[key], key
            assert view["predicted"] == pytest.approx(pred)
            # the unary answer carries the same view
            assert json.loads(raw)["conductor"]["id"] == rec["id"]

    asyncio.run(main())


def test_a_rejection_is_explained_in_its_429_and_in_its_record() -> None:
    async def main() -> None:
        strict = {"slo": {"ttft_s": 1e-9}}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], conductor=strict)], retry_after_s=3) as gw:
            status, headers, raw = await gw.post(CMPL, _body(prompt_ids(40)))
            assert status == 429, raw
            assert headers["Retry-After"] == "3"
            assert json.loads(raw)["error"]["message"] == \
                "request rejected by the scheduler (ttft-slo); retry later"
            [rec] = await _records(gw)
            assert set(rec) == RECORD_KEYS
            assert (rec["reject_reason"], rec["attempts"]) == ("ttft-slo", [])
            assert (rec["prefill"], rec["decode"]) == ("p0", "d0")
            assert 0 < rec["decision_us"] < DECISION_US_MAX
        # no prefill instance up: a decision without a prefill instance
        raw, rec = await _one_pool_down("prefill")
        err = json.loads(raw)["error"]
        assert (err["code"], err["message"]) == (
            "no_prefill_instance",
            "request rejected by the scheduler (no-prefill-instance); retry later")
        assert (rec["prefill"], rec["decode"], rec["reject_reason"]) == \
            (None, "d0", "no-prefill-instance")
        # no decode instance up: a decision without a decode instance
        raw, rec = await _one_pool_down("decode")
        assert rec["decode"] is None and rec["reject_reason"] is not None
        assert json.loads(raw)["error"]["message"] == (
            f"request rejected by the scheduler ({rec['reject_reason']}); retry later")

    asyncio.run(main())


async def _one_pool_down(pool: str) -> tuple[str, dict[str, Any]]:
    """A request to p0 + d0 with ``pool``'s engine marked down: refused with 429 before
    any engine was called; the answer's body and the one decision record."""
    async with engines("p0", "d0") as (p0, d0), running_gateway(
            [model([p0], [d0])], wait_ready=False, health_interval_s=0.05) as gw:
        (p0 if pool == "prefill" else d0).healthy = False
        await _marked_down(gw, pool)
        status, _h, raw = await gw.post(CMPL, _body(prompt_ids(40)))
        assert status == 429, raw
        [rec] = await _records(gw)
        assert p0.calls == [] and d0.calls == []
        return raw, rec


def test_token_accounting_of_prefilled_and_direct_requests() -> None:
    """p0 holds the first two blocks of a three-block prompt: each P/D request counts
    2 blocks reused and 1 computed and adds its predicted prefill GPU time; a direct
    request counts its whole prompt as computed and adds no prefill time. Calibration
    off: the scripted engine's instant answers would rescale the second prediction."""
    async def main() -> None:
        pub = ScriptedPublisher()
        tokens = prompt_ids(3 * BLOCK, 5)
        try:
            async with engines("p0", "d0") as (p0, d0), running_gateway(
                    [model([p0.endpoint(**pub.endpoint_fields())], [d0],
                           conductor={"calibrate": False})]) as gw:
                seq = await pub.publish([BlockStored([11, 12], None, tokens[:2 * BLOCK],
                                                     BLOCK)])
                await _applied(gw, "prefill", seq)
                seconds = []
                for _ in range(2):
                    status, _h, raw = await gw.post(CMPL, _body(tokens))
                    assert status == 200, raw
                    seconds.append((await gw.state())["tokens"]["prefill_seconds"])
                recs = await _records(gw)
                assert [r["held_blocks"] for r in recs] == [2, 2]
                acc = (await gw.state())["tokens"]
                assert acc["prompt"] == 2 * 3 * BLOCK
                assert acc["reused_predicted"] == 2 * 2 * BLOCK
                assert acc["hit_ratio_predicted"] == pytest.approx(2 / 3)
                assert seconds[0] > 0 and seconds[1] == pytest.approx(2 * seconds[0])
                metrics = await gw.text("/metrics")
                name = "mooncake_gateway_prompt_tokens_total"
                assert _sample(metrics, name, model=MODEL, kind="reused") == 4 * BLOCK
                assert _sample(metrics, name, model=MODEL, kind="computed") == 2 * BLOCK
        finally:
            await pub.close()
        # a direct request: the whole prompt computed (by the decode engine)
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], direct={"uncached_tokens_below": 10_000})]) as gw:
            status, _h, raw = await gw.post(CMPL, _body(tokens))
            assert status == 200, raw
            assert p0.calls == []
            acc = (await gw.state())["tokens"]
            assert (acc["prompt"], acc["reused_predicted"], acc["prefill_seconds"]) == \
                (3 * BLOCK, 0, 0.0)
            metrics = await gw.text("/metrics")
            assert _sample(metrics, "mooncake_gateway_prompt_tokens_total", model=MODEL,
                           kind="computed") == 3 * BLOCK

    asyncio.run(main())


@pytest.mark.parametrize("below, direct", [(BLOCK, False), (BLOCK + 1, True)],
                         ids=["at-threshold", "under-threshold"])
def test_the_direct_rule_counts_what_the_decode_instance_holds(below: int,
                                                                direct: bool) -> None:
    """d0 holds two of the prompt's three blocks, so it would compute one block itself:
    direct exactly when that is under ``uncached_tokens_below``."""
    async def main() -> None:
        pub = ScriptedPublisher()
        tokens = prompt_ids(3 * BLOCK, 9)
        try:
            async with engines("p0", "d0") as (p0, d0), running_gateway(
                    [model([p0], [d0.endpoint(**pub.endpoint_fields())],
                           direct={"uncached_tokens_below": below})]) as gw:
                seq = await pub.publish([BlockStored([21, 22], None, tokens[:2 * BLOCK],
                                                     BLOCK)])
                await _applied(gw, "decode", seq)
                status, _h, raw = await gw.post(CMPL, _body(tokens))
                assert status == 200, raw
                [rec] = await _records(gw)
                assert (rec["direct"], rec["decode_held_blocks"]) == (direct, 2)
                assert len(p0.calls) == (0 if direct else 1)
                assert len(d0.calls) == 1
        finally:
            await pub.close()

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["dynamo-kv", "sglang-cache-aware"])
def test_policies_that_book_their_requests_serve_one_after_another(policy: str) -> None:
    """Dynamo's and SGLang's routers count their outstanding requests; the gateway tells
    the policy when a request's prefill is done and when it is finished, and the books
    stay consistent over requests that share a prefix."""
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0], conductor={"policy": policy})]) as gw:
            shared = prompt_ids(2 * BLOCK, 3)
            for i in range(4):
                status, _h, raw = await gw.post(CMPL, _body(shared + prompt_ids(5, 40 + i)))
                assert status == 200, raw
            recs = await _records(gw)
            assert [r["outcome"] for r in recs] == ["ok"] * 4
            assert len(p0.prefills) + len(p1.prefills) == 4

    asyncio.run(main())


def test_a_fetch_decision_names_the_instance_it_fetches_from() -> None:
    """p1 holds a 64-block prefix but is busy with a long prompt (seconds of predicted
    work, so its queue has not drained on a slow host): the next request with
    that prefix goes to idle p0, fetching the prefix from p1 (the record names p1)."""
    async def main() -> None:
        pub = ScriptedPublisher()
        prefix = prompt_ids(64 * BLOCK, 3)
        try:
            async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                    [model([p0, p1.endpoint(**pub.endpoint_fields())], [d0])]) as gw:
                seq = await pub.publish([BlockStored(list(range(1000, 1064)), None, prefix,
                                                     BLOCK)])
                await _applied(gw, "prefill", seq, i=1)
                p1.hold = asyncio.Event()
                long_one = asyncio.create_task(
                    gw.post(CMPL, _body(prefix + prompt_ids(24_000, 9), 2)))
                await asyncio.wait_for(p1.arrived.wait(), 10)
                status, _h, raw = await gw.post(CMPL, _body(prefix + prompt_ids(20, 11), 2))
                assert status == 200, raw
                p1.hold.set()
                assert (await long_one)[0] == 200
                first, second = await _records(gw)
                assert (first["prefill"], first["local_blocks"], first["source"]) == \
                    ("p1", 64, None)
                assert (second["prefill"], second["fetch_blocks"], second["source"]) == \
                    ("p0", 64, "p1")
                pred = second["predicted"]
                assert pred["transfer_s"] > 0
                assert pred["ttft_s"] == pytest.approx(pred["queue_s"] + pred["transfer_s"]
                                                       + pred["prefill_s"])
        finally:
            await pub.close()

    asyncio.run(main())


def test_an_unexpected_error_is_a_500_in_openai_form_on_both_servers(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fault inside the gateway (here: the request parser raising) is answered, not
    dropped: a 500 with an OpenAI error body, by the fast front end and by aiohttp, and
    logged with its traceback and what was asked."""
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a fault in the gateway")

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            monkeypatch.setattr("mooncake_gateway.dispatch.parse_request", broken)
            for path, headers in ((CMPL, None), (CMPL, EXPLAIN),
                                  ("/v1/chat/completions", None)):
                status, _h, raw = await gw.post(path, _body(prompt_ids(20)), headers)
                assert status == 500, raw
                assert json.loads(raw) == {"error": {
                    "message": "internal gateway error", "type": "server_error",
                    "param": None, "code": "internal_error"}}
            assert p0.calls == [] and d0.calls == []

    with caplog.at_level(logging.ERROR, logger="mooncake_gateway.server"):
        asyncio.run(main())
    logged = [(r.getMessage(), r.exc_info is not None) for r in caplog.records
              if r.name == "mooncake_gateway.server"]
    # the front end names the endpoint; aiohttp (the explained request) the method and path
    assert logged == [("internal error on POST completions", True),
                      ("internal error on POST /v1/completions", True),
                      ("internal error on POST chat", True)]


def test_prefills_queued_on_one_instance_are_all_served() -> None:
    """Three requests wait on the one prefill instance at once: the gateway's model of
    its queue holds all three (ordered by priority) and each is served once released."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            p0.hold = asyncio.Event()
            sent = [asyncio.create_task(gw.post(CMPL, _body(prompt_ids(40, 60 + i))))
                    for i in range(3)]

            async def queued() -> bool:
                return int((await gw.state())["prefill"][0]["queued"]) == 3
            await until(queued, what="three prefills queued on p0")
            st = await gw.state()
            assert st["prefill"][0]["predicted_wait_s"] > 0
            p0.hold.set()
            for t in sent:
                status, _h, raw = await t
                assert status == 200, raw
            assert int((await gw.state())["prefill"][0]["queued"]) == 0
            assert len(p0.prefills) == 3 and len(d0.decodes) == 3

    asyncio.run(main())


def test_queued_prefills_carry_the_policy_s_priority() -> None:
    """With ``priority_weight`` the Conductor serves short prefills first: a long prompt
    queued on p0 before a short one is not counted in a later short request's predicted
    wait, because the gateway queued it with the policy's priority (arrival + weight x
    its prefill time), not its arrival."""
    async def main() -> None:
        cond = {"policy": "conductor", "params": {"priority_weight": 1.0}}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], conductor=cond)]) as gw:
            p0.hold = asyncio.Event()
            sent = [asyncio.create_task(gw.post(CMPL, _body(prompt_ids(16_000, 70))))]

            async def queued(n: int) -> bool:
                return int((await gw.state())["prefill"][0]["queued"]) == n
            await until(lambda: queued(1), what="the long prefill queued")
            sent.append(asyncio.create_task(gw.post(CMPL, _body(prompt_ids(40, 71)))))
            await until(lambda: queued(2), what="the short prefill queued")
            sent.append(asyncio.create_task(gw.post(CMPL, _body(prompt_ids(40, 72)))))
            await until(lambda: queued(3), what="the second short prefill queued")
            long_, short, later = await _records(gw)
            assert long_["predicted"]["prefill_s"] > 1.0
            # the later short request waits for the earlier short one only
            assert later["predicted"]["queue_s"] < long_["predicted"]["prefill_s"] / 2
            assert later["predicted"]["queue_s"] <= short["predicted"]["prefill_s"] + 1e-9
            p0.hold.set()
            for t in sent:
                assert (await t)[0] == 200

    asyncio.run(main())


def _outcomes(metrics: str) -> dict[tuple[str, str, str], float]:
    """The non-zero counts (each served model's outcomes are exported from 0)."""
    return {(s.labels["endpoint"], s.labels["model"], s.labels["outcome"]): float(s.value)
            for fam in text_string_to_metric_families(metrics) for s in fam.samples
            if s.name == "mooncake_gateway_requests_total" and s.value}


def test_each_request_is_counted_once_by_its_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mooncake_gateway_requests_total`` by endpoint, model and outcome: refusals by
    their kind (aiohttp's own 413 too), an upstream failure and an internal fault as
    errors, a stream (which the fast front end hands to aiohttp) once."""
    async def main() -> None:
        async with engines("p0", "d0", "p1", "d1") as (p0, d0, p1, d1), running_gateway(
                [model([p0], [d0]), {**model([p1], [d1]), "name": "second"}],
                max_body_bytes=10_000) as gw:
            # two models: a request must name one
            status, _h, raw = await gw.post(CMPL, {"prompt": "hi"})
            assert (status, json.loads(raw)["error"]["param"]) == (400, "model"), raw
            status, _h, raw = await gw.post(CMPL, b'{"model": ')
            assert status == 400
            assert json.loads(raw)["error"]["message"].startswith(
                "request body is not valid JSON: ")
            status, _h, raw = await gw.post(CMPL, {"model": "nope", "prompt": "hi"})
            err = json.loads(raw)["error"]
            assert (status, err["message"], err["param"], err["code"]) == (
                404, "The model `nope` does not exist.", "model", "model_not_found")
            assert (await gw.post(CMPL, _body(prompt_ids(20, 1))))[0] == 200
            status, _h, raw = await gw.post(CMPL, {**_body(prompt_ids(20, 2)), "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            p0.status = 503
            assert (await gw.post(CMPL, _body(prompt_ids(20, 3))))[0] == 502
            p0.status = 200
            # a body over max_body_bytes: aiohttp refuses it while the gateway reads it
            status, _h, raw = await gw.post(CMPL, _body(prompt_ids(3000, 5)))
            assert status == 413, raw
            monkeypatch.setattr("mooncake_gateway.dispatch.parse_request",
                                lambda *_a, **_k: 1 / 0)
            assert (await gw.post("/v1/chat/completions", _body(prompt_ids(20, 4))))[0] == 500
            assert _outcomes(await gw.text("/metrics")) == {
                ("completions", "unknown", "bad_request"): 2.0,
                ("completions", "unknown", "not_found"): 1.0,
                ("completions", "unknown", "too_large"): 1.0,
                ("completions", MODEL, "ok"): 2.0,
                ("completions", MODEL, "error"): 1.0,
                ("chat", "unknown", "error"): 1.0,
            }

    asyncio.run(main())


def test_a_direct_request_counts_once_in_its_decode_batch() -> None:
    """A direct request (no prefill instance) is in its decode instance's batch from the
    decision on; the conductor's decode selector must not also count it as still on its
    way there. With the first request decoding, the second is priced on a batch of two
    holding both prompts once each."""
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0):
            doc = model([p0], [d0], direct={"uncached_tokens_below": 1_000_000})
            async with running_gateway([doc]) as gw:
                d0.hold = asyncio.Event()
                first = asyncio.create_task(gw.post(CMPL, _body(prompt_ids(8 * BLOCK, 1))))

                async def decoding(n: int) -> bool:
                    return len(d0.calls) == n
                await until(lambda: decoding(1))
                st = (await gw.state())["decode"][0]
                assert (st["batch"], st["context_tokens"]) == (1, 8 * BLOCK)
                second = asyncio.create_task(
                    gw.post(CMPL, _body(prompt_ids(2 * BLOCK, 900))))
                await until(lambda: decoding(2))
                d0.hold.set()
                for status, _h, raw in (await first, await second):
                    assert status == 200, raw
                recs = await _records(gw)
                assert [r["direct"] for r in recs] == [True, True] and p0.calls == []
        cost = CostModel(GatewaySettings.model_validate({"models": [doc]})
                         .models[0].conductor.cost)
        tbt = {r["prompt_tokens"]: r["predicted"]["tbt_s"] for r in recs}
        assert tbt[2 * BLOCK] == pytest.approx(cost.decode_step_time(2, 10 * BLOCK))

    asyncio.run(main())
