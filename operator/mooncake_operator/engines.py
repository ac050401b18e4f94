"""The containers of one engine pod, per engine kind (pure).

- ``simulated``: our worker is the engine (``mooncake-operator worker``), with its pod
  agent reading the replica annotation from the downward-API file.
- ``vllm``: ``vllm serve`` with prefix caching, KV events on ZeroMQ (with replay) and a
  Mooncake KV connector (the store connector when the cluster has a store, else the
  point-to-point one), producer on prefill pods and consumer on decode pods; beside it
  our worker in relay + agent mode owns the pod's ports, relays the API and the KV
  events, and warms replicas through the engine.
- ``sglang``: ``python3 -m sglang.launch_server`` with ``--disaggregation-mode``,
  Mooncake as the transfer backend, KV events, and the same worker sidecar.

Flags follow the engines' documentation at the versions named in ``docs/operator.md``;
they cannot run here (no GPU), so golden-manifest tests pin what we generate.

Every pod meets the Pod Security Standard ``restricted`` (``docs/helm.md`` lists each
field): non-root UID 65532, seccomp ``RuntimeDefault``, no privilege escalation, every
capability dropped, a read-only root filesystem with an ``emptyDir`` on ``/tmp`` (numba's
cache, Mooncake's glog files) — except, with ``store.protocol: rdma``, the containers that
register memory with the NIC (real engines, store nodes): they add ``IPC_LOCK``, which no
Pod Security level but ``privileged`` allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mooncake_contract import conventions as c

from . import names
from .settings import OperatorSettings
from .spec import EngineKind, MooncakeClusterSpec, StoreProtocol, quantity_bytes

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
STORE_CONNECT_TIMEOUT_S = 60
#: The image's entrypoint is the CLI; args name the subcommand.
WORKER_SUBCOMMAND = "worker"
VLLM_COMMAND = ["vllm", "serve"]
SGLANG_COMMAND = ["python3", "-m", "sglang.launch_server"]
LOOPBACK = "127.0.0.1"

# -- Pod Security "restricted" -------------------------------------------------------------------
#: UID and GID every generated pod runs as (the images' non-root user; distroless' nonroot)
NONROOT_ID = 65532
#: A writable /tmp on a read-only root filesystem (numba's cache, Mooncake's glog files)
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
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


def engine_volumes(spec: MooncakeClusterSpec) -> list[JsonDict]:
    """The emptyDirs of an engine pod (besides its downward-API volume)."""
    out = [tmp_volume()]
    if spec.engine.kind is not EngineKind.SIMULATED:
        out += [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
                {"name": HOME_VOLUME, "emptyDir": {}}]
    return out


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """How a pod reaches the cluster's store master: through its Service's environment
    variables (the kubelet sets them for Services that exist when the pod starts; the
    operator creates the Service before any engine pod)."""

    service: str
    rpc_port_name: str = "rpc"

    @property
    def env_prefix(self) -> str:
        return names.service_env_prefix(self.service)

    @property
    def rpc(self) -> str:
        p = self.env_prefix
        return f"$({p}_SERVICE_HOST):$({p}_SERVICE_PORT_{self.rpc_port_name.upper()})"

    def dns(self, namespace: str, port: int) -> str:
        return f"{self.service}.{namespace}.svc:{port}"


def pod_ip_env() -> JsonDict:
    return {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _env(spec: MooncakeClusterSpec, role: str, extra: list[JsonDict] | None = None
         ) -> list[JsonDict]:
    pool = spec.pool(role)
    env = [pod_ip_env(), {"name": "PYTHONHASHSEED", "value": spec.model.hash_seed}]
    env += extra or []
    env += [{"name": e.name, "value": e.value} for e in pool.pod_overrides.env]
    return env


def _resources(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings) -> JsonDict:
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


def _probes(port_name: str) -> JsonDict:
    return {
        "readinessProbe": {"httpGet": {"path": "/health", "port": port_name},
                           "periodSeconds": READINESS_PERIOD_S,
                           "failureThreshold": READINESS_FAILURES},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port_name},
                          "periodSeconds": LIVENESS_PERIOD_S,
                          "failureThreshold": LIVENESS_FAILURES},
    }


def _ports(spec: MooncakeClusterSpec) -> list[JsonDict]:
    p = spec.engine.ports
    return [{"name": "http", "containerPort": p.http, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": p.kv_events, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": p.kv_replay, "protocol": "TCP"}]


def _mount(settings: OperatorSettings) -> JsonDict:
    return {"name": PODINFO_VOLUME, "mountPath": settings.annotations_mount, "readOnly": True}


def worker_args(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                store: StoreAddress | None, relay: bool) -> list[str]:
    """``mooncake-operator worker`` arguments: the engine itself (simulated) or its relay
    and pod agent (real engines)."""
    p = spec.engine.ports
    m = spec.model
    args = [WORKER_SUBCOMMAND, "--role", role,
            "--host", "$(POD_IP)", "--port", str(p.http),
            "--kv-events-host", "$(POD_IP)", "--kv-events-port", str(p.kv_events),
            "--kv-replay-port", str(p.kv_replay),
            "--model", m.served, "--block-size", str(m.block_size),
            "--max-model-len", str(m.max_model_len),
            "--annotations-file", f"{settings.annotations_mount}/{ANNOTATIONS_FILE}",
            "--log-level", "INFO"]
    if m.cache_salt:
        args += ["--cache-salt", m.cache_salt]
    if relay:
        args += ["--engine-url", f"http://{LOOPBACK}:{p.engine_http}",
                 "--engine-kv-events", f"tcp://{LOOPBACK}:{p.engine_kv_events}"]
        if spec.engine.kind is EngineKind.VLLM:
            args += ["--engine-kv-replay", f"tcp://{LOOPBACK}:{p.engine_kv_replay}"]
        return args
    sim = spec.engine.simulated
    args += ["--time-scale", repr(sim.time_scale), "--max-running", str(sim.max_running)]
    if sim.cache_tokens is not None:
        args += ["--cache-tokens", str(sim.cache_tokens)]
    if store is not None:
        args += ["--store", store.rpc, "--store-metadata", P2P_METADATA,
                 "--store-local-hostname", "$(POD_IP)",
                 "--store-connect-timeout", str(STORE_CONNECT_TIMEOUT_S)]
    return args + list(spec.engine.extra_args)


def _worker_container(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                      store: StoreAddress | None, relay: bool) -> JsonDict:
    image = settings.image if relay else (spec.engine.image or settings.image)
    pull = settings.image_pull_policy if relay else (
        spec.engine.image_pull_policy or settings.image_pull_policy)
    container: JsonDict = {
        "name": "worker" if relay else "engine",
        "image": image,
        "imagePullPolicy": pull,
        "args": worker_args(spec, role, settings, store, relay),
        "env": _env(spec, role, [numba_env()]) if not relay else [pod_ip_env(), numba_env()],
        "ports": _ports(spec),
        "volumeMounts": [_mount(settings), tmp_mount()],
        "securityContext": security_context(),
        **_probes("http"),
    }
    if not relay:
        container["resources"] = _resources(spec, role, settings)
    return container


def vllm_args(spec: MooncakeClusterSpec, role: str, store: StoreAddress | None) -> list[str]:
    p = spec.engine.ports
    m = spec.model
    pool = spec.pool(role)
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{p.engine_kv_events}",
              "replay_endpoint": f"tcp://*:{p.engine_kv_replay}", "topic": ""}
    kv_role = "kv_producer" if role == c.ROLE_PREFILL else "kv_consumer"
    connector = "MooncakeStoreConnector" if store is not None else "MooncakeConnector"
    transfer = {"kv_connector": connector, "kv_role": kv_role}
    args = [m.name, "--served-model-name", m.served, "--host", LOOPBACK,
            "--port", str(p.engine_http), "--block-size", str(m.block_size),
            "--max-model-len", str(m.max_model_len), "--enable-prefix-caching",
            "--tensor-parallel-size", str(max(1, pool.gpus_per_replica)),
            "--kv-events-config", json.dumps(events, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    return args + list(spec.engine.extra_args)


def sglang_args(spec: MooncakeClusterSpec, role: str, store: StoreAddress | None) -> list[str]:
    p = spec.engine.ports
    m = spec.model
    pool = spec.pool(role)
    events = {"publisher": "zmq", "endpoint": f"tcp://*:{p.engine_kv_events}", "topic": ""}
    args = ["--model-path", m.name, "--served-model-name", m.served, "--host", LOOPBACK,
            "--port", str(p.engine_http), "--page-size", str(m.block_size),
            "--context-length", str(m.max_model_len),
            "--tp", str(max(1, pool.gpus_per_replica)),
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", "mooncake",
            "--kv-events-config", json.dumps(events, separators=(",", ":")),
            "--enable-metrics"]
    if store is not None:
        args += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    return args + list(spec.engine.extra_args)


def _mooncake_env(spec: MooncakeClusterSpec, store: StoreAddress | None,
                  namespace: str) -> list[JsonDict]:
    """The Mooncake client environment real engines read (Mooncake's Kubernetes guide)."""
    if store is None:
        return [{"name": "MOONCAKE_PROTOCOL", "value": spec.store.protocol.value},
                {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": "$(POD_IP)"}]
    return [
        {"name": "MOONCAKE_MASTER", "value": store.rpc},
        {"name": "MOONCAKE_TE_META_DATA_SERVER", "value": P2P_METADATA},
        {"name": "MOONCAKE_GLOBAL_SEGMENT_SIZE", "value": "0"},
        {"name": "MOONCAKE_PROTOCOL", "value": spec.store.protocol.value},
        {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": "$(POD_IP)"},
    ]


def engine_containers(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                      store: StoreAddress | None, namespace: str) -> list[JsonDict]:
    """Containers of a prefill or decode pod of this cluster."""
    kind = spec.engine.kind
    if kind is EngineKind.SIMULATED:
        return [_worker_container(spec, role, settings, store, relay=False)]
    assert spec.engine.image is not None  # the CRD's CEL rule guarantees it
    if kind is EngineKind.VLLM:
        command, args = VLLM_COMMAND, vllm_args(spec, role, store)
    else:
        command, args = SGLANG_COMMAND, sglang_args(spec, role, store)
    home = [{"name": "HOME", "value": HOME_MOUNT}, {"name": "USER", "value": ENGINE_USER}]
    engine: JsonDict = {
        "name": "engine",
        "image": spec.engine.image,
        "command": list(command),
        "args": args,
        "env": _env(spec, role, home + _mooncake_env(spec, store, namespace)),
        "ports": [{"name": "engine-http", "containerPort": spec.engine.ports.engine_http,
                   "protocol": "TCP"}],
        "volumeMounts": [tmp_mount(), {"name": SHM_VOLUME, "mountPath": SHM_MOUNT},
                         {"name": HOME_VOLUME, "mountPath": HOME_MOUNT}],
        "securityContext": security_context(rdma_capabilities(spec)),
        "resources": _resources(spec, role, settings),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "engine-http"},
                           "periodSeconds": READINESS_PERIOD_S,
                           "failureThreshold": READINESS_FAILURES},
    }
    if spec.engine.image_pull_policy:
        engine["imagePullPolicy"] = spec.engine.image_pull_policy
    return [engine, _worker_container(spec, role, settings, store, relay=True)]


def store_segment_bytes(spec: MooncakeClusterSpec) -> int:
    return quantity_bytes(spec.store.segment_size)
