"""The request path against scripted engines over real HTTP: tokenization by an engine's
``/tokenize`` (which engines are asked, in what order, what they get, and each way they
can fail), ``/health`` and ``/ready``, and the fast front end's idle sweep."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mooncake_conductor.cost import CostModel
from mooncake_gateway.settings import GatewaySettings

from .scripted import (
    BLOCK,
    MODEL,
    ScriptedEngine,
    engines,
    model,
    prompt_ids,
    running_gateway,
    until,
)

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKENS = list(range(100, 100 + 3 * BLOCK + 5))  # 3 whole blocks and a bit


class TokenizingEngine(ScriptedEngine):
    """A scripted engine with vLLM's ``/tokenize``: answers ``tokenize`` (status, body,
    content type), after ``tokenize_delay`` seconds; records what it was asked."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.tokenized: list[Any] = []
        self.tokenize: tuple[int, bytes, str] = (
            200, json.dumps({"count": len(TOKENS), "max_model_len": 1024,
                             "tokens": TOKENS}).encode(), "application/json")
        self.tokenize_delay = 0.0

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/tokenize", self._tokenize)

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenized.append(json.loads(await request.read()))
        if self.tokenize_delay:
            await asyncio.sleep(self.tokenize_delay)
        status, body, ctype = self.tokenize
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})


@asynccontextmanager
async def tokenizing(*names: str) -> AsyncIterator[list[TokenizingEngine]]:
    started: list[TokenizingEngine] = []
    try:
        for n in names:
            started.append(await TokenizingEngine(n).start())
        yield started
    finally:
        for e in started:
            await e.stop()


def _answer(status: int, obj: Any, ctype: str = "application/json") -> tuple[int, bytes, str]:
    return status, json.dumps(obj).encode(), ctype


def _error(raw: bytes) -> dict[str, Any]:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


async def _decision(gw: Any) -> dict[str, Any]:
    got = await gw.get(f"/conductor/decisions?model={MODEL}")
    return dict(got[-1])


def test_engine_tokenization_of_a_prompt_and_of_messages() -> None:
    async def main() -> None:
        async with tokenizing("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], tokenizer="engine") as gw:
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "hello world",
                                                   "max_tokens": 2})
            assert status == 200, raw
            assert p0.tokenized == [{"prompt": "hello world"}] and d0.tokenized == []
            d = await _decision(gw)
            assert (d["prompt_tokens"], d["blocks"]) == (len(TOKENS), 3)
            # the prompt the engines get is the client's, not the tokens
            assert p0.prefills[0].body["prompt"] == "hello world"
            messages = [{"role": "user", "content": "hi"}]
            status, _h, raw = await gw.post(CHAT, {"model": MODEL, "messages": messages})
            assert status == 200, raw
            assert p0.tokenized[1:] == [{"messages": messages}]
            # the same prompt again: tokenized once
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "hello world",
                                                   "max_tokens": 2})
            assert status == 200 and len(p0.tokenized) == 2
            # token ids need no tokenizer
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": [1, 2, 3],
                                                   "max_tokens": 2})
            assert status == 200 and len(p0.tokenized) == 2

    asyncio.run(main())


def test_engine_tokens_count_against_the_context_window() -> None:
    async def main() -> None:
        async with tokenizing("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0], max_model_len=len(TOKENS) + 4)], tokenizer="engine") as gw:
            p0.tokenize = _answer(200, {"tokens": [str(t) for t in TOKENS]})
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "x",
                                                   "max_tokens": 5})
            assert status == 400
            err = _error(raw)
            assert err["message"] == (f"prompt ({len(TOKENS)} tokens) + max_tokens (5) "
                                      f"exceeds the context window ({len(TOKENS) + 4})")
            assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "y",
                                                   "max_tokens": 4})
            assert status == 200, raw
            # no tokens at all: an empty prompt
            p0.tokenize = _answer(200, {"tokens": []})
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "z"})
            assert status == 400 and _error(raw)["message"] == "the prompt is empty"
            assert p0.calls == [p0.prefills[0]] and len(d0.calls) == 1

    asyncio.run(main())


