"""The gateway's control side, in process: the vLLM metrics it reads from an engine's
``/metrics`` (parsed line by line, summed over label sets), the scrape and health loops
against scripted engines, and the read-only endpoints' JSON (``/v1/models``,
``/openapi.json``, ``/conductor/state``, ``/conductor/hot-prefixes``,
``/conductor/registry``, ``/conductor/decisions``, ``/metrics``) with their ``model``,
``limit`` and ``tokens`` parameters."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from mooncake_contract.kvevents.codec import BlockStored
from mooncake_gateway.enginemetrics import parse_engine_metrics
from mooncake_gateway.openapi import openapi_spec
from mooncake_gateway.server import loop_factory
from mooncake_gateway.settings import GatewaySettings
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from .scripted import (
    BLOCK,
    MODEL,
    GatewayClient,
    ScriptedEngine,
    ScriptedPublisher,
    engines,
    model,
    prompt_ids,
    running_gateway,
    until,
)


# -- the engine metrics the gateway reads ---------------------------------------------------
def test_metrics_lines_without_labels_with_timestamps_and_after_bad_lines() -> None:
    before = time.monotonic()
    st = parse_engine_metrics("\n".join([
        "vllm:num_requests_running",  # no value: skipped, the rest still read
        "vllm:num_requests_waiting{engine=\"0\"} NaN-ish",  # not a number: skipped
        "vllm:num_requests_running 4 1700000000000",  # a timestamp after the value
        "vllm:num_requests_waiting 2",
        "vllm:num_requests_waiting{engine=\"1\"}  3",
        "vllm:kv_cache_usage_perc 0.75",
        "vllm:kv_cache_usage_perc{engine=\"1\"} 0.25",  # the fullest engine counts
        "vllm:prefix_cache_hits_total 7",
        "vllm:prefix_cache_queries_total 9",
        "vllm:prefix_cache_queries_total{engine=\"1\"} 1",
        "vllm:num_requests_running{note=\"a{b}\"} 1",  # braces inside a label value
    ]))
    assert (st.running, st.waiting, st.kv_usage) == (5.0, 5.0, 0.75)
    assert (st.prefix_hits, st.prefix_queries) == (7.0, 10.0)
    assert (st.block_size, st.num_gpu_blocks) == (None, None)
    assert before <= st.scraped_at <= time.monotonic()


def test_metrics_cache_config_with_missing_or_bad_fields() -> None:
    st = parse_engine_metrics('vllm:cache_config_info{num_gpu_blocks="64"} 1.0')
    assert (st.block_size, st.num_gpu_blocks) == (None, 64)
    st = parse_engine_metrics('vllm:cache_config_info{block_size="32"} 1.0')
    assert (st.block_size, st.num_gpu_blocks) == (32, None)
    st = parse_engine_metrics('vllm:cache_config_info{block_size="x",num_gpu_blocks="y"} 1')
    assert (st.block_size, st.num_gpu_blocks) == (None, None)
    st = parse_engine_metrics('vllm:cache_config_info{block_size="x",num_gpu_blocks="8"} 1\n'
                              'vllm:num_requests_running 2')
    assert (st.block_size, st.num_gpu_blocks, st.running) == (None, 8, 2.0)
    st = parse_engine_metrics('vllm:cache_config_info{num_gpu_blocks="8",block_size="z"} 1\n'
                              'vllm:num_requests_running 2')
    assert (st.block_size, st.num_gpu_blocks, st.running) == (None, 8, 2.0)
    # only the engines' own series: a look-alike name or another prefix is not read
    st = parse_engine_metrics("vllm:num_requests_running_total 9\nsgl:num_running_reqs 9\n"
                              " vllm:num_requests_running 9\nsglang:num_running_reqs_total 9")
    assert st.running == 0.0


def test_sglang_series_repeated_per_tensor_parallel_rank_count_once() -> None:
    """SGLang's scheduler gauges carry a ``tp_rank`` label: the largest counts (summed they
    would count one batch once per rank); its counters sum; its page size and token
    capacity give the block size and the number of blocks."""
    lines = []
    for rank in (0, 1):
        labels = f'engine_type="prefill",model_name="m",tp_rank="{rank}"'
        lines += [f"sglang:num_running_reqs{{{labels}}} {3 + rank}",
                  f"sglang:num_queue_reqs{{{labels}}} 2",
                  f"sglang:token_usage{{{labels}}} {0.25 * (rank + 1)}",
                  f"sglang:page_size{{{labels}}} 64",
                  f"sglang:max_total_num_tokens{{{labels}}} 640000"]
    lines += ['sglang:cached_tokens_total{cache_source="device",model_name="m"} 30',
              'sglang:cached_tokens_total{cache_source="host",model_name="m"} 10',
              'sglang:prompt_tokens_total{is_streaming="false",model_name="m"} 100']
    st = parse_engine_metrics("\n".join(lines))
    assert (st.running, st.waiting, st.kv_usage) == (4.0, 2.0, 0.5)
    assert (st.prefix_hits, st.prefix_queries) == (40.0, 100.0)
    assert (st.block_size, st.num_gpu_blocks) == (64, 10_000)
    # a page size but no capacity: the block size alone; neither: nothing
    st = parse_engine_metrics("sglang:page_size 16")
    assert (st.block_size, st.num_gpu_blocks) == (16, None)
    assert parse_engine_metrics("sglang:max_total_num_tokens 99").num_gpu_blocks is None


def test_loop_factory_follows_the_uvloop_setting() -> None:
    import uvloop

    assert loop_factory(GatewaySettings(uvloop=False)) is None
    assert loop_factory(GatewaySettings(uvloop=True)) is uvloop.new_event_loop


# -- scraping and health checks -------------------------------------------------------------
VLLM_PAGE = "\n".join([
    "# HELP vllm:num_requests_running running",
    'vllm:num_requests_running{engine="0"} 3',
    'vllm:num_requests_waiting{engine="0"} 2',
    'vllm:kv_cache_usage_perc{engine="0"} 0.5',
    'vllm:prefix_cache_hits_total{engine="0"} 4',
    'vllm:prefix_cache_queries_total{engine="0"} 8',
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0',
])


class MetricsEngine(ScriptedEngine):
    """A scripted engine whose ``/metrics`` page and status the test sets."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.page = VLLM_PAGE
        self.metrics_status = 200
        self.scrapes = 0

    async def _metrics(self, _r: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=self.page, status=self.metrics_status,
                            content_type="text/plain")


