"""Engine pods carry their node's topology labels (placement.py, Reconciler._place)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from mooncake_contract import conventions as c
from mooncake_operator import crd, placement
from mooncake_operator.observe import PodView
from mooncake_operator.reconcile import Reconciler
from mooncake_operator.settings import OperatorSettings
from mooncake_operator.spec import TopologySpec

from ..charts.fake_api import RecordingKube
from .manifests import example

NS = "serving"
RACK, ZONE = "example.com/rack", "topology.kubernetes.io/zone"
TOPO = TopologySpec.model_validate({"levels": [
    {"nodeLabel": RACK, "gbitsPerSecond": 200},
    {"nodeLabel": ZONE, "gbitsPerSecond": 50, "latencyMicroseconds": 1000}]})


def _pod(name: str, node: str = "n1", annotation: str | None = None,
         **kw: Any) -> PodView:
    return PodView(name=name, uid=f"u-{name}", role="prefill", revision="r", ordinal=0,
                   node=node, topology_annotation=annotation, **kw)


def test_only_scheduled_live_pods_without_a_full_annotation_are_placed() -> None:
    done = json.dumps({RACK: "r1", ZONE: "a"})
    stale = json.dumps({RACK: "r1"})  # written before the zone level was added
    pods = [_pod("new"), _pod("unscheduled", node=""), _pod("placed", annotation=done),
            _pod("stale", annotation=stale), _pod("leaving", terminating=True),
            _pod("failed", phase="Failed")]
    assert [p.name for p in placement.unplaced(pods, TOPO)] == ["new", "stale"]
    assert placement.unplaced(pods, TopologySpec()) == []


def test_patches_name_each_pods_node_labels() -> None:
    pods = [_pod("a", node="n1"), _pod("b", node="n2"), _pod("c", node="gone")]
    nodes = {"n1": {RACK: "r1", ZONE: "a", "other": "x"}, "n2": {ZONE: "b"}}
    out = placement.patches(pods, nodes, TOPO)
    assert {k: json.loads(v) for k, v in out.items()} == {
        "a": {RACK: "r1", ZONE: "a"}, "b": {RACK: "", ZONE: "b"}}


def _cluster(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            "metadata": {"name": "llama", "namespace": NS, "uid": "uid-cluster",
                         "generation": 1},
            "spec": spec}


def test_the_reconciler_annotates_new_pods_once() -> None:
    kube = RecordingKube()
    for node, rack in (("gpu-1", "r1"), ("gpu-2", "r2")):
        kube.put("", "nodes", {"metadata": {"name": node, "labels": {RACK: rack, ZONE: "a"}}})
    rec = Reconciler(kube, None, OperatorSettings())
    _, model = example("simulated")
    spec = model.model_dump(by_alias=True, mode="json", exclude_none=True)
    spec["store"]["enabled"] = False
    spec["topology"] = TOPO.model_dump(by_alias=True, mode="json")
    kube.put(crd.GROUP, crd.PLURAL, _cluster(spec))

    def emit(*_: str) -> None:
        pass

    def body() -> dict[str, Any]:  # the cluster as stored now (the status changes it)
        return copy.deepcopy(kube.all(crd.GROUP, crd.PLURAL, NS)["llama"])

    asyncio.run(rec.reconcile(body(), emit))  # pods created, not scheduled
    pods = kube.all("", "pods", NS)
    assert pods and not any(c.ANNOTATION_TOPOLOGY in (p["metadata"].get("annotations") or {})
                            for p in pods.values())
    for i, p in enumerate(sorted(pods.values(), key=lambda p: p["metadata"]["name"])):
        p["spec"]["nodeName"] = f"gpu-{i % 2 + 1}"
    asyncio.run(rec.reconcile(body(), emit))
    for p in pods.values():
        ann = json.loads(p["metadata"]["annotations"][c.ANNOTATION_TOPOLOGY])
        assert ann == {RACK: "r1" if p["spec"]["nodeName"] == "gpu-1" else "r2", ZONE: "a"}
    before = dict(kube.writes)
    kube.used.clear()
    asyncio.run(rec.reconcile(body(), emit))
    assert ("", "nodes", "get") not in kube.used  # placed pods cost no node reads
    assert kube.writes.get(("patch", "Pod"), 0) == before.get(("patch", "Pod"), 0)