def test_engines_are_asked_in_order_skipping_unroutable_ones_until_one_answers() -> None:
    async def main() -> None:
        async with tokenizing("p0", "p1", "d0", "d1") as (p0, p1, d0, d1):
            p0.healthy = False  # never routable: never asked
            async with running_gateway([model([p0, p1], [d0, d1])], tokenizer="engine") as gw:
                async def routable() -> bool:
                    st = await gw.state()
                    return [i["routable"] for i in st["prefill"] + st["decode"]] == \
                        [False, True, True, True]
                await until(routable)
                # a 5xx, an answer without a token list, JSON that is no object: next one
                p1.tokenize = _answer(500, {"error": {"message": "oops"}})
                d0.tokenize = _answer(200, {"count": 3, "tokens": "1 2 3"})
                d1.tokenize = _answer(200, {"tokens": TOKENS[:20]}, "text/plain")
                status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "a b c",
                                                       "max_tokens": 2})
                assert status == 200, raw
                assert [len(e.tokenized) for e in (p0, p1, d0, d1)] == [0, 1, 1, 1]
                assert (await _decision(gw))["prompt_tokens"] == 20
                # not JSON, a JSON list: next one
                p1.tokenize = (200, b"tokens: 1 2 3", "text/plain")
                d0.tokenize = _answer(200, [1, 2, 3])
                status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "d e",
                                                       "max_tokens": 2})
                assert status == 200, raw
                assert [len(e.tokenized) for e in (p0, p1, d0, d1)] == [0, 2, 2, 2]
                # nobody can: a 503 naming the tokenizer
                d1.tokenize = _answer(503, {"error": {"message": "busy"}})
                status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "f",
                                                       "max_tokens": 2})
                assert status == 503
                assert _error(raw) == {"message": "no engine could tokenize the prompt",
                                       "type": "service_unavailable", "param": None,
                                       "code": "no_tokenizer"}
                assert [len(e.tokenized) for e in (p0, p1, d0, d1)] == [0, 3, 3, 3]
                assert len(p1.calls) == 2 and len(d0.calls) + len(d1.calls) == 2

    asyncio.run(main())


NOT_OPENAI = [
    _answer(400, {"detail": [{"loc": ["body"], "msg": "field required"}]}),  # FastAPI's
    _answer(400, [1, 2]),
    _answer(400, {"error": "a string"}),
    _answer(400, {"error": {"message": None, "param": None}}),
    _answer(400, {"error": {"message": ""}}),
    (400, b"", "application/json"),
]


def test_an_engine_refusing_the_prompt_is_relayed_and_no_other_engine_is_asked() -> None:
    async def main() -> None:
        async with tokenizing("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], tokenizer="engine") as gw:
            for status in (400, 404, 422, 499):
                p0.tokenize = _answer(status, {"error": {
                    "message": "prompt too long", "type": "BadRequestError",
                    "param": "prompt", "code": "too_long"}})
                got, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "a"})
                assert got == status
                err = _error(raw)
                assert (err["message"], err["param"], err["code"]) == \
                    ("prompt too long", "prompt", "too_long")
            # without an OpenAI error: a bad prompt
            for answer in NOT_OPENAI:
                p0.tokenize = answer
                got, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "a"})
                assert got == 400, (answer, raw)
                assert _error(raw) == {"message": "bad prompt",
                                       "type": "invalid_request_error", "param": None,
                                       "code": None}, answer
            assert len(p0.tokenized) == 4 + len(NOT_OPENAI)
            assert d0.tokenized == [] and p0.calls == [] and d0.calls == []

    asyncio.run(main())