def _engine_view(st: dict[str, Any], role: str, i: int) -> dict[str, Any]:
    return dict(st[role][i]["engine"])


def test_engines_are_scraped_and_checked_in_the_background() -> None:
    async def main() -> None:
        p0, d0 = MetricsEngine("p0"), MetricsEngine("d0")
        await p0.start()
        await d0.start()
        d0.page = VLLM_PAGE.replace("} 3", "} 1").replace('num_gpu_blocks="100"',
                                                          'num_gpu_blocks="50"')
        try:
            async with running_gateway([model([p0], [d0])], metrics_interval_s=0.05,
                                       health_interval_s=0.05, unhealthy_after=1) as gw:
                async def scraped() -> Any:
                    st = await gw.state()
                    return st if _engine_view(st, "decode", 0)["running"] == 1.0 and \
                        _engine_view(st, "prefill", 0)["running"] == 3.0 else None
                st = await until(scraped)
                assert _engine_view(st, "prefill", 0) == {
                    "running": 3.0, "waiting": 2.0, "kv_usage": 0.5, "prefix_hits": 4.0,
                    "prefix_queries": 8.0, "block_size": 16, "num_gpu_blocks": 100}
                assert st["decode"][0]["engine"]["num_gpu_blocks"] == 50
                # a page that is not 200 changes nothing
                p0.metrics_status = 500
                p0.page = VLLM_PAGE.replace("} 3", "} 9")
                seen = p0.scrapes
                await until(lambda: _gt(p0, seen + 2))
                assert _engine_view(await gw.state(), "prefill", 0)["running"] == 3.0
                p0.metrics_status = 200

                async def nine() -> bool:
                    return bool(_engine_view(await gw.state(), "prefill", 0)["running"] == 9.0)
                await until(nine)
                # an engine failing its health check is down and no longer scraped
                d0.healthy = False

                async def down() -> bool:
                    return not (await gw.state())["decode"][0]["healthy"]
                await until(down)
                seen = d0.scrapes
                await asyncio.sleep(0.3)
                assert d0.scrapes <= seen + 1  # one already under way at most
                d0.healthy = True

                async def back() -> bool:
                    return bool((await gw.state())["decode"][0]["healthy"])
                await until(back)
                await until(lambda: _gt(d0, seen + 1))
        finally:
            await p0.stop()
            await d0.stop()

    asyncio.run(main())


