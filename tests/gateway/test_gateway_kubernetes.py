"""The gateway in Kubernetes mode, end to end on 127.0.0.1: ``mooncake-operator gateway
--kubernetes-models`` (a subprocess, the real ``kubernetes`` client via ``KUBECONFIG``)
against a fake API server (:mod:`.fake_kube`) that holds model ConfigMaps and pods whose
IPs and port annotations point at real worker subprocesses.

Covered: models added, reconfigured (in place and with a new runtime), taken over on a
conflict and removed as their ConfigMaps change; bad documents; registration of a new
pod within about a second; revision pairing during a rollout; drained pods finishing
their requests; the registry endpoint."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import yaml
from mooncake_contract import conventions as c

from ..fake_kube import FakeKube, fake_kube
from .conftest import FAST
from .gateway_fixtures import (
    MODEL,
    GatewayProc,
    WorkerProc,
    http_json,
    run_gateway,
    run_worker,
    wait_for,
)

NS = "ns1"
PROMPT = " ".join(f"kube{i % 37} word{i}" for i in range(150))
#: far apart: a pod that gets routable at once was checked when it joined, not by the loop
HEALTH_INTERVAL_S = 5.0
ROUTABLE_WITHIN_S = 1.5
#: how long a pod event takes at most to reach the gateway here (for negative checks)
NOT_LISTED_WAIT_S = 0.5


@dataclass
class Env:
    kube: FakeKube
    gateway: GatewayProc
    p1: WorkerProc
    p2: WorkerProc
    d1: WorkerProc
    d2: WorkerProc


def pod(name: str, role: str, w: WorkerProc, revision: str = "r1", cluster: str = "c1",
        drain: bool = False, ready: bool = True) -> dict[str, Any]:
    ann = {c.ANNOTATION_HTTP_PORT: str(w.port), c.ANNOTATION_KV_EVENTS_PORT: str(w.kv_port),
           c.ANNOTATION_KV_REPLAY_PORT: str(w.replay_port)}
    if drain:
        ann[c.ANNOTATION_DRAIN] = "true"
    return {
        "metadata": {"name": name, "namespace": NS, "annotations": ann,
                     "labels": {c.LABEL_CLUSTER: cluster, c.LABEL_ROLE: role,
                                c.LABEL_REVISION: revision}},
        "spec": {"containers": [{"name": "engine", "image": "sim"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def model_doc(cluster: str = "c1", namespace: str | None = None,
              **extra: Any) -> dict[str, Any]:
    kube: dict[str, Any] = {
        "prefill_selector": f"{c.LABEL_CLUSTER}={cluster},{c.LABEL_ROLE}={c.ROLE_PREFILL}",
        "decode_selector": f"{c.LABEL_CLUSTER}={cluster},{c.LABEL_ROLE}={c.ROLE_DECODE}"}
    if namespace is not None:
        kube["namespace"] = namespace
    return {"name": MODEL, "max_model_len": 16384, "kubernetes": kube, **extra}


def configmap(name: str, doc: dict[str, Any] | str, ns: str = NS,
              created: dt.datetime | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ns,
                            "labels": {c.LABEL_GATEWAY_MODEL: "true"}}
    if created is not None:
        meta["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    return {"metadata": meta, "data": {c.GATEWAY_MODEL_KEY: text}}


def served(g: GatewayProc) -> list[str]:
    return [m["id"] for m in g.get("/v1/models")["data"]]


def registry(g: GatewayProc) -> dict[str, Any]:
    """The model's registry entry (no instances while the model is not served)."""
    status, body = http_json(g.url + f"/conductor/registry?model={MODEL}")
    if status == 404:
        return {"instances": [], "revisions": []}
    return dict(body["models"][0])


def by_pod(g: GatewayProc) -> dict[str, dict[str, Any]]:
    return {i["pod"]: i for i in registry(g)["instances"]}


def complete(g: GatewayProc, prompt: str = PROMPT, max_tokens: int = 2) -> str:
    cl = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)
    out = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    return out.choices[0].text


