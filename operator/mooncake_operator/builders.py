"""Manifests of a MooncakeCluster's children, as plain dicts (pure: spec in, objects out).

Every child carries the cluster's labels and a controller owner reference, so deleting the
MooncakeCluster deletes them (Kubernetes' garbage collector). Engine pods are made one by
one (deterministic names, like KubeRay: the operator chooses which pod leaves on a scale
down or a rollout); the store master is a Deployment of one behind a Service; the store
nodes are a DaemonSet on the GPU nodes. No pod IP is written into another pod's spec:
pods reach the store through its Service.

The *revision* is a hash over both pools' pod templates (not their replica counts), so
whatever changes what an engine runs — image, arguments, model, resources, placement —
changes it, and the rollout replaces both pools in step.

Every pod meets the Pod Security Standard ``restricted`` (see :mod:`.engines`; RDMA is the
one exception) and mounts no ServiceAccount token unless the spec names an account: no
generated pod calls the Kubernetes API.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml
from mooncake_contract import conventions as c

from . import engines, names, netpol
from .names import ClusterRef
from .settings import OperatorSettings
from .spec import EngineKind, MooncakeClusterSpec, Toleration

JsonDict = dict[str, Any]
#: Annotation on non-pod children: hash of the desired manifest, to patch only on change.
SPEC_HASH_ANNOTATION = f"{c.DOMAIN}/spec-hash"
#: Annotation on engine pods: hash of the Mooncake settings file they mount.
STORE_CONFIG_ANNOTATION = f"{c.DOMAIN}/store-config-hash"
POOL_ROLES = (c.ROLE_PREFILL, c.ROLE_DECODE)
TERMINATION_GRACE_S = 30
STORE_READINESS_PERIOD_S = 2
#: Default soft spread of each pool over nodes (ScheduleAnyway: never blocks scheduling).
DEFAULT_SPREAD_KEY = "kubernetes.io/hostname"
#: seconds in a microsecond (the spec's link latencies)
US = 1e-6


#: Hash alphabet: Kubernetes' own (no vowels, no 0/1/3), so a hash never spells a word.
HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
#: Letters only, for a hash's first character: no hash reads as a number in any YAML.
_HASH_LEAD = "".join(ch for ch in HASH_ALPHABET if ch.isalpha())


def digest(obj: Any, chars: int = 16) -> str:
    """A ``chars``-long hash of ``obj``, safe to write unquoted in YAML.

    Hex would not be: a value such as ``1234e56789`` is a string to PyYAML but a float to
    Go's YAML reader, so ``kubectl apply`` of a dumped manifest failed on the label
    (``cannot unmarshal number ... of type string``), about once in 140 hashes.
    """
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    n = int.from_bytes(hashlib.sha256(data.encode()).digest(), "big")
    n, lead = divmod(n, len(_HASH_LEAD))
    out = [_HASH_LEAD[lead]]
    for _ in range(chars - 1):
        n, i = divmod(n, len(HASH_ALPHABET))
        out.append(HASH_ALPHABET[i])
    return "".join(out)


def _meta(ref: ClusterRef, name: str, role: str, extra_labels: dict[str, str] | None = None,
          annotations: dict[str, str] | None = None) -> JsonDict:
    meta: JsonDict = {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**(extra_labels or {}), **names.labels(ref.name, role)},
        "ownerReferences": [names.owner_reference(ref)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _gpu_toleration(settings: OperatorSettings) -> JsonDict:
    return {"key": settings.gpu_taint_key, "operator": "Exists", "effect": "NoSchedule"}


def _tolerations(extra: list[Toleration], settings: OperatorSettings) -> list[JsonDict]:
    out = [_gpu_toleration(settings)]
    out += [t.model_dump(by_alias=True, exclude_none=True) for t in extra]
    return out


def store_address(ref: ClusterRef, spec: MooncakeClusterSpec) -> engines.StoreAddress | None:
    if not spec.store.enabled:
        return None
    return engines.StoreAddress(names.store_service(ref.name), ref.namespace,
                                spec.store.master.rpc_port)


def store_configmap_name(ref: ClusterRef, spec: MooncakeClusterSpec) -> str | None:
    """The cluster's ConfigMap of Mooncake settings, where its engines read them from a
    file (vLLM with a store); None otherwise."""
    data = engines.store_config_data(spec, store_address(ref, spec))
    return None if data is None else names.store_configmap(ref.name)


def pod_template(ref: ClusterRef, spec: MooncakeClusterSpec, settings: OperatorSettings,
                 role: str) -> JsonDict:
    """An engine pod of ``role`` without its name and revision."""
    pool = spec.pool(role)
    p = spec.engine.ports
    annotations = {
        **pool.pod_overrides.annotations,
        c.ANNOTATION_HTTP_PORT: str(p.http),
        c.ANNOTATION_KV_EVENTS_PORT: str(p.kv_events),
        c.ANNOTATION_KV_REPLAY_PORT: str(p.kv_replay),
    }
    store_data = engines.store_config_data(spec, store_address(ref, spec))
    if store_data is not None:  # a change of the file rolls the pods that read it
        annotations[STORE_CONFIG_ANNOTATION] = digest(store_data)
    pod_spec: JsonDict = {
        "containers": engines.engine_containers(spec, role, settings,
                                                store_address(ref, spec)),
        "volumes": [{"name": engines.PODINFO_VOLUME, "downwardAPI": {"items": [
            {"path": engines.ANNOTATIONS_FILE,
             "fieldRef": {"fieldPath": "metadata.annotations"}},
            {"path": engines.LABELS_FILE, "fieldRef": {"fieldPath": "metadata.labels"}},
        ]}}, *engines.engine_volumes(spec, store_configmap_name(ref, spec))],
        "securityContext": engines.pod_security_context(),
        "automountServiceAccountToken": bool(pool.pod_overrides.service_account_name),
        "tolerations": _tolerations(pool.tolerations, settings),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": True,
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.affinity:
        pod_spec["affinity"] = copy.deepcopy(pool.affinity)
    spread = [copy.deepcopy(t) for t in pool.topology_spread_constraints] or [{
        "maxSkew": 1, "topologyKey": DEFAULT_SPREAD_KEY,
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": names.selector(ref.name, role)},
    }]
    pod_spec["topologySpreadConstraints"] = spread
    if pool.priority_class_name:
        pod_spec["priorityClassName"] = pool.priority_class_name
    if pool.pod_overrides.service_account_name:
        pod_spec["serviceAccountName"] = pool.pod_overrides.service_account_name
    if pool.pod_overrides.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n}
                                        for n in pool.pod_overrides.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "namespace": ref.namespace,
            "labels": {**pool.pod_overrides.labels, **names.labels(ref.name, role)},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


def revision(ref: ClusterRef, spec: MooncakeClusterSpec, settings: OperatorSettings) -> str:
    """Hash of both pools' pod templates: what the engines run, not how many there are."""
    templates = {role: pod_template(ref, spec, settings, role) for role in POOL_ROLES}
    return digest(templates, names.REVISION_CHARS)


