"""Pure and in-process parts of Kubernetes models, registration, pairing, the registry
and hot-prefix tokens: model documents and conflicts, the ConfigMap watch against a
fake API server, pod revision and drain, registration (health check and KV
replay), revision pairing, ``unique_blocks`` and the hot-prefix token keeper."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import urllib.parse
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import yaml
import zmq
import zmq.asyncio
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.replication import HotPrefixTracker, ReplicationConfig
from mooncake_contract import conventions as c
from mooncake_contract.kvevents.codec import END_SEQ, encode_seq
from mooncake_gateway import catalog
from mooncake_gateway.catalog import (
    SETTINGS_SOURCE,
    ConfigMapWatch,
    ModelDocument,
    configmap_document,
    resolve,
)
from mooncake_gateway.discovery import pod_endpoint
from mooncake_gateway.hottokens import HotPrefixTokens
from mooncake_gateway.instances import Instance
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.reports import unique_blocks
from mooncake_gateway.runtime import ModelRuntime
from mooncake_gateway.settings import (
    Endpoint,
    GatewaySettings,
    KubernetesModels,
    KubernetesSource,
    ModelSettings,
    Role,
)

from ..fake_kube import fake_kube
from .gateway_fixtures import HOST, free_port

KEY = c.GATEWAY_MODEL_KEY
SEL = {"prefill_selector": "r=p", "decode_selector": "r=d"}


# -- model documents --------------------------------------------------------------------------
def _doc(source: str, text: str | None, created: float = 0.0) -> ModelDocument:
    return ModelDocument(source=source, namespace=source.split("/")[0], created=created,
                         text=text)


def test_documents_resolve_to_models_errors_and_conflicts() -> None:
    good = yaml.safe_dump({"name": "m", "block_size": 32, "kubernetes": SEL})
    docs = [
        _doc("ns/a", good, created=20.0),
        _doc("ns/b", "name: [unclosed"),
        _doc("ns/c", "- a list"),
        _doc("ns/d", yaml.safe_dump({"name": "x", "block_size": -1})),
        _doc("ns/e", None),
        _doc("ns/f", yaml.safe_dump({"name": "m"}), created=30.0),  # newer: conflict
        _doc("aa/g", yaml.safe_dump({"name": "m"}), created=25.0),  # newer, earlier name
        _doc("zz/h", yaml.safe_dump({"name": "own"})),  # the settings' model
        _doc("ns/i", yaml.safe_dump({"name": "n", "kubernetes": {**SEL, "namespace": "o"}})),
    ]
    cat = resolve(docs, KEY, reserved=["own"])
    assert sorted(cat.served) == ["m", "n"]
    source, cfg = cat.served["m"]
    assert source == "ns/a" and cfg.block_size == 32
    assert cfg.kubernetes is not None and cfg.kubernetes.namespace == "ns"  # its own
    assert cat.served["n"][1].kubernetes is not None
    assert cat.served["n"][1].kubernetes.namespace == "o"  # as written
    assert set(cat.invalid) == {"ns/b", "ns/c", "ns/d", "ns/e"}
    assert "YAML" in cat.invalid["ns/b"] and "mapping" in cat.invalid["ns/c"]
    assert "block_size" in cat.invalid["ns/d"] and KEY in cat.invalid["ns/e"]
    conflicts = {(x.source, x.model, x.winner) for x in cat.conflicts}
    assert conflicts == {("aa/g", "m", "ns/a"), ("ns/f", "m", "ns/a"),
                         ("zz/h", "own", SETTINGS_SOURCE)}
    # equal ages: the name decides, whatever the order they come in
    twins = [_doc("ns/y", yaml.safe_dump({"name": "t"}), 5.0),
             _doc("ns/x", yaml.safe_dump({"name": "t"}), 5.0)]
    assert resolve(twins, KEY).served["t"][0] == "ns/x"
    assert resolve(twins[::-1], KEY).served["t"][0] == "ns/x"


def test_a_configmap_object_becomes_a_document() -> None:
    created = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    cm = {"metadata": {"name": "c1", "namespace": "ns", "resourceVersion": "41",
                       "creationTimestamp": "2025-01-02T03:04:05Z"},
          "data": {KEY: "name: m\n"}}
    doc = configmap_document(cm, KEY)
    assert (doc.source, doc.namespace, doc.created, doc.text, doc.version) == (
        "ns/c1", "ns", created.timestamp(), "name: m\n", "41")
    bare = {"metadata": {"name": "c2", "namespace": "ns"}}
    assert configmap_document(bare, KEY).text is None
    assert configmap_document(bare, KEY).created == 0.0  # unknown age: counts as oldest


def _cm(name: str, ns: str, text: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns,
                         "labels": {c.LABEL_GATEWAY_MODEL: "true"}}, "data": {KEY: text}}


async def _watch_until(watch: ConfigMapWatch, seen: list[Any], count: int,
                       steps: Callable[[], None] = lambda: None) -> None:
    """Start ``watch``; once it reports, run ``steps``; stop after ``count`` reports."""
    await watch.start(lambda docs: seen.append({d.source: d.text for d in docs}))
    ran = False
    for _ in range(500):
        if seen and not ran:
            await asyncio.to_thread(steps)
            ran = True
        if len(seen) >= count:
            break
        await asyncio.sleep(0.01)
    await watch.stop()


@pytest.mark.parametrize("namespace", [None, "ns"])
def test_the_configmap_watch_reports_every_change(namespace: str | None) -> None:
    with fake_kube() as k:
        k.put("configmaps", _cm("a", "ns", "name: a"))
        k.put("configmaps", {"metadata": {"name": "other", "namespace": "ns"}})  # unlabelled
        watch = ConfigMapWatch(KubernetesModels(namespace=namespace), k.client())
        seen: list[dict[str, str | None]] = []

        def steps() -> None:
            k.put("configmaps", _cm("b", "ns", "name: b"))
            k.put("configmaps", _cm("a", "ns", "name: a2"))
            k.delete("configmaps", "ns", "b")

        asyncio.run(_watch_until(watch, seen, 4, steps))
        requests = list(k.requests)
    assert seen[:4] == [{"ns/a": "name: a"}, {"ns/a": "name: a", "ns/b": "name: b"},
                        {"ns/a": "name: a2", "ns/b": "name: b"}, {"ns/a": "name: a2"}]
    (list_path, listed), (watch_path, watched) = (_split(r) for r in requests[:2])
    path = "/api/v1/configmaps" if namespace is None else "/api/v1/namespaces/ns/configmaps"
    assert list_path == watch_path == path
    assert listed == {"labelSelector": [f"{c.LABEL_GATEWAY_MODEL}=true"]}
    assert watched["watch"] == ["true"] and watched["labelSelector"] == listed["labelSelector"]
    assert watched["resourceVersion"] == ["3"]  # from the list's version, not the start


def _split(request: str) -> tuple[str, dict[str, list[str]]]:
    parts = urllib.parse.urlsplit(request)
    return parts.path, urllib.parse.parse_qs(parts.query)


def test_the_watch_lists_again_after_an_api_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_kube import listwatch

    monkeypatch.setattr(listwatch, "RETRY_S", 0.01)
    with fake_kube() as k:
        k.put("configmaps", _cm("a", "ns", "name: v1"))
        k.fail_next = 1  # the first list meets an API server restarting
        watch = ConfigMapWatch(KubernetesModels(), k.client())
        seen: list[dict[str, str | None]] = []
        asyncio.run(_watch_until(watch, seen, 2,
                                 lambda: k.put("configmaps", _cm("a", "ns", "name: v2"))))
        lists = [r for r in k.requests if "watch=" not in r]
    assert [d["ns/a"] for d in seen[:2]] == ["name: v1", "name: v2"]
    assert len(lists) == 2  # the failed list, then the one that served


def test_module_constants_are_the_conventions() -> None:
    km = KubernetesModels()
    assert km.label_selector == "mooncake.io/gateway-model=true" and km.key == "model.yaml"
    assert catalog.SETTINGS_SOURCE == "settings"


# -- pods -------------------------------------------------------------------------------------
def _pod(labels: dict[str, str] | None = None,
         ann: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p-0", "namespace": "ns", "annotations": ann or {},
                         "labels": labels},
            "status": {"podIP": "10.0.0.7", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_pod_revision_drain_and_name() -> None:
    cfg = KubernetesSource(prefill_selector="a=b", decode_selector="a=c")
    ep = pod_endpoint(_pod({c.LABEL_REVISION: "abc123"}, {c.ANNOTATION_DRAIN: "true"}), cfg)
    assert ep is not None
    assert (ep.revision, ep.draining, ep.pod, ep.name) == ("abc123", True, "ns/p-0", "ns/p-0")
    ep = pod_endpoint(_pod(None, {c.ANNOTATION_DRAIN: "false"}), cfg)
    assert ep is not None and (ep.revision, ep.draining) == ("", False)
    ep = pod_endpoint(_pod({}, {c.ANNOTATION_DRAIN: " True "}), cfg)
    assert ep is not None and ep.draining


def test_pod_topology_annotation_becomes_the_endpoints_labels() -> None:
    cfg = KubernetesSource(prefill_selector="a=b", decode_selector="a=c")
    value = '{"example.com/rack":"r1","topology.kubernetes.io/zone":"a"}'
    ep = pod_endpoint(_pod({}, {c.ANNOTATION_TOPOLOGY: value}), cfg)
    assert ep is not None
    assert ep.topology == {"example.com/rack": "r1", "topology.kubernetes.io/zone": "a"}
    for bad in ("[\"r1\"]", "{not json", '{"rack": 1}'):
        ep = pod_endpoint(_pod({}, {c.ANNOTATION_TOPOLOGY: bad}), cfg)
        assert ep is not None and ep.topology == {}  # no place: the flat model
    ep = pod_endpoint(_pod({}, {}), cfg)
    assert ep is not None and ep.topology == {}


# -- registration and pairing -----------------------------------------------------------------
def _runtime(on_join: Callable[[ModelRuntime, Instance], None] | None = None,
             **gw: Any) -> ModelRuntime:
    s = GatewaySettings(**gw)
    return ModelRuntime(ModelSettings(name="m"), s, GatewayMetrics(), on_join=on_join)


def _ep(port: int, revision: str = "", draining: bool = False, **kw: Any) -> Endpoint:
    return Endpoint(url=f"http://{HOST}:{port}", revision=revision, draining=draining, **kw)


def test_an_instance_is_routable_once_registered_and_not_while_draining() -> None:
    joined: list[str] = []
    rt = _runtime(on_join=lambda rt, inst: joined.append(inst.name), unhealthy_after=2)
    rt.members.set_endpoints(Role.PREFILL, [_ep(1)])
    rt.members.set_endpoints(Role.DECODE, [_ep(2)])
    p, d = rt.prefill[0], rt.decode[0]
    assert joined == [p.name, d.name]  # checked at once
    assert not p.routable and not rt.cluster.prefill[0].up  # no check passed yet
    rt.members.mark_health(p, True)
    rt.members.mark_health(d, True)
    assert p.registered and p.routable and rt.cluster.prefill[0].up
    rt.members.set_endpoints(Role.PREFILL, [_ep(1, draining=True)])
    assert not p.routable and not rt.cluster.prefill[0].up and p.listed and p.registered
    assert joined == [p.name, d.name]  # a drain is not a new engine
    p.inflight = 1
    rt.members.set_endpoints(Role.PREFILL, [_ep(1)])
    assert p.routable and p.inflight == 1
    for _ in range(2):  # down after unhealthy_after failures; back after a pass
        rt.members.mark_health(p, False)
    assert not p.routable and not p.registered and p.down
    rt.members.mark_health(p, True)
    assert p.routable and p.registered
    rt.members.set_endpoints(Role.PREFILL, [_ep(1, pod="ns/other")])  # another pod, same IP
    assert not p.routable and not p.registered and joined[-1] == p.name
    rt.members.mark_health(p, True)
    assert p.routable
    rt.members.set_endpoints(Role.PREFILL, [])  # left; comes back as a new engine
    assert not p.listed and not p.routable
    rt.members.set_endpoints(Role.PREFILL, [_ep(1)])
    assert not p.routable and joined[-1] == p.name
    rt.members.mark_health(p, True)
    assert p.routable and rt.prefill == [p]  # the same id


def test_registration_waits_for_the_kv_replay() -> None:
    """With KV events, a passed health check is not enough: the initial replay must be
    done (here a replay socket that answers when the test lets it)."""

    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        replay_port = free_port()
        router.bind(f"tcp://{HOST}:{replay_port}")
        try:
            rt = _runtime(replay_timeout_s=30)
            ep = _ep(1, kv_events=f"tcp://{HOST}:{free_port()}",
                     kv_replay=f"tcp://{HOST}:{replay_port}")
            rt.members.set_endpoints(Role.PREFILL, [ep])
            rt.members.set_endpoints(Role.DECODE, [_ep(2)])
            p = rt.prefill[0]
            rt.members.mark_health(p, True)
            rt.members.mark_health(rt.decode[0], True)
            ident, _empty, _start = await asyncio.wait_for(router.recv_multipart(), 10)
            await asyncio.sleep(0.05)
            assert p.healthy and not p.synced and not p.registered and not p.routable
            await router.send_multipart([ident, b"", b"", encode_seq(END_SEQ), b""])
            for _ in range(200):
                if p.routable:
                    break
                await asyncio.sleep(0.01)
            assert p.synced and p.registered and p.routable
            await rt.close()
        finally:
            router.close(0)

    asyncio.run(run())


def test_prefill_waits_for_a_decode_of_its_revision() -> None:
    rt = _runtime()
    rt.members.set_endpoints(Role.PREFILL, [_ep(1, "old"), _ep(2, "new")])
    rt.members.set_endpoints(Role.DECODE, [_ep(3, "old")])
    for inst in rt.prefill + rt.decode:
        rt.members.mark_health(inst, True)
    old, new = rt.prefill
    assert old.routable and not new.routable and new.registered
    assert not rt.cluster.grouped()  # what is up is one revision
    rt.members.set_endpoints(Role.DECODE, [_ep(3, "old"), _ep(4, "new")])
    rt.members.mark_health(rt.decode[1], True)
    assert new.routable
    states = rt.cluster.prefill + rt.cluster.decode
    assert [s.group for s in states] == [1, 2, 1, 2] and rt.cluster.grouped()
    rt.members.set_endpoints(Role.DECODE, [_ep(4, "new")])  # the old decode leaves
    assert not old.routable and new.routable and not rt.cluster.grouped()
    # one revision left everywhere: no pairing rule, every state back in group 0 (the
    # core's fast path)
    rt.members.set_endpoints(Role.PREFILL, [_ep(2, "new")])
    assert new.routable and not rt.cluster.grouped()
    assert [s.group for s in states] == [0, 0, 0, 0]


def test_instances_take_their_places_from_the_conductors_topology() -> None:
    levels = [{"name": "rack", "gbits_per_s": 200.0}, {"name": "zone", "gbits_per_s": 50.0}]
    s = GatewaySettings()
    rt = ModelRuntime(ModelSettings(name="m", conductor={"topology": {"levels": levels}}), s,
                      GatewayMetrics())
    r1a, r2a = {"rack": "r1", "zone": "a"}, {"rack": "r2", "zone": "a"}
    rt.members.set_endpoints(Role.PREFILL, [_ep(1, topology=r1a), _ep(2, topology=r2a),
                                    _ep(3, topology={"rack": "r1"})])  # stale: no zone
    rt.members.set_endpoints(Role.DECODE, [_ep(4, topology=r1a)])
    p1, p2, p3 = (st.place for st in rt.cluster.prefill)
    d1 = rt.cluster.decode[0].place
    assert p1 and p2 and p1 != p2 and p1 == d1 and p3 == 0
    topo = rt.conductor.topology
    assert topo.level(p1, d1) == -1 and topo.level(p1, p2) == 0 and topo.level(p1, p3) == -1
    # a new Conductor without levels: every instance back to no place (the flat model)
    rt.reconfigure(ModelSettings(name="m"))
    assert [st.place for st in rt.cluster.prefill + rt.cluster.decode] == [0, 0, 0, 0]


# -- unique blocks ----------------------------------------------------------------------------
def _unique_ref(index: PrefixIndex) -> dict[int, int]:
    out: dict[int, int] = {}
    for m in index.holders.values():
        if m and not m & (m - 1):
            out[m.bit_length() - 1] = out.get(m.bit_length() - 1, 0) + 1
    return out


@pytest.mark.parametrize("mirrored", [False, True])
@pytest.mark.parametrize("instances", [5, 70])
def test_unique_blocks_counts_blocks_only_one_instance_holds(mirrored: bool,
                                                             instances: int) -> None:
    r = random.Random(instances)
    index = PrefixIndex(50_000, vector_min_keys=64 if mirrored else 1 << 30)
    key = 1
    for _ in range(200):
        keys = list(range(key, key + r.randint(1, 40)))
        key += len(keys)
        for h in r.sample(range(instances), r.choice([1, 1, 2, 3])):
            index.store(h, keys)
    index.store(0, [0])  # key 0 lives apart in the mirror
    index.match_all([1])  # builds the mirror past vector_min_keys
    assert (index._mirror is not None) == mirrored
    index.remove(1, list(range(1, 30)))
    want = _unique_ref(index)
    assert want and max(want) >= (instances if instances < 64 else 64) - 10
    got = asyncio.run(unique_blocks(index, chunk=64))
    assert got == want


# -- hot-prefix tokens ------------------------------------------------------------------------
def _feed(tracker: HotPrefixTracker, keys: list[int], blocks: int, prompt: Any,
          now: float) -> None:
    if isinstance(tracker, HotPrefixTokens):
        tracker.prompt = prompt  # as the gateway does around schedule()
    tracker.record(keys, now, blocks)
    if isinstance(tracker, HotPrefixTokens):
        tracker.prompt = None


def test_token_ids_are_kept_for_prefixes_about_to_be_hot() -> None:
    cfg = ReplicationConfig(half_life_s=10.0, min_rate_per_s=0.2, min_blocks=2)
    bs = 4
    plain = HotPrefixTracker(cfg)
    early = HotPrefixTokens(cfg, bs, rate_share=0.5, max_prefixes=8, max_tokens=10_000)
    exact = HotPrefixTokens(cfg, bs, rate_share=1.0, max_prefixes=64, max_tokens=10_000)
    r = random.Random(5)
    prompts = {p: np.arange(p * 1000, p * 1000 + 12 * bs, dtype=np.int64) for p in range(6)}
    keys = {p: [p * 100 + i for i in range(12)] for p in prompts}
    now = 0.0
    decisions = 300
    for _ in range(decisions):
        now += r.random() * 2
        p = r.choice([0, 0, 0, 0, 1, 1, 2, 3, 4, 5])  # 0 hot, 1 warm, the rest cold
        blocks = r.randint(1, 12)
        for t in (plain, early, exact):
            _feed(t, keys[p], blocks, prompts[p], now)
        hot = plain.hot(now)
        assert early.hot(now) == exact.hot(now) == hot  # still the core's tracker
        for prefix, _rate, pkeys in hot:
            # every hot prefix's tokens are there, copied when it first qualified
            toks = exact.tokens(prefix)
            assert toks is not None
            assert toks.tolist() == prompts[pkeys[0] // 100][: len(pkeys) * bs].tolist()
    assert early.kept() <= 8
    assert early.copies >= exact.copies and early.copies < decisions // 4  # not per request
    cold = [k for p in (3, 4, 5) for k in keys[p]]
    assert not any(exact.tokens(k) is not None for k in cold)
    # no prompt handed over (the tracker used on its own): nothing kept
    alone = HotPrefixTokens(cfg, bs, rate_share=0.5, max_prefixes=8, max_tokens=10_000)
    for i in range(20):
        alone.record(keys[0], float(i), 12)
    assert alone.hot(20.0) and alone.kept() == 0


def test_hot_token_memory_is_bounded() -> None:
    cfg = ReplicationConfig(half_life_s=10.0, min_rate_per_s=0.01, min_blocks=1)
    keeper = HotPrefixTokens(cfg, 4, rate_share=1.0, max_prefixes=3, max_tokens=20)
    for p in range(10):
        _feed(keeper, [p], 1, np.arange(4, dtype=np.int64) + p, float(p))
    assert keeper.kept() == 3 and keeper.kept_tokens == 12
    assert keeper.tokens(9) is not None and keeper.tokens(6) is None
    _feed(keeper, [100, 101, 102, 103, 104, 105], 6, np.arange(24, dtype=np.int64), 11.0)
    assert keeper.tokens(105) is None  # longer than the whole budget: not kept
    _feed(keeper, [200, 201, 202, 203], 4, np.arange(16, dtype=np.int64), 12.0)
    assert keeper.tokens(203) is not None and keeper.kept_tokens <= 20
    off = HotPrefixTokens(cfg, 4, rate_share=1.0, max_prefixes=0, max_tokens=20)
    _feed(off, [1], 1, np.arange(4, dtype=np.int64), 0.0)
    assert off.kept() == 0


# -- the command line -------------------------------------------------------------------------
def _args(*argv: str) -> Any:
    import argparse

    from mooncake_gateway.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["gateway", *argv])


def test_gateway_flags_turn_on_kubernetes_models(tmp_path: Any) -> None:
    from mooncake_gateway.cli import gateway_settings, run_gateway

    s = gateway_settings(_args("--kubernetes-models", "--port", "0", "--host", "0.0.0.0"))
    assert s.kubernetes_models == KubernetesModels() and (s.host, s.port) == ("0.0.0.0", 0)
    assert s.models == []
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml.safe_dump({"port": 9, "kubernetes_models": {"label_selector": "x=y"},
                                   "models": [{"name": "m"}]}))
    s = gateway_settings(_args("--config", str(cfg), "--kubernetes-models", "--namespace", "a"))
    assert s.kubernetes_models == KubernetesModels(namespace="a", label_selector="x=y")
    assert s.port == 9 and [m.name for m in s.models] == ["m"]
    s = gateway_settings(_args("--config", str(cfg)))  # the file alone: as written
    assert s.kubernetes_models == KubernetesModels(label_selector="x=y")
    assert run_gateway(_args()) == 2  # nothing to serve
    assert run_gateway(_args("--config", str(cfg), "--namespace", "a")) == 2
