"""``kind-config.yaml`` against kind's v1alpha4 config format, decoded strictly as kind
decodes it (unknown or duplicate fields are errors), and against the embedded cluster's
GPU pools: the same labels and taint on the same kinds of nodes.

The field set is that of ``Cluster``, ``Node``, ``Networking``, ``PatchJSON6902``,
``Mount`` and ``PortMapping`` in kind's ``pkg/apis/config/v1alpha4/types.go``; kind loads
the file with ``yaml.v3``'s ``KnownFields(true)`` and validates it with
``pkg/internal/apis/config/validate.go``. Fields only newer kind releases know (a node's
``gpus``, ``networking.dnsSearch``) are left out on purpose: a file that passes here
loads on older kind too.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from mooncake_localcluster import manifests
from mooncake_localcluster.settings import LocalClusterSettings
from mooncake_operator.settings import OperatorSettings

from .dockerfile import ROOT

KIND_CONFIG = ROOT / "kind-config.yaml"

# -- kind's v1alpha4 types, as (yaml key -> type) ---------------------------------------
INT32 = ("int", -(2**31), 2**31 - 1)
PATCH_JSON6902 = {"group": str, "version": str, "kind": str, "patch": str}
MOUNT = {"containerPath": str, "hostPath": str, "readOnly": bool, "selinuxRelabel": bool,
         "propagation": ("enum", {"None", "HostToContainer", "Bidirectional"})}
PORT_MAPPING = {"containerPort": INT32, "hostPort": INT32, "listenAddress": str,
                "protocol": ("enum", {"TCP", "UDP", "SCTP"})}
NETWORKING = {"ipFamily": ("enum", {"ipv4", "ipv6", "dual"}), "apiServerPort": INT32,
              "apiServerAddress": str, "podSubnet": str, "serviceSubnet": str,
              "disableDefaultCNI": bool,
              "kubeProxyMode": ("enum", {"iptables", "ipvs", "nftables", "none"})}
NODE = {"role": ("enum", {"control-plane", "worker"}), "image": str,
        "labels": ("map", str), "extraMounts": ("list", MOUNT),
        "extraPortMappings": ("list", PORT_MAPPING), "kubeadmConfigPatches": ("list", str),
        "kubeadmConfigPatchesJSON6902": ("list", PATCH_JSON6902)}
CLUSTER = {"kind": str, "apiVersion": str, "name": str, "nodes": ("list", NODE),
           "networking": NETWORKING, "featureGates": ("map", bool),
           "runtimeConfig": ("map", str), "kubeadmConfigPatches": ("list", str),
           "kubeadmConfigPatchesJSON6902": ("list", PATCH_JSON6902),
           "containerdConfigPatches": ("list", str),
           "containerdConfigPatchesJSON6902": ("list", str)}
CLUSTER_NAME = re.compile(r"^[a-z0-9.-]+$")  # validate.go's validNameRE

# kubeadm's nodeRegistration taints (core/v1 Taint)
TAINT_KEYS = {"key", "value", "effect", "timeAdded"}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
KUBEADM_KINDS = {"InitConfiguration", "ClusterConfiguration", "JoinConfiguration",
                 "KubeletConfiguration", "KubeProxyConfiguration"}

# Kubernetes label syntax
_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
LABEL_VALUE = re.compile(rf"^({_NAME})?$")
LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       rf"{_NAME}$")


class _StrictLoader(yaml.SafeLoader):
    """yaml.v3 rejects a key given twice in one mapping; PyYAML keeps the last."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = [loader.construct_object(k) for k, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(
            None, None, f"mapping key(s) {sorted(dupes)} already defined", node.start_mark)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def strict_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass


def check(value: Any, schema: Any, path: str) -> list[str]:
    """Errors of ``value`` against ``schema`` (a struct dict, a type or a tagged tuple)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected an object"]
        errors = [f"{path}.{k}: field not found in type ({sorted(schema)})"
                  for k in value if k not in schema]
        for key, sub in value.items():
            if key in schema:
                errors += check(sub, schema[key], f"{path}.{key}")
        return errors
    if schema is bool or schema is str:
        ok = isinstance(value, schema)
        return [] if ok else [f"{path}: expected {schema.__name__}, got {value!r}"]
    tag = schema[0]
    if tag == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or not schema[1] <= value <= schema[2]:
            return [f"{path}: expected int32, got {value!r}"]
        return []
    if tag == "enum":
        return [] if value in schema[1] else [f"{path}: {value!r} not in {sorted(schema[1])}"]
    if tag == "list":
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(value) for e in check(v, schema[1], f"{path}[{i}]")]
    if tag == "map":
        if not isinstance(value, dict):
            return [f"{path}: expected a map"]
        return [e for k, v in value.items() for e in
                (check(k, str, f"{path} key") + check(v, schema[1], f"{path}[{k}]"))]
    raise AssertionError(schema)


def validate(doc: Any) -> list[str]:
    """kind's decoding and Validate(), for what this file can get wrong."""
    if not isinstance(doc, dict):
        return ["not a YAML mapping"]
    if (doc.get("apiVersion"), doc.get("kind")) != ("kind.x-k8s.io/v1alpha4", "Cluster"):
        return ["apiVersion/kind must be kind.x-k8s.io/v1alpha4 Cluster"]
    errors = check(doc, CLUSTER, "Cluster")
    if "name" in doc and not CLUSTER_NAME.match(str(doc["name"])):
        errors.append(f"{doc['name']!r} is not a valid cluster name")
    nodes = doc.get("nodes") or [{"role": "control-plane"}]
    if not any(n.get("role", "control-plane") == "control-plane" for n in nodes):
        errors.append("must have at least one control-plane node")
    for i, node in enumerate(nodes):
        for key, value in (node.get("labels") or {}).items():
            if not LABEL_KEY.match(str(key)) or not LABEL_VALUE.match(str(value)):
                errors.append(f"nodes[{i}]: invalid label {key}={value}")
        for j, raw in enumerate(node.get("kubeadmConfigPatches") or []):
            errors += [f"nodes[{i}].kubeadmConfigPatches[{j}]: {e}"
                       for e in _check_kubeadm_patch(raw)]
    return errors