def engine_pod(ref: ClusterRef, spec: MooncakeClusterSpec, settings: OperatorSettings,
               role: str, rev: str, ordinal: int) -> JsonDict:
    """The engine pod ``ordinal`` of ``role`` at revision ``rev``."""
    pod = pod_template(ref, spec, settings, role)
    meta = pod["metadata"]
    meta["name"] = names.pod_name(ref.name, role, rev, ordinal)
    meta["labels"][c.LABEL_REVISION] = rev
    meta["ownerReferences"] = [names.owner_reference(ref)]
    return pod


# -- store ------------------------------------------------------------------------------------
def store_service(ref: ClusterRef, spec: MooncakeClusterSpec) -> JsonDict:
    m = spec.store.master
    return _stamp({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, names.store_service(ref.name), c.ROLE_STORE_MASTER),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector(ref.name, c.ROLE_STORE_MASTER),
            "ports": [
                {"name": "rpc", "port": m.rpc_port, "targetPort": "rpc", "protocol": "TCP"},
                {"name": "metrics", "port": m.metrics_port, "targetPort": "metrics",
                 "protocol": "TCP"},
            ],
        },
    })


def store_master_deployment(ref: ClusterRef, spec: MooncakeClusterSpec,
                            settings: OperatorSettings) -> JsonDict:
    m = spec.store.master
    labels = names.labels(ref.name, c.ROLE_STORE_MASTER)
    container: JsonDict = {
        "name": "master",
        "image": spec.store.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["mooncake_master"],
        "args": [
            "--rpc_address=$(POD_IP)", f"--rpc_port={m.rpc_port}",
            "--metrics_host=$(POD_IP)", f"--metrics_port={m.metrics_port}",
            f"--default_kv_lease_ttl={m.lease_ttl_ms}",
            "--logtostderr=true",
        ],
        "env": [engines.pod_ip_env()],
        "ports": [{"name": "rpc", "containerPort": m.rpc_port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": m.metrics_port, "protocol": "TCP"}],
        "volumeMounts": [engines.tmp_mount()],
        "securityContext": engines.security_context(),
        "readinessProbe": {"tcpSocket": {"port": "rpc"},
                           "periodSeconds": STORE_READINESS_PERIOD_S},
    }
    res = m.resources.model_dump(by_alias=True, exclude_defaults=True)
    if res:
        container["resources"] = res
    return _stamp({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ref, names.store_master(ref.name), c.ROLE_STORE_MASTER),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": names.selector(ref.name, c.ROLE_STORE_MASTER)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container],
                         "volumes": [engines.tmp_volume()],
                         "securityContext": engines.pod_security_context(),
                         "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": TERMINATION_GRACE_S},
            },
        },
    })


