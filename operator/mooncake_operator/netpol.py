"""The NetworkPolicy of one MooncakeCluster (pure: spec and settings in, object out).

Rule: the cluster's pods (engines, their worker sidecars, the store master and nodes, all
carrying the cluster label) take traffic only from

- each other: KV transfer between prefill and decode, the store, the P/D bootstrap;
- the gateway's pods (``OperatorSettings.gateway_namespace`` and ``gateway_pod_labels``,
  which the chart sets): completions, health and metrics, the KV-event stream and its
  replay;
- pods of ``spec.networkPolicy.allowedNamespaces`` (e.g. Prometheus).

So a completion sent straight to an engine's pod IP, bypassing the gateway's keys and
admission, and a subscription to an engine's KV events from anywhere else, are refused by
any network plugin that enforces NetworkPolicy. Egress is left open: engines download
models and reach the store.

Without the gateway's labels the operator cannot tell its traffic apart, and a policy
would cut the gateway off, so none is made (``None``).
"""

from __future__ import annotations

from typing import Any

from mooncake_contract import conventions as c

from . import names
from .names import ClusterRef
from .settings import OperatorSettings
from .spec import MooncakeClusterSpec

JsonDict = dict[str, Any]
#: the label every namespace carries with its own name (Kubernetes 1.22+)
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: the policy's role label (it selects every role of the cluster)
ROLE = "network"


def policy_name(ref: ClusterRef) -> str:
    return f"{ref.name}-network"


def network_policy(ref: ClusterRef, spec: MooncakeClusterSpec,
                   settings: OperatorSettings) -> JsonDict | None:
    """The cluster's NetworkPolicy, or ``None`` (turned off, or the gateway unknown)."""
    np = spec.network_policy
    if not np.enabled or not settings.gateway_pod_labels:
        return None
    gateway_ns = settings.gateway_namespace or ref.namespace
    peers: list[JsonDict] = [
        {"podSelector": {"matchLabels": {c.LABEL_CLUSTER: ref.name}}},
        {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: gateway_ns}},
         "podSelector": {"matchLabels": dict(sorted(settings.gateway_pod_labels.items()))}},
        *({"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
          for ns in np.allowed_namespaces),
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(ref),
            "namespace": ref.namespace,
            "labels": names.labels(ref.name, ROLE),
            "ownerReferences": [names.owner_reference(ref)],
        },
        "spec": {
            "podSelector": {"matchLabels": {c.LABEL_CLUSTER: ref.name}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers}],
        },
    }
