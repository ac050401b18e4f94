"""RBAC without drift: the chart's Role equals the table in
``operator/mooncake_operator/permissions.py``, and the table equals what the code uses —
derived here from kopf's handler registry and kopf's settings, from every request the
reconciler makes against a recording fake API (create, change, orphan delete, scale up,
drain, delete), and from the calls of the gateway's ConfigMap and pod watches."""

from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Any

import kopf
import pytest
from mooncake_contract import conventions as c
from mooncake_gateway.catalog import ConfigMapWatch
from mooncake_gateway.discovery import KubernetesPodSource
from mooncake_gateway.settings import KubernetesModels, KubernetesSource
from mooncake_operator import crd, handlers, permissions
from mooncake_operator.reconcile import Reconciler
from mooncake_operator.settings import OperatorSettings

from ..fake_kube import fake_kube
from ..operator.manifests import example, replaced
from .chartutil import ALL_ON, find, render
from .fake_api import RecordingKube

Triple = tuple[str, str, str]
NS = "serving"


# -- the chart follows the table --------------------------------------------------------------
def _normalized(rules: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], ...]]:
    return sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"]),
                   tuple(r.get("resourceNames", ())), tuple(r.get("nonResourceURLs", ())))
                  for r in rules)


def test_role_is_the_table() -> None:
    objs = render()
    role = find(objs, "Role")
    assert _normalized(role["rules"]) == _normalized(permissions.rbac_rules(permissions.RULES))
    # the one cluster-scoped grant: reading nodes for spec.topology
    cluster_scoped = [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert sorted(o["metadata"]["name"] for o in cluster_scoped) == [
        f"{role['metadata']['name']}-nodes"] * 2
    binding = find(objs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    sa = find(objs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                                    "namespace": sa["namespace"]}]


def test_the_nodes_role_is_its_table_and_can_be_left_out() -> None:
    objs = render()
    role = find(objs, "ClusterRole", "-nodes")
    assert _normalized(role["rules"]) == _normalized(
        permissions.rbac_rules(permissions.NODE_RULES))
    binding = find(objs, "ClusterRoleBinding", "-nodes")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == find(objs, "RoleBinding")["subjects"]
    bare = render({"rbac": {"readNodes": False}})
    assert not [o for o in bare if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_cluster_role_is_the_table() -> None:
    objs = [o for o in render(ALL_ON) if not o["metadata"]["name"].endswith("-nodes")]
    role = find(objs, "ClusterRole")
    want = permissions.rbac_rules(permissions.RULES + permissions.CLUSTER_WIDE_RULES)
    assert _normalized(role["rules"]) == _normalized(want)
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    assert find(objs, "ClusterRoleBinding")["roleRef"]["kind"] == "ClusterRole"


def test_no_wildcards_no_secrets() -> None:
    for values in (None, ALL_ON):
        objs = render(values)
        roles = [o for o in objs if o["kind"] in ("Role", "ClusterRole")]
        assert len(roles) == 2  # the main one and the nodes reader
        for rule in (r for role in roles for r in role["rules"]):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], rule
            assert "secrets" not in rule["resources"]
            assert set(rule["verbs"]) <= set(permissions.VERB_ORDER), rule
            assert "nonResourceURLs" not in rule and "resourceNames" not in rule


def test_table_has_one_rule_per_resource() -> None:
    keys = [(r.api_group, r.resource) for r in permissions.RULES +
            permissions.CLUSTER_WIDE_RULES + permissions.NODE_RULES]
    assert len(keys) == len(set(keys))
    for r in permissions.RULES:
        assert r.why and r.verbs == tuple(sorted(r.verbs, key=permissions.VERB_ORDER.index))


# -- the table is what the code uses --------------------------------------------------------
def kopf_needs(clusterwide: bool) -> set[Triple]:
    """kopf: list + watch every resource it has handlers for, patch the ones whose
    daemons or change handlers need a finalizer or progress annotations, create Events
    when handlers post them; with scanning on, list + watch CRDs (and namespaces when not
    cluster-wide)."""
    registry = kopf.get_default_registry()
    out: set[Triple] = set()
    spawning = list(registry._spawning.get_all_handlers())
    changing = list(registry._changing.get_all_handlers())
    every: list[Any] = [*registry._watching.get_all_handlers(), *spawning, *changing,
                        *registry._indexing.get_all_handlers()]
    for handler in every:
        sel = handler.selector
        assert sel is not None and sel.any_name, handler
        out |= {(sel.group or "", sel.any_name, "list"), (sel.group or "", sel.any_name, "watch")}
    for handler in [*spawning, *changing]:
        sel = handler.selector
        assert sel is not None and isinstance(sel.any_name, str)
        out.add((sel.group or "", sel.any_name, "patch"))
    if "kopf.event(" in inspect.getsource(handlers):
        out.add(("", "events", "create"))
    settings = kopf.OperatorSettings()
    settings.peering.clusterwide = clusterwide
    handlers.configure_kopf(settings, OperatorSettings())
    if not settings.scanning.disabled:  # kopf's resource and namespace observers
        out |= {("apiextensions.k8s.io", "customresourcedefinitions", v)
                for v in ("list", "watch")}
        if not clusterwide:
            out |= {("", "namespaces", v) for v in ("list", "watch")}
    return out


def _cluster(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            "metadata": {"name": name, "namespace": NS, "uid": "uid-cluster", "generation": 1},
            "spec": spec}


def reconciler_needs() -> set[Triple]:
    """Run the reconciler through every kind of write against the recording fake."""
    kube = RecordingKube()
    # the chart tells the operator the gateway's pods: each cluster gets a NetworkPolicy
    rec = Reconciler(kube, None, OperatorSettings(gateway_pod_labels={"app": "gateway"}))
    _, spec_model = example("simulated")
    spec = spec_model.model_dump(by_alias=True, mode="json", exclude_none=True)
    events: list[tuple[str, str, str]] = []

    def emit(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    async def step(s: dict[str, Any]) -> None:
        body = kube.put(crd.GROUP, crd.PLURAL, _cluster("llama", s))
        await rec.reconcile(copy.deepcopy(body), emit)

    async def scenario() -> None:
        await step(spec)  # children created; engines wait for the store master
        changed = replaced(spec, "store.master.rpcPort", 50061)
        changed = replaced(changed, "store.segmentSize", "32Mi")
        changed = replaced(changed, "gateway.defaultMaxTokens", 17)
        changed = replaced(changed, "networkPolicy.allowedNamespaces", ["monitoring"])
        await step(changed)  # every child patched (its hash changed)
        no_store = replaced(replaced(changed, "store.enabled", False), "gateway.enabled", False)
        no_store = replaced(no_store, "networkPolicy.enabled", False)
        await step(no_store)  # children deleted, engine pods created
        for pod in kube.all("", "pods", NS).values():
            pod["status"] = {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}]}
        smaller = replaced(no_store, "prefill.replicas", 1)
        await step(smaller)  # a ready pod drained (annotation patch)
        await step(smaller)  # and deleted
        kube.put("", "nodes", {"metadata": {"name": "gpu-1", "labels": {"rack": "r1"}}})
        for pod in kube.all("", "pods", NS).values():
            pod["spec"]["nodeName"] = "gpu-1"
        placed = replaced(smaller, "topology", {"levels": [
            {"nodeLabel": "rack", "gbitsPerSecond": 200}]})
        await step(placed)  # the node read, its labels written on the pods

    asyncio.run(scenario())
    kinds = {k for k, v in kube.objects.items() if v}
    assert ("", "pods", NS) in kinds and ("apps", "deployments", NS) not in kinds
    assert any(r == "DrainingPod" for _, r, _ in events), events
    assert any(r == "DeletedPods" for _, r, _ in events), events
    assert all(c.ANNOTATION_TOPOLOGY in p["metadata"]["annotations"]
               for p in kube.all("", "pods", NS).values())
    return kube.used


