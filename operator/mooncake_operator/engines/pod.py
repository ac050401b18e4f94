"""What every generated pod shares: Pod Security ``restricted``, volumes, env, probes, ports.

Every pod meets the Pod Security Standard ``restricted`` (``docs/helm.md`` lists each
field): non-root UID 65532, seccomp ``RuntimeDefault``, no privilege escalation, every
capability dropped, a read-only root filesystem with an ``emptyDir`` on ``/tmp`` (numba's
cache, Mooncake's glog files) — except, with ``store.protocol: rdma``, the containers that
register memory with the NIC (real engines, store nodes): they add ``IPC_LOCK``, which no
Pod Security level but ``privileged`` allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import names
from ..settings import OperatorSettings
from ..spec import MooncakeClusterSpec, StoreProtocol, quantity_bytes

JsonDict = dict[str, Any]
#: Where the downward-API annotations file appears inside the mount.
ANNOTATIONS_FILE = "annotations"
LABELS_FILE = "labels"
PODINFO_VOLUME = "podinfo"
#: Metadata-server setting of every Mooncake client: peers handshake directly, so the
#: master needs no HTTP metadata server (PyPI 0.3.13's binds 0.0.0.0 whatever it is told).
P2P_METADATA = "P2PHANDSHAKE"
READINESS_PERIOD_S = 2
READINESS_FAILURES = 3
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 6
LOOPBACK = "127.0.0.1"

# -- Pod Security "restricted" -------------------------------------------------------------------
#: UID and GID every generated pod runs as (the images' non-root user; distroless' nonroot)
NONROOT_ID = 65532
#: A writable /tmp on a read-only root filesystem (numba's cache, Mooncake's glog files)
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
#: A real engine's KV events, on ZeroMQ IPC sockets in the /tmp both of the pod's
#: containers mount: only the worker beside the engine reads them, and no address of the
#: pod's network (not even loopback, which every container of the pod shares) reaches them.
#: Both engines bind IPC endpoints (vLLM and SGLang connect to any concrete TCP address).
ENGINE_KV_EVENTS = f"ipc://{TMP_MOUNT}/mooncake-engine-kv-events"
ENGINE_KV_REPLAY = f"ipc://{TMP_MOUNT}/mooncake-engine-kv-replay"
#: numba's cache of compiled kernels (block keys of long prompts): under the writable /tmp
#: (by default numba writes beside the installed sources, read-only in a container)
NUMBA_CACHE_DIR = f"{TMP_MOUNT}/numba-cache"
#: Real engines: shared memory for NCCL and torch's worker processes (a container's own
#: /dev/shm is 64 MiB) and a writable home for their caches (Hugging Face downloads, torch
#: compile, triton, flashinfer JIT)
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"
HOME_VOLUME = "home"
HOME_MOUNT = "/home/mooncake"
#: torch names its compile cache after ``getpass.getuser()``, which fails for a UID with no
#: passwd entry unless ``USER`` is set
ENGINE_USER = "mooncake"
#: The one capability RDMA transfers need: registering (pinning) memory with the NIC beyond
#: RLIMIT_MEMLOCK. Outside every Pod Security level but privileged.
RDMA_CAPABILITIES = ("IPC_LOCK",)


def pod_security_context() -> JsonDict:
    """The pod-level half of ``restricted``: non-root, seccomp RuntimeDefault."""
    return {"runAsNonRoot": True, "runAsUser": NONROOT_ID, "runAsGroup": NONROOT_ID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def security_context(add_capabilities: tuple[str, ...] = ()) -> JsonDict:
    """The container-level half: no escalation, read-only root, every capability dropped
    (``add_capabilities``: only for RDMA, which leaves ``restricted``)."""
    caps: JsonDict = {"drop": ["ALL"]}
    if add_capabilities:
        caps["add"] = list(add_capabilities)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": caps}


def rdma_capabilities(spec: MooncakeClusterSpec) -> tuple[str, ...]:
    """What a Mooncake transfer client of this cluster adds: ``IPC_LOCK`` over RDMA."""
    return RDMA_CAPABILITIES if spec.store.protocol is StoreProtocol.RDMA else ()


def tmp_volume() -> JsonDict:
    return {"name": TMP_VOLUME, "emptyDir": {}}


def tmp_mount() -> JsonDict:
    return {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def numba_env() -> JsonDict:
    return {"name": "NUMBA_CACHE_DIR", "value": NUMBA_CACHE_DIR}


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """How a pod reaches the cluster's store master: through its Service's environment
    variables (the kubelet sets them for Services that exist when the pod starts; the
    operator creates the Service before any engine pod), or its DNS name where no variable
    is expanded (a configuration file)."""

    service: str
    namespace: str = ""
    port: int = 0
    rpc_port_name: str = "rpc"

    @property
    def env_prefix(self) -> str:
        return names.service_env_prefix(self.service)

    @property
    def rpc(self) -> str:
        p = self.env_prefix
        return f"$({p}_SERVICE_HOST):$({p}_SERVICE_PORT_{self.rpc_port_name.upper()})"

    @property
    def dns(self) -> str:
        return f"{self.service}.{self.namespace}.svc:{self.port}"


def pod_ip_env() -> JsonDict:
    return {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def pod_name_env() -> JsonDict:
    return {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def pool_env(spec: MooncakeClusterSpec, role: str, extra: list[JsonDict] | None = None
             ) -> list[JsonDict]:
    """The engine container's environment: the pod IP, the cluster's hash seed, ``extra``,
    then the pool's own overrides (last, so they win)."""
    pool = spec.pool(role)
    env = [pod_ip_env(), {"name": "PYTHONHASHSEED", "value": spec.model.hash_seed}]
    env += extra or []
    env += [{"name": e.name, "value": e.value} for e in pool.pod_overrides.env]
    return env