def clear(k: FakeKube) -> None:
    for kind in ("pods", "configmaps"):
        for ns, name in list(k.objects[kind]):
            k.delete(kind, ns, name)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with fake_kube() as kube, run_worker(*FAST, "--role", "prefill") as p1, \
            run_worker(*FAST, "--role", "prefill") as p2, \
            run_worker(*FAST, "--role", "decode") as d1, \
            run_worker(*FAST, "--role", "decode") as d2:
        fd, path = tempfile.mkstemp(suffix=".kubeconfig")
        os.close(fd)
        kube.kubeconfig(path)
        try:
            with run_gateway([], args=("--kubernetes-models",),
                             env={"KUBECONFIG": path, "KUBERNETES_SERVICE_HOST": ""},
                             health_interval_s=HEALTH_INTERVAL_S) as g:
                yield Env(kube, g, p1, p2, d1, d2)
        finally:
            os.unlink(path)


@pytest.fixture
def k(env: Env) -> Iterator[FakeKube]:
    """The fake API of ``env``, emptied after the test (the gateway then serves nothing)."""
    yield env.kube
    clear(env.kube)
    wait_for(lambda: served(env.gateway) == [])


def test_a_model_without_instances_does_not_make_the_gateway_unready(
        env: Env, k: FakeKube) -> None:
    """One gateway serves every cluster: a cluster still being created (no pods yet) must
    not take the gateway's Service away from the others."""
    g = env.gateway
    k.put("configmaps", configmap("c1", model_doc(cluster="nothing-yet")))
    wait_for(lambda: served(g) == [MODEL])
    ready = g.get("/ready")
    assert ready["ready"] is True
    assert sorted(ready["missing"]) == [f"{MODEL}:decode", f"{MODEL}:prefill"]
    status, _h, body = g.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 429 and body["error"]["type"], body  # refused, the others unaffected


def test_models_follow_their_configmaps(env: Env, k: FakeKube) -> None:
    g = env.gateway
    assert served(g) == [] and g.get("/ready")["ready"]  # listed, nothing to serve yet
    k.put("pods", pod("p1", "prefill", env.p1))
    k.put("pods", pod("d1", "decode", env.d1))
    k.put("configmaps", configmap("c1", model_doc()))
    wait_for(lambda: served(g) == [MODEL])
    wait_for(lambda: g.get("/ready")["missing"] == [])
    assert g.get("/ready")["ready"]
    assert complete(g)
    cat = g.get("/conductor/models")
    assert cat["models"] == [{"model": MODEL, "source": f"{NS}/c1"}]
    assert cat["kubernetes_models"]["listed"] is True

    # a newer ConfigMap naming the same model (its name sorts first: age decides)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    k.put("configmaps", configmap("dup", model_doc(namespace=NS), ns="a-first", created=later))
    k.put("configmaps", configmap("bad", "name: [unclosed"))
    wait_for(lambda: len(g.get("/conductor/models")["invalid"]) == 1)
    cat = g.get("/conductor/models")
    assert cat["conflicts"] == [{"source": "a-first/dup", "model": MODEL,
                                 "winner": f"{NS}/c1"}]
    assert cat["invalid"][0]["source"] == f"{NS}/bad"
    assert "YAML" in cat["invalid"][0]["error"]
    metrics = _metrics(g)
    assert f'mooncake_gateway_model_document_errors_total{{source="{NS}/bad"}} 1.0' in metrics
    assert 'mooncake_gateway_model_documents{state="conflict"} 1.0' in metrics

    # a new policy: swapped in place (the runtime and its counters stay)
    wait_for(lambda: g.state()["index"]["blocks"] > 0)
    prompt_tokens = g.state()["tokens"]["prompt"]
    assert prompt_tokens > 0
    k.put("configmaps", configmap("c1", model_doc(conductor={"policy": "round-robin"})))
    wait_for(lambda: g.state()["policy"] == "round-robin")
    st = g.state()
    assert st["tokens"]["prompt"] == prompt_tokens and st["index"]["blocks"] > 0
    # a new index size: a new runtime, serving once its instances registered
    k.put("configmaps", configmap("c1", model_doc(index_capacity_blocks=4096)))
    wait_for(lambda: g.state()["tokens"]["prompt"] == 0)
    assert all(i["routable"] for i in registry(g)["instances"])
    assert complete(g)
    up = (f'mooncake_gateway_instance_up{{instance="{NS}/p1",model="{MODEL}",'
          f'role="prefill"}} 1.0')
    assert up in _metrics(g)  # the old runtime's close kept what the new one publishes

    # the winner goes: the other ConfigMap serves the model now
    k.delete("configmaps", NS, "c1")
    wait_for(lambda: g.get("/conductor/models")["models"]
             == [{"model": MODEL, "source": "a-first/dup"}])
    assert g.get("/conductor/models")["conflicts"] == []
    wait_for(lambda: g.get("/ready")["missing"] == [])
    assert complete(g)
    k.delete("configmaps", "a-first", "dup")
    wait_for(lambda: served(g) == [])
    assert f'instance="{NS}/p1"' not in _metrics(g)  # a removed model leaves no series
    status, _h, body = g.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_new_pod_is_routable_within_about_a_second(env: Env, k: FakeKube) -> None:
    g = env.gateway
    k.put("pods", pod("p1", "prefill", env.p1))
    k.put("pods", pod("d1", "decode", env.d1))
    k.put("configmaps", configmap("c1", model_doc()))
    wait_for(lambda: g.get("/ready")["missing"] == [])
    k.put("pods", pod("p2", "prefill", env.p2, ready=False))
    time.sleep(NOT_LISTED_WAIT_S)
    assert f"{NS}/p2" not in by_pod(g)  # not Ready: not an endpoint
    t0 = time.monotonic()
    k.put("pods", pod("p2", "prefill", env.p2))
    wait_for(lambda: by_pod(g).get(f"{NS}/p2", {}).get("routable"), timeout=5, interval=0.02)
    took = time.monotonic() - t0
    assert took < ROUTABLE_WITHIN_S, took  # health loop every 5 s: the join's own check
    p2 = by_pod(g)[f"{NS}/p2"]
    assert p2["registered"] and p2["healthy"] and p2["listed"]