def test_an_engine_that_is_gone_or_too_slow_is_passed_over() -> None:
    async def main() -> None:
        async with tokenizing("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])], tokenizer="engine", request_timeout_s=0.3) as gw:
            await p0.stop()  # routable until a health check says otherwise
            p1.tokenize_delay = 1.0
            status, _h, raw = await gw.post(CMPL, {"model": MODEL, "prompt": "a",
                                                   "max_tokens": 2})
            assert status == 200, raw  # tokenized by d0; a prefill on p0 is retried on p1
            assert len(p1.tokenized) == 1 and len(d0.tokenized) == 1

    asyncio.run(main())


def test_health_and_ready() -> None:
    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0):
            d0.healthy = False
            async with running_gateway([model([p0], [d0])], wait_ready=False) as gw:
                assert await gw.get("/health") == {"status": "ok"}

                async def decode_missing() -> Any:
                    async with gw.session.get(gw.url + "/ready") as r:
                        body = await r.json()
                        return (r.status, body) if body["missing"] == [f"{MODEL}:decode"] \
                            else None
                status, body = await until(decode_missing)
                assert (status, body) == (503, {"ready": False,
                                                 "missing": [f"{MODEL}:decode"]})
        async with engines("p0", "d0") as (p0, d0), \
                running_gateway([model([p0], [d0])]) as gw:
            async with gw.session.get(gw.url + "/ready") as r:
                assert (r.status, await r.json()) == (200, {"ready": True, "missing": []})
            async with gw.session.get(gw.url + "/health") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith(
                    "application/json")

    asyncio.run(main())


def test_a_gateway_without_models_is_not_ready() -> None:
    async def main() -> None:
        async with running_gateway([], wait_ready=False) as gw, \
                gw.session.get(gw.url + "/ready") as r:
            assert (r.status, await r.json()) == (503, {"ready": False, "missing": []})

    asyncio.run(main())


def test_explained_candidates_are_the_up_prefill_instances_best_first() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "p2", "p3", "d0") as (p0, p1, p2, p3, d0):
            p0.healthy = False  # never up: never a candidate
            doc = model([p0, p1, p2, p3], [d0])

            async def up(gw: Any) -> bool:
                st = await gw.state()
                return [i["routable"] for i in st["prefill"]] == [False, True, True, True]
            async with running_gateway([doc], explain_top=3) as gw:
                await until(lambda: up(gw))
                held = asyncio.Event()
                for e in (p1, p2, p3):
                    e.hold = held
                prefix = prompt_ids(4 * BLOCK, 7)
                first = asyncio.create_task(gw.post(CMPL, {
                    "model": MODEL, "prompt": [*prefix, 1, 2, 3], "max_tokens": 1}))

                async def arrived() -> bool:
                    return len(p1.calls) + len(p2.calls) + len(p3.calls) == 1
                await until(arrived)
                busy = next(e for e in (p1, p2, p3) if e.calls)
                second = asyncio.create_task(gw.post(
                    CMPL, {"model": MODEL, "prompt": [*prefix, 4, 5, 6], "max_tokens": 1},
                    {"x-conductor-explain": "1"}))

                async def both() -> bool:
                    return len(p1.calls) + len(p2.calls) + len(p3.calls) == 2
                await until(both)
                held.set()
                for status, _h, raw in (await first, await second):
                    assert status == 200, raw
                _s, headers, raw = await second
                cands = json.loads(headers["x-conductor-decision"])["candidates"]
                assert json.loads(raw)["conductor"]["candidates"] == cands
                cost = CostModel(GatewaySettings.model_validate(
                    {"models": [doc]}).models[0].conductor.cost)
                n = len(prefix) + 3
                queues = {c["instance"]: c["queue_s"] for c in cands}
                assert set(queues) == {"p1", "p2", "p3"}  # every one that is up
                # the conductor's stages: a GPU second is priced at (busy instances +
                # waiting requests) / instances = (1 + 1) / 3; no arrival rate measured yet
                kappa = (1 + 1) / 3
                want = []
                for e in (p1, p2, p3):  # the prefix is pending on the busy one
                    blocks = 4 if e is busy else 0
                    queue = queues[e.name]
                    assert queue >= 0 and (queue == 0 or e is busy)
                    prefill = cost.prefill_time(n, blocks * BLOCK)
                    work = kappa * prefill
                    want.append({"instance": e.name, "matched_blocks": blocks,
                                 "cached_tokens": blocks * BLOCK, "fetch_blocks": 0,
                                 "queue_s": queue, "transfer_s": 0.0, "prefill_s": prefill,
                                 "work_price_s": work, "shut_out_s": 0.0,
                                 "ttft_s": queue + prefill, "score_s": queue + prefill + work})
                want.sort(key=lambda c: (c["score_s"], c["ttft_s"]))
                assert [c["instance"] for c in cands] == [c["instance"] for c in want]
                for got, exp in zip(cands, want, strict=True):
                    assert got.pop("instance") == exp.pop("instance")
                    assert got == pytest.approx(exp, rel=1e-12)
                assert cost.prefill_time(n, 4 * BLOCK) < cost.prefill_time(n)
            # at most explain_top of them (equal: in instance order)
            for e in (p1, p2, p3):
                e.hold = None
            async with running_gateway([doc], explain_top=1) as gw:
                await until(lambda: up(gw))
                status, headers, raw = await gw.post(
                    CMPL, {"model": MODEL, "prompt": prompt_ids(20, 9), "max_tokens": 1},
                    {"x-conductor-explain": "1"})
                assert status == 200, raw
                cands = json.loads(headers["x-conductor-decision"])["candidates"]
                assert [(c["instance"], c["matched_blocks"], c["queue_s"]) for c in cands] \
                    == [("p1", 0, 0.0)]

    asyncio.run(main())