def gateway_needs() -> set[Triple]:
    """The gateway's watches, namespaced and cluster-wide, read off the requests a fake
    API server receives."""
    used: set[Triple] = set()
    with fake_kube() as k:
        async def run() -> None:
            sources: list[Any] = [
                ConfigMapWatch(KubernetesModels(namespace=NS), k.client()),
                ConfigMapWatch(KubernetesModels(namespace=None), k.client()),
                KubernetesPodSource(KubernetesSource(
                    namespace=NS, prefill_selector=f"{c.LABEL_ROLE}=prefill",
                    decode_selector=f"{c.LABEL_ROLE}=decode"), k.client()),
            ]
            for s in sources:
                await s.start(lambda *a: None)
            for _ in range(500):
                if k.watchers() >= 4:
                    break
                await asyncio.sleep(0.01)
            for s in sources:
                await s.stop()

        asyncio.run(run())
        requests = list(k.requests)
    for request in requests:
        path, _, query = request.partition("?")
        verb = "watch" if "watch=true" in query else "list"
        used.add(("", path.rsplit("/", 1)[-1], verb))
    return used


def leader_needs() -> set[Triple]:
    """An election round by round: create the Lease, renew it, release it."""
    from mooncake_operator.leader import LeaderElector

    kube = RecordingKube()
    clock = [0.0]
    elector = LeaderElector(kube, NS, "mooncake-operator", "replica-a", lease_s=15,
                            renew_deadline_s=10, retry_s=2, clock=lambda: clock[0])

    async def rounds() -> None:
        assert await elector.try_acquire_or_renew()  # created
        clock[0] += 2
        assert await elector.try_acquire_or_renew()  # renewed
        await elector.release()

    asyncio.run(rounds())
    return kube.used


def test_namespaced_mode_needs_exactly_the_table() -> None:
    derived = (kopf_needs(clusterwide=False) | reconciler_needs() | gateway_needs()
               | leader_needs())
    table = permissions.triples(permissions.RULES + permissions.NODE_RULES)
    assert derived - table == set(), f"the code needs more: {sorted(derived - table)}"
    assert table - derived == set(), f"granted but unused: {sorted(table - derived)}"


def test_cluster_wide_mode_adds_only_crd_scanning() -> None:
    extra = kopf_needs(clusterwide=True) - kopf_needs(clusterwide=False)
    assert extra == permissions.triples(permissions.CLUSTER_WIDE_RULES)


def test_namespaced_kopf_needs_nothing_cluster_scoped() -> None:
    """kopf with `-n NS` neither lists namespaces nor watches CRDs (scanning off)."""
    needs = kopf_needs(clusterwide=False)
    assert not {t for t in needs if t[1] in ("namespaces", "customresourcedefinitions")}


@pytest.mark.parametrize("clusterwide", [False, True])
def test_configure_kopf_scanning(clusterwide: bool) -> None:
    settings = kopf.OperatorSettings()
    settings.peering.clusterwide = clusterwide
    handlers.configure_kopf(settings, OperatorSettings())
    assert settings.scanning.disabled is (not clusterwide)
    assert settings.persistence.finalizer == OperatorSettings().finalizer
