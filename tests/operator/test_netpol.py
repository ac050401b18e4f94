"""Each cluster's NetworkPolicy (``mooncake_operator/netpol.py``): who may reach its pods,
judged with Kubernetes' selector semantics against the pods the operator and the chart
really make; off without the gateway's labels or when the spec says so."""

from __future__ import annotations

from typing import Any

from mooncake_contract import conventions as c
from mooncake_operator import builders, netpol

from .manifests import SETTINGS, example, with_updates

GATEWAY_LABELS = {"app.kubernetes.io/name": "mooncake-operator",
                  "app.kubernetes.io/instance": "mc", "app.kubernetes.io/component": "operator"}
LOCKED = SETTINGS.model_copy(update={"gateway_namespace": "mooncake-system",
                                     "gateway_pod_labels": GATEWAY_LABELS})


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """``matchLabels`` semantics (the only form netpol.py writes)."""
    assert set(selector) <= {"matchLabels"}
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def _admits(policy: dict[str, Any], ns: str, labels: dict[str, str]) -> bool:
    """Whether a pod in ``ns`` with ``labels`` may reach the policy's pods (Kubernetes'
    rule: a peer with both selectors needs both; a podSelector alone means the policy's
    own namespace)."""
    own_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        assert "ports" not in rule  # every port: the peers below are trusted whole
        for peer in rule["from"]:
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            ns_ok = (_selects(ns_sel, {netpol.NAMESPACE_NAME_LABEL: ns}) if ns_sel
                     is not None else ns == own_ns)
            if ns_ok and (pod_sel is None or _selects(pod_sel, labels)):
                return True
    return False


def _policy(settings: Any = LOCKED, **updates: Any) -> dict[str, Any] | None:
    ref, spec = example("simulated")
    if updates:
        spec = with_updates(spec, **updates)
    kids = [o for o in builders.children(ref, spec, settings) if o["kind"] == "NetworkPolicy"]
    assert len(kids) <= 1
    return kids[0] if kids else None


def test_peers_and_the_gateway_get_in_and_nothing_else_does() -> None:
    ref, spec = example("simulated")
    policy = _policy()
    assert policy is not None
    assert policy["metadata"]["name"] == netpol.policy_name(ref)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == ref.uid
    assert builders.SPEC_HASH_ANNOTATION in policy["metadata"]["annotations"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open
    # it covers every pod the operator makes for this cluster: engines and the store
    pods = [builders.engine_pod(ref, spec, LOCKED, role, "rev", 0)
            for role in ("prefill", "decode")]
    stores = [o["spec"]["template"] for o in builders.children(ref, spec, LOCKED)
              if o["kind"] in ("Deployment", "DaemonSet")]
    assert stores, "the example has a store"
    for pod in pods + stores:
        labels = pod["metadata"]["labels"]
        assert _selects(policy["spec"]["podSelector"], labels)
        assert _admits(policy, ref.namespace, labels)  # a peer of the same cluster
        assert not _admits(policy, "elsewhere", labels)  # same labels, other namespace
    assert _admits(policy, "mooncake-system", {**GATEWAY_LABELS, "pod-template-hash": "x"})
    strangers = [
        (ref.namespace, {}),  # any pod beside the engines
        (ref.namespace, {c.LABEL_CLUSTER: "other"}),  # another cluster's engines
        ("mooncake-system", {"app.kubernetes.io/name": "mooncake-operator"}),  # half a match
        (ref.namespace, GATEWAY_LABELS),  # the gateway's labels in the wrong namespace
    ]
    for ns, labels in strangers:
        assert not _admits(policy, ns, labels), (ns, labels)


def test_allowed_namespaces_reach_every_port() -> None:
    policy = _policy(networkPolicy__allowedNamespaces=["monitoring"])
    assert policy is not None
    assert _admits(policy, "monitoring", {"app": "prometheus"})
    assert not _admits(policy, "default", {"app": "prometheus"})


def test_no_policy_when_turned_off_or_the_gateway_is_unknown() -> None:
    assert _policy(networkPolicy__enabled=False) is None
    assert _policy(SETTINGS) is None  # it would cut the gateway off
    # the gateway's namespace defaults to the cluster's own
    same = _policy(LOCKED.model_copy(update={"gateway_namespace": ""}))
    assert same is not None
    assert _admits(same, same["metadata"]["namespace"], GATEWAY_LABELS)


def test_the_chart_tells_the_operator_labels_that_select_its_own_pod(
        monkeypatch: Any) -> None:
    """The chart's operator environment parses into settings whose gateway selector
    matches the chart's own pod: the policy admits the gateway the chart deploys."""
    from mooncake_operator.settings import OperatorSettings

    from ..charts.chartutil import NAMESPACE, find, render

    dep = find(render(None), "Deployment")
    (op,) = [x for x in dep["spec"]["template"]["spec"]["containers"]
             if x["name"] == "operator"]
    for e in op["env"]:
        if e["name"].startswith("MOONCAKE_OPERATOR_") and "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    settings = OperatorSettings()
    assert settings.gateway_namespace == NAMESPACE
    policy = _policy(settings)
    assert policy is not None
    assert _admits(policy, NAMESPACE, dep["spec"]["template"]["metadata"]["labels"])
