"""Pure builders: fake GPU Node objects, kubeconfig, kwok stage configuration."""

from __future__ import annotations

import base64
import json
from typing import Any

from mooncake_localcluster.settings import LocalClusterSettings

POOLS = ("prefill", "decode")
SYSTEM_POOL = "system"
GPU_TAINT_VALUE = "present"
KUBECONFIG_CONTEXT = "mooncake-local"

JsonDict = dict[str, Any]


def node_names(settings: LocalClusterSettings) -> list[tuple[str, str]]:
    """(node name, pool) in creation order: prefill GPU nodes, decode GPU nodes, CPU nodes."""
    counts = {"prefill": settings.prefill_nodes, "decode": settings.decode_nodes}
    names = [(f"gpu-{pool}-{i}", pool) for pool in POOLS for i in range(counts[pool])]
    return names + [(f"cpu-{i}", SYSTEM_POOL) for i in range(settings.cpu_nodes)]


def pod_cidr(settings: LocalClusterSettings, index: int) -> str:
    """Loopback /24 per node: node 0 -> 127.1.1.0/24 (slot 0), so pod IPs are bindable locally."""
    return f"{settings.pod_prefix()}.{index + 1}.0/24"


def fake_node(settings: LocalClusterSettings, name: str, pool: str, index: int) -> JsonDict:
    """A fake node; GPU pools get GPUs, GPU labels and the GPU taint, the system pool not."""
    node = settings.node
    gpu = pool != SYSTEM_POOL
    resources = {
        "cpu": node.cpu,
        "memory": node.memory,
        "pods": str(node.pods),
        "ephemeral-storage": node.ephemeral_storage,
    }
    if gpu:
        resources[settings.gpu_resource] = str(node.gpus)
    labels = {
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "kubernetes.io/hostname": name,
        "kubernetes.io/role": "agent",
        "type": "kwok",
        "node.kubernetes.io/instance-type": node.instance_type if gpu else node.cpu_instance_type,
        settings.pool_label: pool,
    }
    taints = []
    if gpu:
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.count"] = str(node.gpus)
        labels["nvidia.com/gpu.product"] = node.gpu_product
        taints.append(
            {"key": settings.gpu_resource, "value": GPU_TAINT_VALUE, "effect": "NoSchedule"}
        )
    cidr = pod_cidr(settings, index)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                settings.kwok_node_annotation: settings.kwok_node_annotation_value,
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": labels,
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr], "taints": taints},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
                "containerRuntimeVersion": "kwok",
                "osImage": "kwok",
                "kernelVersion": "kwok",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def all_nodes(settings: LocalClusterSettings) -> list[JsonDict]:
    return [
        fake_node(settings, name, pool, index)
        for index, (name, pool) in enumerate(node_names(settings))
    ]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(server: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> JsonDict:
    """A self-contained kubeconfig (certs inlined) for kubectl and the Python client."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": KUBECONFIG_CONTEXT,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": KUBECONFIG_CONTEXT,
                "user": {
                    "client-certificate-data": _b64(cert_pem),
                    "client-key-data": _b64(key_pem),
                },
            }
        ],
        "contexts": [
            {
                "name": KUBECONFIG_CONTEXT,
                "context": {"cluster": KUBECONFIG_CONTEXT, "user": KUBECONFIG_CONTEXT},
            }
        ],
        "current-context": KUBECONFIG_CONTEXT,
        "preferences": {},
    }


def runnable_jq(settings: LocalClusterSettings) -> str:
    """A jq expression kwok evaluates to "true" for pods the pod runner runs itself."""
    label = json.dumps(settings.runnable_label)
    image_tests = " or ".join(
        f"contains({json.dumps(s)})" for s in settings.runnable_image_substrings
    )
    images = f"([.spec.containers[].image | select({image_tests or 'false'})] | length > 0)"
    return f'((.metadata.labels[{label}] // "") == "true") or {images}'


_NODE_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
      addresses:
      - address: {{ NodeIP | Quote }}
        type: InternalIP
      - address: {{ .metadata.name | Quote }}
        type: Hostname
      phase: Running
"""

#: Keeps Ready nodes' heartbeats fresh (the node lifecycle controller marks a node NotReady,
#: and its pods with it, once lastHeartbeatTime is older than its grace period). Re-applied
#: every NODE_HEARTBEAT_S (+ jitter) while the node stays Ready; transition times are kept.
_NODE_HEARTBEAT_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values: ['True']
  delay:
    durationMilliseconds: {delay_ms}
    jitterDurationMilliseconds: {jitter_ms}
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      {{{{ range .status.conditions }}}}
      - lastHeartbeatTime: {{{{ $now | Quote }}}}
        lastTransitionTime: {{{{ .lastTransitionTime | Quote }}}}
        message: {{{{ .message | Quote }}}}
        reason: {{{{ .reason | Quote }}}}
        status: {{{{ .status | Quote }}}}
        type: {{{{ .type | Quote }}}}
      {{{{ end }}}}
"""
NODE_HEARTBEAT_S = 10
NODE_HEARTBEAT_JITTER_S = 5

_POD_READY_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: {name}
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending']
    - key: '.status.podIP'
      operator: 'DoesNotExist'
    - key: '{runnable}'
      operator: 'In'
      values: ['{is_runnable}']
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready_title}"
        type: Ready
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready_title}"
        type: ContainersReady
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: {ready}
        restartCount: 0
        started: {started}
        state:
          {state}
      {{{{ end }}}}
      {{{{ with NodeIPsWith .spec.nodeName }}}}
      hostIP: {{{{ index . 0 | Quote }}}}
      {{{{ end }}}}
      {{{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) {pod_id_args} }}}}
      {{{{ with $podIPs }}}}
      podIP: {{{{ index . 0 | Quote }}}}
      podIPs:
      {{{{ range . }}}}
      - ip: {{{{ . | Quote }}}}
      {{{{ end }}}}
      {{{{ end }}}}
      phase: Running
      startTime: {{{{ $now | Quote }}}}
"""

_POD_COMPLETE_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.metadata.ownerReferences.[].kind'
      operator: 'In'
      values: ['Job']
    - key: '{runnable}'
      operator: 'In'
      values: ['false']
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        type: Ready
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            finishedAt: {{{{ $now | Quote }}}}
            reason: Completed
            startedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      phase: Succeeded
"""

_POD_DELETE_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '{runnable}'
      operator: 'In'
      values: ['false']
  next:
    delete: true
"""


#: kwok's own options. kwok v0.8.0 makes each podCIDR's address pool on first use with a
#: load-then-store (``PodController.ipPool``), so two Stage workers giving the first
#: addresses at once (a cold start re-addresses every pod) can make two pools and hand
#: one IP to two pods. One pod Stage worker removes the race; a Stage is one API patch.
#: kwok applies no defaults to a configuration read from a file, so the other options
#: are written out at kwok's defaults (``SetObjectDefaults_KwokConfiguration``).
_KWOK_CONFIGURATION = """\
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  cidr: 10.0.0.0/24
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: true
  podPlayStageParallelism: 1
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
"""


_POD_ID_ARGS = '( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" )'


def kwok_stages(settings: LocalClusterSettings) -> str:
    """kwok's Stage config: fake-run other pods, and delete them when asked; only assign
    IPs to the pods we run ourselves (the pod runner removes those once their processes
    have stopped, as a kubelet does)."""
    runnable = runnable_jq(settings).replace("'", "''")
    fake_ready = _POD_READY_STAGE.format(
        name="pod-ready",
        pod_id_args=_POD_ID_ARGS,
        runnable=runnable,
        is_runnable="false",
        ready="true",
        ready_title="True",
        started="true",
        state="running:\n            startedAt: {{ $now | Quote }}",
    )
    runner_start = _POD_READY_STAGE.format(
        name="pod-ip-for-runner",
        pod_id_args=_POD_ID_ARGS,
        runnable=runnable,
        is_runnable="true",
        ready="false",
        ready_title="False",
        started="false",
        state="waiting:\n            reason: ContainerCreating",
    )
    docs = [
        _NODE_STAGE,
        _NODE_HEARTBEAT_STAGE.format(delay_ms=NODE_HEARTBEAT_S * 1000,
                                     jitter_ms=(NODE_HEARTBEAT_S + NODE_HEARTBEAT_JITTER_S)
                                     * 1000),
        fake_ready,
        runner_start,
        _POD_COMPLETE_STAGE.format(runnable=runnable),
        _POD_DELETE_STAGE.format(runnable=runnable),
    ]
    return "---\n".join(docs)


def kwok_config(settings: LocalClusterSettings) -> str:
    """kwok's ``--config`` file: its options, then the Stages (:func:`kwok_stages`)."""
    return _KWOK_CONFIGURATION + "---\n" + kwok_stages(settings)