def test_a_rollout_pairs_prefill_and_decode_of_one_revision(env: Env, k: FakeKube) -> None:
    g = env.gateway
    k.put("pods", pod("p1", "prefill", env.p1, revision="r1"))
    k.put("pods", pod("d1", "decode", env.d1, revision="r1"))
    k.put("pods", pod("p2", "prefill", env.p2, revision="r2"))
    k.put("configmaps", configmap("c1", model_doc(conductor={"policy": "round-robin"})))
    wait_for(lambda: by_pod(g).get(f"{NS}/p2", {}).get("registered"))
    pods = by_pod(g)
    # a new-revision prefill without a decode of its revision: registered, not routable
    assert not pods[f"{NS}/p2"]["routable"] and pods[f"{NS}/p1"]["routable"]
    assert registry(g)["revisions"] == ["r1", "r2"]
    for i in range(4):
        complete(g, PROMPT + f" early {i}")
    early = g.get("/conductor/decisions?limit=4")
    assert {d["prefill"] for d in early} == {f"{NS}/p1"}

    k.put("pods", pod("d2", "decode", env.d2, revision="r2"))
    wait_for(lambda: all(i["routable"] for i in registry(g)["instances"]))
    revision = {i["pod"]: i["revision"] for i in registry(g)["instances"]}
    for i in range(12):
        complete(g, PROMPT + f" rollout {i}")
    decisions = g.get("/conductor/decisions?limit=12")
    assert {d["prefill"] for d in decisions} == {f"{NS}/p1", f"{NS}/p2"}  # both serve
    for d in decisions:
        assert revision[d["prefill"]] == revision[d["decode"]], d

    # the old revision's decode leaves: its prefill is out of routing at once
    k.delete("pods", NS, "d1")
    wait_for(lambda: not by_pod(g)[f"{NS}/p1"]["routable"])
    # a pod that is gone exports nothing (not up=0: a scale to zero is no outage)
    metrics = _metrics(g)
    assert f'instance="{NS}/d1"' not in metrics
    assert (f'mooncake_gateway_instance_up{{instance="{NS}/p1",model="{MODEL}",'
            f'role="prefill"}} 0.0') in metrics
    for i in range(3):
        complete(g, PROMPT + f" late {i}")
    late = g.get("/conductor/decisions?limit=3")
    assert {(d["prefill"], d["decode"]) for d in late} == {(f"{NS}/p2", f"{NS}/d2")}


