"""The API server itself rejects malformed MooncakeClusters, field by field (the CRD's
schema and CEL rules), and accepts the examples. Needs the embedded control plane."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from mooncake_localcluster.kubehttp import ApiError, KubeHttp
from mooncake_operator import crd

from .manifests import EXAMPLES, replaced

pytestmark = pytest.mark.cluster
NS = "crd-validation"
BASE: dict[str, Any] = {
    "apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
    "metadata": {"name": "ok"}, "spec": {"model": {"name": "m"}},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    return replaced(BASE, path, value)


def _many(*pairs: tuple[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    for path, value in pairs:
        node = obj
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return obj


# (case, object, the field the server names, words of its message)
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("name too long", _with("metadata.name", "x" * 41), "metadata.name", "40"),
    ("model missing", {**BASE, "spec": {}}, "spec.model", "Required"),
    ("block size zero", _with("spec.model.blockSize", 0), "spec.model.blockSize",
     "greater than or equal to 1"),
    ("served name with spaces", _with("spec.model.servedName", "my model"),
     "spec.model.servedName", "should match"),
    ("pools half empty", _many(("spec.prefill.replicas", 2), ("spec.decode.replicas", 0)),
     "spec.decode.replicas", "both zero or both non-zero"),
    ("real engine without image", _with("spec.engine.kind", "vllm"), "spec.engine.image",
     "image is required"),
    ("owned flag in extraArgs", _with("spec.engine.extraArgs", ["--port=9000"]),
     "spec.engine.extraArgs", "flags the operator owns"),
    ("owned transfer flag in extraArgs",
     _with("spec.engine.extraArgs", ["--enforce-eager", "--disaggregation-transfer-backend",
                                     "nixl"]),
     "spec.engine.extraArgs", "flags the operator owns"),
    ("ports clash", _with("spec.engine.ports", {"http": 5557}), "spec.engine.ports",
     "must differ"),
    ("allowed namespace not a name", _with("spec.networkPolicy.allowedNamespaces",
                                           ["Monitoring"]),
     "spec.networkPolicy.allowedNamespaces[0]", "should match"),
    ("GPUs in resources", _with("spec.prefill.resources", {"limits": {"nvidia.com/gpu": 8}}),
     "spec.prefill.resources", "gpusPerReplica"),
    ("segment above limit", _many(("spec.store.segmentSize", "8Gi"),
                                  ("spec.store.memoryLimit", "6Gi")),
     "spec.store.segmentSize", "below memoryLimit"),
    ("not a quantity", _with("spec.store.segmentSize", "lots"), "spec.store.segmentSize",
     "should match"),
    ("unknown protocol", _with("spec.store.protocol", "udp"), "spec.store.protocol",
     "Unsupported value"),
    ("unknown policy", _with("spec.conductor.policy", "fastest"), "spec.conductor.policy",
     "Unsupported value"),
    ("CPP on", _with("spec.conductor.cpp", {"enabled": True}), "spec.conductor.cpp.enabled",
     "chunked pipeline prefill"),
    ("one replica is no replication",
     _with("spec.conductor.hotPrefixes", {"maxReplicas": 1}),
     "spec.conductor.hotPrefixes.maxReplicas", "at least 2"),
    ("zero TBT SLO", _with("spec.conductor.slo", {"tbtSeconds": 0}),
     "spec.conductor.slo.tbtSeconds", "greater than 0"),
    ("surge of 0%", _with("spec.rollout.maxSurge", "0%"), "spec.rollout.maxSurge",
     "should match"),
    ("real engine without GPUs", _many(("spec.engine", {"kind": "sglang", "image": "i"}),
                                       ("spec.prefill.gpusPerReplica", 0)),
     "spec.prefill.gpusPerReplica", "at least one GPU"),
    ("unknown field", _with("spec.modle", {"name": "typo"}), "spec.modle", "unknown field"),
    ("topology label not a label key",
     _with("spec.topology", {"levels": [{"nodeLabel": "rack id", "gbitsPerSecond": 200}]}),
     "spec.topology.levels[0].nodeLabel", "should match"),
    ("topology level named twice",
     _with("spec.topology", {"levels": [
         {"nodeLabel": "example.com/rack", "gbitsPerSecond": 200},
         {"nodeLabel": "example.com/rack", "gbitsPerSecond": 100}]}),
     "spec.topology.levels[1]", "Duplicate value"),
    ("topology link of 0 Gbit/s",
     _with("spec.topology", {"levels": [{"nodeLabel": "example.com/rack",
                                         "gbitsPerSecond": 0}]}),
     "spec.topology.levels[0].gbitsPerSecond", "greater than 0"),
    ("engine version not a release", _many(("spec.engine", {"kind": "vllm", "image": "i",
                                                            "version": "latest"}),
                                           ("spec.prefill.gpusPerReplica", 1),
                                           ("spec.decode.gpusPerReplica", 1)),
     "spec.engine.version", "should match"),
]


@pytest.fixture(scope="module")
def api(k8s_cluster: Any) -> Iterator[KubeHttp]:
    http: KubeHttp = k8s_cluster.http()
    body = crd.crd()
    http.request("PATCH", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                 f"{crd.CRD_NAME}?fieldManager=test&force=true", body,
                 content_type="application/apply-patch+yaml")
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conds = http.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                         f"{crd.CRD_NAME}").get("status", {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
            break
        time.sleep(0.2)
    try:
        http.post("/api/v1/namespaces", {"metadata": {"name": NS}})
    except ApiError as err:
        assert err.status == 409
    yield http


def _create(api: KubeHttp, obj: dict[str, Any]) -> dict[str, Any]:
    path = f"/apis/mooncake.io/v1alpha1/namespaces/{NS}/mooncakeclusters" \
           "?fieldValidation=Strict&dryRun=All"
    return api.post(path, obj)


@pytest.mark.parametrize(("case", "obj", "field", "words"), INVALID,
                         ids=[c[0] for c in INVALID])
def test_invalid_spec_rejected_with_field_message(api: KubeHttp, case: str,
                                                  obj: dict[str, Any], field: str,
                                                  words: str) -> None:
    with pytest.raises(ApiError) as info:
        _create(api, obj)
    err = info.value
    assert err.status in (400, 422), (case, err)
    body = json.loads(err.body)
    causes = body.get("details", {}).get("causes") or []
    where = [(cz.get("field", ""), cz.get("message", "")) for cz in causes]
    assert any(f == field and words in m for f, m in where) or (
        field in body.get("message", "") and words in body.get("message", "")), (case, where,
                                                                                  body)


@pytest.mark.parametrize("name", ["simulated", "vllm", "sglang"])
def test_examples_are_accepted(api: KubeHttp, name: str) -> None:
    obj = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    out = _create(api, obj)
    # the API server filled the defaults the operator relies on
    assert out["spec"]["engine"]["ports"]["kvEvents"] == 5557
    assert out["spec"]["rollout"]["maxSurge"] == "25%"


def test_the_network_policy_the_operator_builds_is_accepted(api: KubeHttp) -> None:
    """The API server's own validation (strict fields, dry run) of ``netpol.py``'s object."""
    from mooncake_operator import netpol
    from mooncake_operator.names import ClusterRef
    from mooncake_operator.settings import OperatorSettings
    from mooncake_operator.spec import MooncakeClusterSpec

    settings = OperatorSettings(gateway_namespace="mooncake-system",
                                gateway_pod_labels={"app.kubernetes.io/name": "mc"})
    spec = MooncakeClusterSpec.model_validate(
        {"model": {"name": "m"}, "networkPolicy": {"allowedNamespaces": ["monitoring"]}})
    policy = netpol.network_policy(ClusterRef("ok", NS, "uid-1"), spec, settings)
    assert policy is not None
    policy["metadata"].pop("ownerReferences")  # no such owner in this namespace
    got = api.post(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
                   "?fieldValidation=Strict&dryRun=All", policy)
    assert got["spec"]["ingress"] == policy["spec"]["ingress"]


def test_a_topology_is_accepted_with_its_defaults(api: KubeHttp) -> None:
    obj = _with("spec.topology", {"levels": [
        {"nodeLabel": "nvidia.com/gpu.clique", "gbitsPerSecond": 800},
        {"nodeLabel": "topology.kubernetes.io/zone", "gbitsPerSecond": 50,
         "latencyMicroseconds": 1000}]})
    out = _create(api, obj)["spec"]["topology"]
    assert out["aware"] is True
    assert out["levels"][0]["latencyMicroseconds"] == 0
    assert [lv["nodeLabel"] for lv in out["levels"]] == [
        "nvidia.com/gpu.clique", "topology.kubernetes.io/zone"]