def _check_kubeadm_patch(raw: str) -> list[str]:
    patch = strict_load(raw)
    if not isinstance(patch, dict) or patch.get("kind") not in KUBEADM_KINDS:
        return [f"kind must be one of {sorted(KUBEADM_KINDS)}"]
    errors = []
    for taint in _taints(patch):
        if set(taint) - TAINT_KEYS or taint.get("effect") not in TAINT_EFFECTS:
            errors.append(f"invalid taint {taint}")
    return errors


def _taints(patch: dict[str, Any]) -> list[dict[str, Any]]:
    return list((patch.get("nodeRegistration") or {}).get("taints") or [])


def _config() -> dict[str, Any]:
    doc = strict_load(KIND_CONFIG.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _node_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for raw in node.get("kubeadmConfigPatches") or []:
        patch = strict_load(raw)
        # workers join: only JoinConfiguration's nodeRegistration applies to them
        if patch.get("kind") == "JoinConfiguration":
            out += _taints(patch)
    return out


# -- the tests ------------------------------------------------------------------------
def test_kind_config_is_valid_v1alpha4() -> None:
    assert validate(_config()) == []


@pytest.mark.parametrize("broken, error", [
    ({"nodes": [{"role": "control-plane", "gpus": "all"}]}, "field not found"),
    ({"nodes": [{"role": "worker"}]}, "at least one control-plane"),
    ({"nodes": [{"role": "master"}]}, "not in"),
    ({"networking": {"apiServerPort": "6443"}}, "expected int32"),
    ({"networking": {"kubeProxyMode": "userspace"}}, "not in"),
    ({"nodes": [{"role": "control-plane", "labels": {"pool": 1}}]}, "expected str"),
    ({"name": "Mooncake"}, "not a valid cluster name"),
    ({"nodes": [{"role": "control-plane", "kubeadmConfigPatches": [
        "kind: JoinConfiguration\nnodeRegistration:\n  taints:\n  - {key: a, effect: Never}"
    ]}]}, "invalid taint"),
])
def test_the_validator_rejects_what_kind_rejects(broken: dict[str, Any], error: str) -> None:
    doc = {"kind": "Cluster", "apiVersion": "kind.x-k8s.io/v1alpha4", **broken}
    assert any(error in e for e in validate(doc)), validate(doc)


def test_duplicate_keys_are_rejected_as_by_yaml_v3() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="already defined"):
        strict_load("kind: Cluster\nkind: Cluster\n")


def _expected(pool: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The embedded cluster's labels (those a kubelet may set on itself: none under
    kubernetes.io / k8s.io, nor kwok's own ``type``) and taints for a node of ``pool``."""
    settings = LocalClusterSettings()
    node = manifests.fake_node(settings, f"x-{pool}", pool, 0)
    labels = {k: v for k, v in node["metadata"]["labels"].items()
              if k != "type" and not re.search(r"(^|\.)(kubernetes\.io|k8s\.io)/", k)}
    return labels, node["spec"]["taints"]


def _pools(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    label = LocalClusterSettings().pool_label
    out: dict[str, list[dict[str, Any]]] = {}
    for node in doc["nodes"]:
        if node.get("role") == "worker":
            out.setdefault((node.get("labels") or {}).get(label, ""), []).append(node)
    return out


def test_nodes_are_labelled_and_tainted_like_the_embedded_cluster() -> None:
    pools = _pools(_config())
    assert set(pools) == {*manifests.POOLS, manifests.SYSTEM_POOL}, set(pools)
    for pool, nodes in pools.items():
        labels, taints = _expected(pool)
        for node in nodes:
            assert node["labels"] == labels, (pool, node["labels"])
            assert _node_taints(node) == taints, pool


def test_the_operator_finds_its_nodes() -> None:
    """GPU nodes carry the label the store DaemonSet selects and the taint engine pods
    tolerate; the simulated example's 2+2 pods have a node each."""
    settings = OperatorSettings()
    pools = _pools(_config())
    for pool in manifests.POOLS:
        for node in pools[pool]:
            assert node["labels"][settings.gpu_node_label] == "true"
            assert [t["key"] for t in _node_taints(node)] == [settings.gpu_taint_key]
    example = yaml.safe_load((ROOT / "examples/clusters/simulated.yaml").read_text())
    for pool in manifests.POOLS:
        spec = example["spec"][pool]
        matching = [n for n in pools[pool] if all(
            n["labels"].get(k) == v for k, v in spec["nodeSelector"].items())]
        assert len(matching) >= spec["replicas"], pool


def test_fake_gpu_patch_advertises_the_labelled_count() -> None:
    """The comment's `kubectl patch` gives each GPU node what its gpu.count label says."""
    text = KIND_CONFIG.read_text(encoding="utf-8")
    advertised = re.findall(r'"path": "/status/capacity/nvidia.com~1gpu", "value": "(\d+)"',
                            text)
    counts = {n["labels"]["nvidia.com/gpu.count"] for pool in manifests.POOLS
              for n in _pools(_config())[pool]}
    assert advertised and set(advertised) == counts


def test_docs_show_the_same_patch() -> None:
    doc = (ROOT / "docs" / "real-cluster.md").read_text(encoding="utf-8")
    assert "kind-config.yaml" in doc
    assert '"/status/capacity/nvidia.com~1gpu"' in doc
