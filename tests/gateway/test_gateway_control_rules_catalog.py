"""Models from ConfigMaps, in process: a :class:`~mooncake_gateway.server.Gateway` whose
``kubernetes`` client talks to the fake API server (:mod:`.fake_kube`, 127.0.0.1) and whose
model documents point at scripted engines. What ``/conductor/models``, ``/v1/models``,
``/ready`` and ``/metrics`` say as documents are added, found invalid, in conflict (with
each other and with the gateway's own settings), changed in place or in a way that needs a
new runtime, and removed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from mooncake_contract import conventions as c
from mooncake_gateway.server import Gateway
from mooncake_gateway.settings import GatewaySettings
from prometheus_client.parser import text_string_to_metric_families

from ..fake_kube import FakeKube, fake_kube
from .scripted import HOST, MODEL, QUIET, ScriptedEngine, engines, model, until

NS = "ns1"


@asynccontextmanager
async def catalog_gateway(kube: FakeKube, models: list[dict[str, Any]],
                          **settings: Any) -> AsyncIterator[tuple[Gateway, str]]:
    cfg = GatewaySettings.model_validate({
        **QUIET, "host": HOST, "port": 0, "models": models,
        "kubernetes_models": {"namespace": None}, **settings})
    gw = Gateway(cfg, kube=kube.client())
    runner = web.AppRunner(gw.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    try:
        yield gw, f"http://{HOST}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def configmap(name: str, doc: dict[str, Any] | str, ns: str = NS) -> dict[str, Any]:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    return {"metadata": {"name": name, "namespace": ns,
                         "labels": {c.LABEL_GATEWAY_MODEL: "true"}},
            "data": {c.GATEWAY_MODEL_KEY: text}}


def doc(p: ScriptedEngine, d: ScriptedEngine, name: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {**model([p], [d], **extra), "name": name}


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        return r.status, await r.json(content_type=None)


def _metric(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def test_models_from_configmaps_added_invalid_in_conflict_changed_and_removed() -> None:
    async def main() -> None:
        with fake_kube() as kube:
            async with engines("p0", "d0", "p1", "d1", "s0", "t0") as (p0, d0, p1, d1, s0, t0), \
                    catalog_gateway(kube, [doc(s0, t0, name="static")]) as (gw, url), \
                    aiohttp.ClientSession() as http:
                async def catalog() -> dict[str, Any]:
                    return dict((await _get(http, url + "/conductor/models"))[1])

                async def metrics() -> str:
                    async with http.get(url + "/metrics") as r:
                        return await r.text()

                async def served() -> list[str]:
                    return [m["id"] for m in (await _get(http, url + "/v1/models"))[1]["data"]]

                # listed, nothing in it yet: ready (the static model serves)
                async def listed() -> dict[str, Any] | None:
                    cat = await catalog()
                    return cat if cat["kubernetes_models"]["listed"] else None
                cat = await until(listed)
                assert cat == {
                    "kubernetes_models": {"namespace": None,
                                          "label_selector": f"{c.LABEL_GATEWAY_MODEL}=true",
                                          "key": c.GATEWAY_MODEL_KEY, "listed": True,
                                          "documents": 0},
                    "models": [{"model": "static", "source": None}],
                    "invalid": [], "conflicts": []}
                status, ready = await until(lambda: _ready(http, url))
                assert (status, ready) == (200, {"ready": True, "missing": []})

                # a document: its model is served
                kube.put("configmaps", configmap("c1", doc(p0, d0)))

                async def has_model() -> bool:
                    return MODEL in await served()
                await until(has_model)
                cat = await catalog()
                assert cat["models"] == [{"model": MODEL, "source": f"{NS}/c1"},  # by name
                                         {"model": "static", "source": None}]
                assert cat["kubernetes_models"]["documents"] == 1
                assert await served() == ["static", MODEL]
                text = await metrics()
                assert _metric(text, "mooncake_gateway_model_documents", state="served") == 1

                # an invalid document, a conflict with it, a conflict with the settings
                kube.put("configmaps", configmap("bad", "name: [unclosed"))
                kube.put("configmaps", configmap("dup", doc(p1, d1)))
                kube.put("configmaps", configmap("mine", doc(p1, d1, name="static"), ns="a"))

                async def reported() -> dict[str, Any] | None:
                    cat = await catalog()
                    return cat if len(cat["conflicts"]) == 2 and cat["invalid"] else None
                cat = await until(reported)
                assert cat["kubernetes_models"]["documents"] == 4
                assert [i["source"] for i in cat["invalid"]] == [f"{NS}/bad"]
                assert cat["invalid"][0]["error"].startswith("not YAML: ")
                assert sorted(cat["conflicts"], key=lambda x: x["source"]) == [
                    {"source": "a/mine", "model": "static", "winner": "settings"},
                    {"source": f"{NS}/dup", "model": MODEL, "winner": f"{NS}/c1"}]
                assert cat["models"] == [{"model": MODEL, "source": f"{NS}/c1"},  # by name
                                         {"model": "static", "source": None}]
                text = await metrics()
                assert _metric(text, "mooncake_gateway_model_documents", state="served") == 1
                assert _metric(text, "mooncake_gateway_model_documents", state="invalid") == 1
                assert _metric(text, "mooncake_gateway_model_documents", state="conflict") == 2
                errors = "mooncake_gateway_model_document_errors_total"
                assert _metric(text, errors, source=f"{NS}/bad") == 1
                # the same error again is not counted again; a new one is
                kube.put("configmaps", configmap("bad", "name: [unclosed"))
                kube.put("configmaps", configmap("c1", doc(p0, d0, max_model_len=2048)))

                async def changed() -> bool:
                    return bool(gw.models[MODEL].cfg.max_model_len == 2048)
                await until(changed)
                assert _metric(await metrics(), errors, source=f"{NS}/bad") == 1
                kube.put("configmaps", configmap("bad", "- a list"))

                async def new_error() -> bool:
                    return _metric(await metrics(), errors, source=f"{NS}/bad") == 2
                await until(new_error)
                assert (await catalog())["invalid"] == [
                    {"source": f"{NS}/bad", "error": "the document is not a mapping"}]

                # a swappable change (the context window) kept the runtime; a new block
                # size needs a new one, which serves once its instances are routable
                rt = gw.models[MODEL]
                got = (await _get(http, url + "/v1/models"))[1]["data"]
                assert [m["max_model_len"] for m in got if m["id"] == MODEL] == [2048]
                kube.put("configmaps", configmap("c1", doc(p0, d0, max_model_len=2048,
                                                           block_size=32)))

                async def swapped() -> bool:
                    return gw.models.get(MODEL) is not rt
                await until(swapped)
                new = gw.models[MODEL]
                assert new.cfg.block_size == 32 and new.source == f"{NS}/c1"
                assert all(i.routable for i in new.prefill + new.decode)
                status, _h, raw = await _post(http, url, {"model": MODEL, "prompt": [1, 2, 3],
                                                          "max_tokens": 1})
                assert status == 200, raw

                # the winner goes: the other document serves the model
                kube.delete("configmaps", NS, "c1")

                async def taken_over() -> dict[str, Any] | None:
                    cat = await catalog()
                    return cat if {"model": MODEL, "source": f"{NS}/dup"} in cat["models"] \
                        else None
                cat = await until(taken_over)
                assert cat["conflicts"] == [
                    {"source": "a/mine", "model": "static", "winner": "settings"}]
                # every document gone: only the settings' model
                for ns, name in ((NS, "dup"), (NS, "bad"), ("a", "mine")):
                    kube.delete("configmaps", ns, name)

                async def only_static() -> bool:
                    return bool((await catalog())["kubernetes_models"]["documents"] == 0)
                await until(only_static)
                cat = await catalog()
                assert (cat["invalid"], cat["conflicts"]) == ([], [])
                assert await served() == ["static"]
                text = await metrics()
                for state in ("served", "invalid", "conflict"):
                    assert _metric(text, "mooncake_gateway_model_documents", state=state) == 0
                status, _h, raw = await _post(http, url, {"model": MODEL, "prompt": [1, 2]})
                assert status == 404

    asyncio.run(main())


async def _ready(http: aiohttp.ClientSession, url: str) -> tuple[int, Any] | None:
    status, body = await _get(http, url + "/ready")
    return (status, body) if status == 200 else None


async def _post(http: aiohttp.ClientSession, url: str,
                body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url + "/v1/completions", data=json.dumps(body),
                         headers={"Content-Type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.read()


def test_not_ready_until_the_configmaps_are_listed() -> None:
    async def main() -> None:
        with fake_kube() as kube:
            kube.put("configmaps", configmap("c1", "name: x\nblock_size: 0"))
            async with catalog_gateway(kube, []) as (gw, url), \
                    aiohttp.ClientSession() as http:
                status, body = await _get(http, url + "/ready")
                if status == 503:  # before the first list arrived
                    assert body == {"ready": False, "missing": ["kubernetes_models:list"]}

                async def listed() -> tuple[int, Any] | None:
                    status, body = await _get(http, url + "/ready")
                    return (status, body) if status == 200 else None
                # listed: ready even though nothing serves (the model's own requests 404)
                assert await until(listed) == (200, {"ready": True, "missing": []})
                assert gw.catalog.invalid[f"{NS}/c1"].startswith("1 validation error")

    asyncio.run(main())