def resources(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings) -> JsonDict:
    pool = spec.pool(role)
    requests: JsonDict = dict(pool.resources.requests)
    limits: JsonDict = dict(pool.resources.limits)
    if pool.gpus_per_replica > 0:
        limits[settings.gpu_resource] = pool.gpus_per_replica
        requests[settings.gpu_resource] = pool.gpus_per_replica
    out: JsonDict = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


#: the worker's own liveness route (``/health`` in relay mode is the engine's readiness,
#: which a real engine loading its weights fails for minutes: restarting the worker for it
#: would only make a crash loop)
LIVENESS_PATH = "/livez"


def http_probes(port_name: str) -> JsonDict:
    """The worker's probes. A real engine's container has none: it listens on loopback,
    which the kubelet's probes (sent to the pod's IP) cannot reach; its readiness is the
    worker's, whose ``/health`` is the engine's."""
    return {
        "readinessProbe": {"httpGet": {"path": "/health", "port": port_name},
                           "periodSeconds": READINESS_PERIOD_S,
                           "failureThreshold": READINESS_FAILURES},
        "livenessProbe": {"httpGet": {"path": LIVENESS_PATH, "port": port_name},
                          "periodSeconds": LIVENESS_PERIOD_S,
                          "failureThreshold": LIVENESS_FAILURES},
    }


def pod_ports(spec: MooncakeClusterSpec) -> list[JsonDict]:
    """The ports the pod serves to the rest of the cluster (the worker's)."""
    p = spec.engine.ports
    return [{"name": "http", "containerPort": p.http, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": p.kv_events, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": p.kv_replay, "protocol": "TCP"}]


def podinfo_mount(settings: OperatorSettings) -> JsonDict:
    return {"name": PODINFO_VOLUME, "mountPath": settings.annotations_mount, "readOnly": True}


def store_segment_bytes(spec: MooncakeClusterSpec) -> int:
    return quantity_bytes(spec.store.segment_size)
