"""Every Kubernetes API permission the operator pod needs: the one table the chart's RBAC
follows.

The operator pod runs two processes under one ServiceAccount: the operator (kopf and
:class:`~.kube.Kube`) and the gateway sidecar (``gateway --kubernetes-models``). Each
:class:`Rule` below names who uses it and where. ``tests/charts/test_rbac.py`` renders the
chart and checks its Role (and, in cluster-wide mode, its ClusterRole) equals this table;
it also *derives* the permissions from the code — kopf's handler registry, every request the
reconciler and the Conductor controller make against a recording fake API, and the calls
of the gateway's watches — and checks they equal this table too. So the chart can neither
miss a permission the code needs nor keep one it no longer uses.

What is deliberately absent:

- Secrets: no code reads one through the API. The gateway's API keys arrive as Secret
  volumes (``gateway.auth`` in the chart), which the kubelet mounts, not our service
  account.
- CustomResourceDefinitions, in the default namespaced mode: the CRD comes from the chart's
  ``crds/`` (or ``kubectl apply --server-side -f crds/``); ``operator run --install-crd``
  is for local runs with an admin kubeconfig. kopf finds the CRD through API discovery,
  which every authenticated user may read; in namespaced mode it does not scan
  namespaces or watch CRDs (:func:`~.handlers.configure_kopf` turns scanning off), so
  the operator needs nothing cluster-scoped.
- Namespaces, kopf's peering objects: ``operator run`` is ``--standalone`` (no kopf
  peering); replicas elect a leader on a Lease of their own (``leader.py``).

Nodes are read (``get``, one node at a time, never listed or watched) only for
``spec.topology``: :data:`NODE_RULES`, a small ClusterRole of its own in either mode,
which ``rbac.readNodes: false`` leaves out (a cluster that then asks for a topology
reports ``Forbidden``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import crd

#: RBAC verbs in the order the chart lists them.
VERB_ORDER = ("get", "list", "watch", "create", "patch", "delete")


@dataclass(frozen=True, slots=True)
class Rule:
    """One resource's verbs, and where the code uses each."""

    api_group: str
    resource: str
    verbs: tuple[str, ...]
    why: str

    def triples(self) -> set[tuple[str, str, str]]:
        return {(self.api_group, self.resource, v) for v in self.verbs}


#: Namespaced permissions: a Role in the release namespace (default), or the same rules in
#: a ClusterRole when the operator watches every namespace (``rbac.clusterWide``).
RULES: tuple[Rule, ...] = (
    Rule(crd.GROUP, crd.PLURAL, ("list", "watch", "patch"),
         "kopf lists and watches MooncakeClusters (handlers.cluster_daemon, cluster_changed) "
         "and patches them to add and remove its finalizer (daemons need one)"),
    Rule(crd.GROUP, f"{crd.PLURAL}/status", ("patch",),
         "reconcile.Reconciler._write_status and write_hot_prefixes: status merge patches"),
    Rule("", "pods", ("list", "watch", "create", "patch", "delete"),
         "kopf lists and watches pods into an index (handlers, cache.py), which the "
         "reconcile and runtime.controller_round read; reconcile creates engine pods, "
         "patches the drain annotation and deletes drained pods; the controller patches "
         "mooncake.io/replicas; "
         "the gateway lists and watches each model's pods (discovery.KubernetesPodSource) "
         "and its own replicas' pods (peers.PeerSync)"),
    Rule("", "services", ("get", "list", "watch", "create", "patch", "delete"),
         "kopf lists and watches them into an index (cache.py); "
         "reconcile.Reconciler._apply_children: the store Service (create, patch when its "
         "hash changed, delete when no longer wanted; get when a create finds it exists)"),
    Rule("", "configmaps", ("get", "list", "watch", "create", "patch", "delete"),
         "kopf lists and watches them into an index (cache.py); "
         "reconcile.Reconciler._apply_children: the {cluster}-gateway ConfigMap (create, "
         "patch, delete; get when a create finds it exists); the gateway lists and "
         "watches the labelled ConfigMaps (catalog.ConfigMapWatch)"),
    Rule("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete"),
         "kopf lists and watches them into an index (cache.py); "
         "reconcile.Reconciler._apply_children: the store master Deployment (create, "
         "patch, delete; get when a create finds it exists)"),
    Rule("apps", "daemonsets", ("get", "list", "watch", "create", "patch", "delete"),
         "kopf lists and watches them into an index (cache.py); "
         "reconcile.Reconciler._apply_children: the store-node DaemonSet (create, patch, "
         "delete; get when a create finds it exists)"),
    Rule("networking.k8s.io", "networkpolicies",
         ("get", "list", "watch", "create", "patch", "delete"),
         "kopf lists and watches them into an index (cache.py); "
         "reconcile.Reconciler._apply_children: each cluster's NetworkPolicy (netpol.py; "
         "create, patch when its hash changed, delete when no longer wanted; get when a "
         "create finds it exists)"),
    Rule("coordination.k8s.io", "leases", ("get", "create", "patch"),
         "leader.LeaderElector: read the leader Lease, create it once, renew or take it over "
         "(patches carry its resourceVersion) and release it on shutdown"),
    Rule("", "events", ("create",),
         "kopf posts the Events handlers emit (kopf.event in handlers._emitter)"),
)

#: Cluster-scoped permissions, only in cluster-wide mode: kopf's resource observer watches
#: CRDs so that it notices a CRD installed or upgraded after it started (with scanning on,
#: kopf's default for an operator that serves every namespace).
CLUSTER_WIDE_RULES: tuple[Rule, ...] = (
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"),
         "kopf's resource observer (cluster-wide mode only; off in namespaced mode)"),
)


#: Cluster-scoped, in either mode unless the chart's ``rbac.readNodes`` is false.
NODE_RULES: tuple[Rule, ...] = (
    Rule("", "nodes", ("get",),
         "reconcile.Reconciler._place: the topology labels of the node each new engine pod "
         "runs on (spec.topology), written on the pod for the gateway (placement.py)"),
)


def triples(rules: tuple[Rule, ...]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every verb of every rule."""
    out: set[tuple[str, str, str]] = set()
    for r in rules:
        out |= r.triples()
    return out


def rbac_rules(rules: tuple[Rule, ...]) -> list[dict[str, list[str]]]:
    """The table as a Role's ``rules`` (one entry per resource)."""
    return [{"apiGroups": [r.api_group], "resources": [r.resource],
             "verbs": sorted(r.verbs, key=VERB_ORDER.index)} for r in rules]