class CountingEngine(MetricsEngine):
    """Counts its health checks too."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.checks = 0

    async def _health(self, r: web.Request) -> web.Response:
        self.checks += 1
        return await super()._health(r)


def test_an_engine_in_both_roles_is_checked_and_scraped_once_a_round() -> None:
    """One engine listed as a prefill and as a decode instance (the ``direct`` rule's
    single-hop setup): one health check and one scrape per round serve both instances."""
    interval = 0.1

    async def main() -> None:
        e = CountingEngine("e")
        await e.start()
        try:
            async with running_gateway([model([e], [e])], metrics_interval_s=interval,
                                       health_interval_s=interval) as gw:
                async def scraped() -> bool:
                    st = await gw.state()
                    return all(st[role][0]["engine"]["running"] == 3.0
                               for role in ("prefill", "decode"))
                await until(scraped)
                checks, scrapes = e.checks, e.scrapes
                started = time.monotonic()
                await asyncio.sleep(1.0)
                rounds = (time.monotonic() - started) / interval + 1  # at most
                assert 0 < e.checks - checks <= rounds
                assert 0 < e.scrapes - scrapes <= rounds
        finally:
            await e.stop()

    asyncio.run(main())


async def _gt(e: MetricsEngine, n: int) -> bool:
    return e.scrapes > n


def test_an_engine_that_stops_answering_is_marked_down() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])], health_interval_s=0.05, unhealthy_after=2,
                metrics_interval_s=0.05) as gw:
            await p1.stop()

            async def p1_down() -> Any:
                st = await gw.state()
                return st if not st["prefill"][1]["healthy"] else None
            st = await until(p1_down)
            assert st["prefill"][0]["healthy"] and st["decode"][0]["healthy"]
            assert not st["prefill"][1]["routable"]

    asyncio.run(main())


# -- the read-only endpoints ----------------------------------------------------------------
async def _status_json(gw: GatewayClient, path: str) -> tuple[int, Any]:
    async with gw.session.get(gw.url + path) as r:
        return r.status, await r.json()


def test_models_and_openapi_list_every_model() -> None:
    async def main() -> None:
        async with engines("p0", "d0", "p1", "d1") as (p0, d0, p1, d1), running_gateway(
                [model([p0], [d0], max_model_len=4096),
                 {**model([p1], [d1]), "name": "second"}]) as gw:
            before = int(time.time())
            got = await gw.get("/v1/models")
            after = int(time.time())
            assert got["object"] == "list"
            created = got["data"][0]["created"]
            assert before <= created <= after and isinstance(created, int)
            assert got["data"] == [
                {"id": MODEL, "object": "model", "created": created, "owned_by": "mooncake",
                 "max_model_len": 4096},
                {"id": "second", "object": "model", "created": created,
                 "owned_by": "mooncake", "max_model_len": 131072}]
            assert await gw.get("/openapi.json") == json.loads(
                json.dumps(openapi_spec([MODEL, "second"])))
            # the model parameter: all, one, or a 404 naming it
            st = await gw.get("/conductor/state")
            assert [m["model"] for m in st["models"]] == [MODEL, "second"]
            st = await gw.get("/conductor/state?model=second")
            assert [m["model"] for m in st["models"]] == ["second"]
            for path in ("/conductor/state?model=nope", "/conductor/registry?model=nope",
                         "/conductor/decisions?model=nope",
                         "/conductor/hot-prefixes?model=nope"):
                assert await _status_json(gw, path) == (404, {"error": {
                    "message": "The model `nope` does not exist.", "type": "not_found_error",
                    "param": "model", "code": "model_not_found"}})
            reg = await gw.get("/conductor/registry")
            assert [m["model"] for m in reg["models"]] == [MODEL, "second"]
            reg = await gw.get("/conductor/registry?model=second")
            assert [m["model"] for m in reg["models"]] == ["second"]
            assert [i["url"] for i in reg["models"][0]["instances"]] == [p1.url, d1.url]

    asyncio.run(main())


def test_decisions_newest_last_limited() -> None:
    async def main() -> None:
        async with engines("p0", "d0", "p1", "d1") as (p0, d0, p1, d1), running_gateway(
                [model([p0], [d0]), {**model([p1], [d1]), "name": "second"}]) as gw:
            order = [MODEL, "second", MODEL, "second", "second"]
            for i, name in enumerate(order):
                status, _h, raw = await gw.post("/v1/completions", {
                    "model": name, "prompt": prompt_ids(20, i + 1), "max_tokens": 2})
                assert status == 200, raw
            every = await gw.get("/conductor/decisions")
            assert [d["model"] for d in every] == order
            assert [d["time"] for d in every] == sorted(d["time"] for d in every)
            assert [d["model"] for d in await gw.get("/conductor/decisions?limit=2")] == \
                ["second", "second"]
            assert await gw.get("/conductor/decisions?limit=0") == []
            assert [d["id"] for d in await gw.get("/conductor/decisions?limit=100")] == \
                [d["id"] for d in every]
            mine = await gw.get(f"/conductor/decisions?model={MODEL}&limit=1")
            assert [d["id"] for d in mine] == [every[2]["id"]]
            assert (await _status_json(gw, "/conductor/decisions?limit=-1"))[0] == 400
            assert (await _status_json(gw, "/conductor/decisions?limit=x"))[0] == 400

    asyncio.run(main())


def test_hot_prefixes_hottest_first_limited_with_or_without_tokens() -> None:
    async def main() -> None:
        pub = ScriptedPublisher()
        chains: list[tuple[list[int], list[int | bytes]]] = [
            (prompt_ids(4 * BLOCK, first), [first * 1000 + i for i in range(4)])
            for first in (1, 2, 3)]
        try:
            async with engines("p0", "d0") as (p0, d0), running_gateway(
                    [model([p0.endpoint(**pub.endpoint_fields())], [d0],
                           conductor={"replication": {"min_rate_per_s": 0.001}})],
                    hot_prefixes_max=2) as gw:
                # p0 holds three 4-block prefixes (its KV events say so)
                for tokens, hashes in chains:
                    seq = await pub.publish([BlockStored(hashes, None, tokens, BLOCK)])

                async def applied() -> bool:
                    st = await gw.state()
                    return int(st["prefill"][0]["events"]["last_seq"]) >= seq
                await until(applied)
                # asked for 3, 2 and 1 times (each access adds ln 2 / 60 s to a rate)
                for (tokens, _h), times in zip(chains, (3, 2, 1), strict=True):
                    for i in range(times):
                        status, _hd, raw = await gw.post("/v1/completions", {
                            "model": MODEL, "prompt": tokens + prompt_ids(5, 50 + i),
                            "max_tokens": 1})
                        assert status == 200, raw
                hot = await gw.get("/conductor/hot-prefixes?limit=50")
                assert [h["blocks"] for h in hot] == [4, 4, 4]
                rates = [h["rate_per_s"] for h in hot]
                assert rates == sorted(rates, reverse=True) and rates[0] > rates[2]
                for h in hot:
                    assert h["model"] == MODEL and "token_ids" not in h
                    assert h["tokens"] == 4 * BLOCK and h["holders"] == ["p0"]
                    assert set(h["holders_predicted_wait_s"]) == {"p0"}
                # the default limit is the setting; a limit cuts the list
                assert _stable(await gw.get("/conductor/hot-prefixes")) == _stable(hot[:2])
                assert _stable(await gw.get("/conductor/hot-prefixes?limit=1")) == \
                    _stable(hot[:1])
                assert await gw.get("/conductor/hot-prefixes?limit=0") == []
                with_tokens = await gw.get(f"/conductor/hot-prefixes?model={MODEL}&"
                                           "tokens=yes&limit=50")
                assert [h["prefix"] for h in with_tokens] == [h["prefix"] for h in hot]
                by_tokens = {tuple(t[:BLOCK]): t for t, _h in chains}
                for h in with_tokens:
                    ids = h["token_ids"]
                    assert ids is None or ids == by_tokens[tuple(ids[:BLOCK])]
                assert any(h["token_ids"] is not None for h in with_tokens)
                assert _stable(await gw.get("/conductor/hot-prefixes?tokens=0&limit=50")) == \
                    _stable(hot)
                status, body = await _status_json(gw, "/conductor/hot-prefixes?tokens=maybe")
                assert (status, body["error"]["param"]) == (400, "tokens")
                status, body = await _status_json(gw, "/conductor/hot-prefixes?limit=-2")
                assert (status, body["error"]["param"]) == (400, "limit")
        finally:
            await pub.close()

    asyncio.run(main())


def _stable(hot: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hot-prefix entries without their rates (which decay as time goes by)."""
    return [{k: v for k, v in h.items() if not k.startswith("rate_")} for h in hot]


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_page_has_per_model_and_per_instance_gauges() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0])]) as gw:
            p0.hold = asyncio.Event()
            p1.hold = p0.hold
            sent = asyncio.create_task(gw.post("/v1/completions", {
                "model": MODEL, "prompt": prompt_ids(64), "max_tokens": 2}))

            async def arrived() -> bool:
                return len(p0.calls) + len(p1.calls) == 1
            await until(arrived)
            async with gw.session.get(gw.url + "/metrics") as r:
                assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST
                text = await r.text()
            waits = _samples(text, "mooncake_gateway_instance_predicted_wait_seconds")
            busy = "p0" if p0.calls else "p1"
            idle = "p1" if busy == "p0" else "p0"
            assert set(waits) == {(("instance", "p0"), ("model", MODEL)),
                                  (("instance", "p1"), ("model", MODEL))}
            assert waits[(("instance", busy), ("model", MODEL))] > 0
            assert waits[(("instance", idle), ("model", MODEL))] == 0
            assert _samples(text, "mooncake_gateway_index_blocks") == {
                (("model", MODEL),): 0.0}
            p0.hold.set()
            status, _h, _raw = await sent
            assert status == 200

    asyncio.run(main())