def test_an_empty_tokenization_is_refused_naming_prompt_or_messages() -> None:
    """The engine tokenizes the text to nothing: a 400 naming the field the client sent
    (the gateway's own check comes after the engine's tokenization)."""
    async def main() -> None:
        async with tokenizing("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], tokenizer="engine") as gw:
            p0.tokenize = _answer(200, {"count": 0, "max_model_len": 1024, "tokens": []})
            for path, body, param in (
                    (CMPL, {"model": MODEL, "prompt": " "}, "prompt"),
                    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": " "}]},
                     "messages")):
                status, _h, raw = await gw.post(path, body)
                assert status == 400, raw
                assert _error(raw) == {"message": "the prompt is empty",
                                       "type": "invalid_request_error", "param": param,
                                       "code": None}
            assert p0.calls == [] and d0.calls == []

    asyncio.run(main())


def test_a_catalog_gateway_is_ready_once_its_configmaps_are_listed() -> None:
    """Serving models from ConfigMaps: not ready while the API server cannot be listed,
    ready after the first list even with a model that cannot serve yet (that model is
    named in ``missing`` and answers 503 itself)."""
    from ..fake_kube import fake_kube
    from .test_gateway_control_rules_catalog import catalog_gateway, configmap

    async def ready(url: str) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http, http.get(url + "/ready") as r:
            return r.status, await r.json()

    async def main() -> None:
        with fake_kube() as kube:
            kube.stop()  # nothing answers: the list keeps failing
            async with catalog_gateway(kube, []) as (_gw, url):
                for _ in range(3):
                    assert await ready(url) == (503, {"ready": False,
                                                      "missing": ["kubernetes_models:list"]})
                    await asyncio.sleep(0.05)
        async with engines("p0") as (p0,):
            with fake_kube() as kube:
                # a model whose decode engine is not there yet
                kube.put("configmaps", configmap("c1", model(
                    [p0], [{"url": "http://127.0.0.1:9", "name": "d-gone"}])))
                async with catalog_gateway(kube, []) as (_gw, url):
                    # ready from the first list on; p0 is routable once it was checked
                    want = (200, {"ready": True, "missing": [f"{MODEL}:decode"]})

                    async def listed() -> tuple[int, Any] | None:
                        got = await ready(url)
                        assert got[0] == 200 or got[1]["missing"] == [
                            "kubernetes_models:list"], got
                        return got if got == want else None
                    assert await until(listed) == want

    asyncio.run(main())
