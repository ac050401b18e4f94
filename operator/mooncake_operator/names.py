"""Names and labels of everything the operator makes for a MooncakeCluster (pure).

Deterministic names (no ``generateName``): a retried or restarted reconcile finds what
it made before instead of making it twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mooncake_contract import conventions as c

from . import crd

#: characters of the revision hash in pod names and labels
REVISION_CHARS = 10
APP_NAME = "mooncake"


@dataclass(frozen=True, slots=True)
class ClusterRef:
    """The MooncakeCluster object a set of children belongs to."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_name(cluster: str, role: str, revision: str, ordinal: int) -> str:
    return f"{cluster}-{role}-{revision}-{ordinal}"


_POD_RE = re.compile(r"^(?P<cluster>.+)-(?P<role>prefill|decode)-(?P<rev>[0-9a-z]+)-(?P<i>\d+)$")


def parse_pod_name(name: str) -> tuple[str, str, str, int] | None:
    """``(cluster, role, revision, ordinal)`` of an engine pod name, or None."""
    m = _POD_RE.match(name)
    if m is None:
        return None
    return m["cluster"], m["role"], m["rev"], int(m["i"])


def store_service(cluster: str) -> str:
    return f"{cluster}-store"


def store_master(cluster: str) -> str:
    return f"{cluster}-store-master"


def store_nodes(cluster: str) -> str:
    return f"{cluster}-store-node"


def store_configmap(cluster: str) -> str:
    """Mooncake's client settings as a file, for engines that read them from one."""
    return f"{cluster}-mooncake-config"


def gateway_configmap(cluster: str) -> str:
    return f"{cluster}-gateway"


def service_env_prefix(service: str) -> str:
    """The kubelet's environment-variable prefix of a Service (``a-b`` → ``A_B``)."""
    return service.upper().replace("-", "_")


def labels(cluster: str, role: str) -> dict[str, str]:
    """Labels of every object of ``role`` (no revision: that is the pods' own)."""
    return {
        c.LABEL_APP_NAME: APP_NAME,
        c.LABEL_APP_INSTANCE: cluster,
        c.LABEL_APP_COMPONENT: role,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_CLUSTER: cluster,
        c.LABEL_ROLE: role,
    }


def selector(cluster: str, role: str) -> dict[str, str]:
    """The labels that pick the pods of one role of one cluster."""
    return {c.LABEL_CLUSTER: cluster, c.LABEL_ROLE: role}


def selector_string(cluster: str, role: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(cluster, role).items())


def owner_reference(ref: ClusterRef) -> dict[str, object]:
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