def test_a_drained_pod_finishes_what_it_has(k: FakeKube, env: Env) -> None:
    g = env.gateway
    with run_worker("--time-scale", "1", "--max-model-len", "16384",
                    "--role", "decode") as slow:
        k.put("pods", pod("p1", "prefill", env.p1))
        k.put("pods", pod("slow", "decode", slow))
        k.put("configmaps", configmap("c1", model_doc()))
        wait_for(lambda: g.get("/ready")["missing"] == [])
        cl = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=60)
        got: list[str] = []
        finish: list[str | None] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for ch in cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60,
                                                stream=True):
                    if ch.choices and ch.choices[0].text:
                        got.append(ch.choices[0].text)
                    if ch.choices and ch.choices[0].finish_reason:
                        finish.append(ch.choices[0].finish_reason)
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: len(got) >= 2, timeout=30)
        k.put("pods", pod("slow", "decode", slow, drain=True))
        wait_for(lambda: by_pod(g)[f"{NS}/slow"]["draining"])
        view = by_pod(g)[f"{NS}/slow"]
        assert view["inflight"] == 1 and not view["routable"] and view["listed"]
        # no new request goes there: with no other decode the scheduler says so
        status, _h, body = g.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 429, body
        t.join(60)
        # the stream in flight finished in full
        assert not errors and len(got) == 60 and finish == ["length"]
        wait_for(lambda: by_pod(g)[f"{NS}/slow"]["inflight"] == 0)
        k.put("pods", pod("slow", "decode", slow))  # drain lifted
        wait_for(lambda: by_pod(g)[f"{NS}/slow"]["routable"])
        assert complete(g)
        k.delete("pods", NS, "slow")
        wait_for(lambda: f"{NS}/slow" not in by_pod(g))


def test_the_registry_tells_the_operator_about_every_pod(env: Env, k: FakeKube) -> None:
    g = env.gateway
    for name, role, w in (("p1", "prefill", env.p1), ("p2", "prefill", env.p2),
                          ("d1", "decode", env.d1)):
        k.put("pods", pod(name, role, w, revision="r7"))
    k.put("configmaps", configmap("c1", model_doc()))
    wait_for(lambda: len(by_pod(g)) == 3 and all(i["routable"] for i in by_pod(g).values()))
    complete(g, PROMPT + " registry")
    first = g.get("/conductor/decisions?limit=1")[-1]["prefill"]
    other = ({f"{NS}/p1", f"{NS}/p2"} - {first}).pop()
    workers = {f"{NS}/p1": env.p1, f"{NS}/p2": env.p2, f"{NS}/d1": env.d1}
    held = {name: set(w.get("/kv/blocks")["keys"]) for name, w in workers.items()}
    # the index is in step with the engines (keys are equal across engines of one model)
    wait_for(lambda: all(by_pod(g)[n]["index_blocks"] == len(held[n]) for n in workers))
    reg = registry(g)
    assert reg["model"] == MODEL and reg["source"] == f"{NS}/c1" and reg["revisions"] == ["r7"]
    pods = {i["pod"]: i for i in reg["instances"]}
    assert len(held[first]) > 0
    assert pods[first]["unique_blocks"] == len(held[first] - held[other])
    assert pods[other]["unique_blocks"] == len(held[other] - held[first])
    assert pods[f"{NS}/d1"]["unique_blocks"] == len(held[f"{NS}/d1"])  # the only decode
    assert set(pods[first]) == {
        "pod", "role", "revision", "url", "listed", "draining", "healthy", "registered",
        "routable", "inflight", "index_blocks", "unique_blocks", "predicted_wait_s",
        "cache_capacity_blocks"}
    capacity = workers[first].get("/kv/blocks")["capacity_blocks"]
    wait_for(lambda: by_pod(g)[first]["cache_capacity_blocks"] == capacity)  # engine metrics
    d = pods[f"{NS}/d1"]
    assert d["role"] == "decode" and d["batch"] == 0 and "predicted_wait_s" not in d
    # the OpenAPI description names every field, and the required ones are always there
    spec = g.get("/openapi.json")["paths"]["/conductor/registry"]["get"]["responses"]["200"]
    item = spec["content"]["application/json"]["schema"]["properties"]["models"]["items"]
    inst = item["properties"]["instances"]["items"]
    assert set(inst["properties"]) == set(pods[first]) | set(d)
    assert set(inst["required"]) == set(pods[first]) & set(d)
    assert set(item["required"]) == set(reg)
    assert d["url"] == env.d1.url and d["revision"] == "r7"
    assert http_json(g.url + "/conductor/registry?model=nope")[0] == 404
    assert [m["model"] for m in g.get("/conductor/registry")["models"]] == [MODEL]


def _metrics(g: GatewayProc) -> str:
    import urllib.request

    with urllib.request.urlopen(g.url + "/metrics", timeout=10) as r:
        return r.read().decode()