def store_daemonset(ref: ClusterRef, spec: MooncakeClusterSpec,
                    settings: OperatorSettings) -> JsonDict:
    st = spec.store
    addr = store_address(ref, spec)
    assert addr is not None
    memory = st.memory_limit
    container: JsonDict = {
        "name": "store-node",
        "image": st.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": ["store-node", "--host", "$(POD_IP)", "--port", str(st.client_port),
                 "--master", addr.rpc, "--metadata", engines.P2P_METADATA,
                 "--segment-bytes", str(engines.store_segment_bytes(spec)),
                 "--buffer-bytes", str(settings.store_buffer_bytes),
                 "--protocol", st.protocol.value],
        "env": [engines.pod_ip_env()],
        "ports": [{"name": "http", "containerPort": st.client_port, "protocol": "TCP"}],
        "volumeMounts": [engines.tmp_mount()],
        "securityContext": engines.security_context(engines.rdma_capabilities(spec)),
        "resources": {"requests": {"memory": memory}, "limits": {"memory": memory}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": STORE_READINESS_PERIOD_S},
    }
    labels = names.labels(ref.name, c.ROLE_STORE_NODE)
    pod_spec: JsonDict = {
        "containers": [container],
        "volumes": [engines.tmp_volume()],
        "securityContext": engines.pod_security_context(),
        "automountServiceAccountToken": False,
        "tolerations": _tolerations(st.tolerations, settings),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    if st.node_selector:
        pod_spec["nodeSelector"] = dict(st.node_selector)
    return _stamp({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(ref, names.store_nodes(ref.name), c.ROLE_STORE_NODE),
        "spec": {
            "selector": {"matchLabels": names.selector(ref.name, c.ROLE_STORE_NODE)},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    })


# -- the gateway's view -------------------------------------------------------------------------
def gateway_model(ref: ClusterRef, spec: MooncakeClusterSpec) -> JsonDict:
    """The gateway's model document for this cluster (the gateway's ``ModelSettings``)."""
    cond = spec.conductor
    hp = cond.hot_prefixes
    p = spec.engine.ports
    conductor: JsonDict = {
        "policy": cond.policy,
        "params": copy.deepcopy(cond.params),
        "slo": {"ttft_s": cond.slo.ttft_seconds, "tbt_s": cond.slo.tbt_seconds},
        "replication": {
            "enabled": hp.enabled, "interval_s": hp.interval_seconds,
            "half_life_s": hp.half_life_seconds, "min_rate_per_s": hp.min_rate_per_second,
            "min_blocks": hp.min_blocks, "load_ratio": hp.load_ratio,
            "load_floor_s": hp.load_floor_seconds, "max_replicas": hp.max_replicas,
        },
    }
    if cond.decode_selector is not None:
        conductor["decode_selector"] = cond.decode_selector
    if cond.admission is not None:
        conductor["admission"] = cond.admission
    conductor["decode_calibration"] = {"enabled": cond.decode_calibration}
    if cond.ttft_miss_risk is not None:
        conductor["admission_rule"] = {"ttft_miss_risk": cond.ttft_miss_risk}
    if cond.shedding is not None:
        conductor["shedding"] = {"enabled": cond.shedding}
    if cond.holding is not None:
        conductor["holding"] = {"enabled": cond.holding}
    if cond.overrun is not None:
        conductor["overrun"] = {"enabled": cond.overrun}
    if spec.topology.levels:
        conductor["topology"] = {
            "aware": spec.topology.aware,
            "levels": [{"name": lv.node_label, "gbits_per_s": lv.gbits_per_second,
                        "latency_s": lv.latency_microseconds * US}
                       for lv in spec.topology.levels],
        }
    return {
        "name": spec.model.served,
        "block_size": spec.model.block_size,
        "cache_salt": spec.model.cache_salt,
        "max_model_len": spec.model.max_model_len,
        "default_max_tokens": spec.gateway.default_max_tokens,
        "direct": {"uncached_tokens_below": spec.gateway.direct_below_tokens},
        # how the prefill's KV reaches the decode engine: the engine release's connector
        "handshake": engines.handshake(spec).value,
        "bootstrap_port": engines.bootstrap_port(spec),
        # the Conductor's clock runs at the engines' pace (real engines: real time)
        "time_scale": (spec.engine.simulated.time_scale
                       if spec.engine.kind is EngineKind.SIMULATED else 1.0),
        "conductor": conductor,
        "kubernetes": {
            "namespace": ref.namespace,
            "prefill_selector": names.selector_string(ref.name, c.ROLE_PREFILL),
            "decode_selector": names.selector_string(ref.name, c.ROLE_DECODE),
            "http_port": p.http, "kv_events_port": p.kv_events, "kv_replay_port": p.kv_replay,
        },
    }


def gateway_configmap(ref: ClusterRef, spec: MooncakeClusterSpec) -> JsonDict:
    meta = _meta(ref, names.gateway_configmap(ref.name), "gateway",
                 extra_labels={c.LABEL_GATEWAY_MODEL: "true"})
    meta["labels"][c.LABEL_GATEWAY_MODEL] = "true"
    doc = yaml.safe_dump(gateway_model(ref, spec), sort_keys=False)
    return _stamp({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                   "data": {c.GATEWAY_MODEL_KEY: doc}})


def store_configmap(ref: ClusterRef, spec: MooncakeClusterSpec) -> JsonDict | None:
    """Mooncake's client settings as the file the engines read (vLLM with a store)."""
    data = engines.store_config_data(spec, store_address(ref, spec))
    if data is None:
        return None
    return _stamp({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": _meta(ref, names.store_configmap(ref.name), c.ROLE_STORE_MASTER),
                   "data": data})


def _stamp(obj: JsonDict) -> JsonDict:
    """Record the manifest's hash on it: a later reconcile patches only when it changed."""
    body = {k: v for k, v in obj.items() if k != "metadata"}
    body["labels"] = obj["metadata"].get("labels", {})
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = digest(body)
    return obj


def children(ref: ClusterRef, spec: MooncakeClusterSpec,
             settings: OperatorSettings) -> list[JsonDict]:
    """Every non-pod child the cluster should have, in creation order (the store's Service
    first: pods read its environment variables when they start)."""
    out: list[JsonDict] = []
    if spec.store.enabled:
        out += [store_service(ref, spec), store_master_deployment(ref, spec, settings),
                store_daemonset(ref, spec, settings)]
        config = store_configmap(ref, spec)
        if config is not None:  # before the pods that mount it
            out.append(config)
    if spec.gateway.enabled:
        out.append(gateway_configmap(ref, spec))
    policy = netpol.network_policy(ref, spec, settings)
    if policy is not None:
        out.append(_stamp(policy))
    return out
