"""The containers of one engine pod, per engine kind and release (pure: spec in, objects out).

- ``simulated``: our worker is the engine (``mooncake-operator worker``), with its pod
  agent reading the replica annotation from the downward-API file (:mod:`.worker`).
- ``vllm`` (:mod:`.vllm`) and ``sglang`` (:mod:`.sglang`): the engine beside our worker in
  relay + agent mode, which owns the pod's ports, relays the API and the KV events, and
  warms replicas through the engine. What they are given follows the release
  (:mod:`.support`), and ``tests/conformance`` checks it against that release's own code.

Common pod pieces (Pod Security ``restricted``, volumes, probes) are in :mod:`.pod`.
"""

from __future__ import annotations

import json

from ..settings import OperatorSettings
from ..spec import EngineKind, MooncakeClusterSpec
from . import sglang, vllm
from .pod import (
    ANNOTATIONS_FILE,
    ENGINE_KV_EVENTS,
    ENGINE_KV_REPLAY,
    HOME_MOUNT,
    HOME_VOLUME,
    LABELS_FILE,
    LOOPBACK,
    P2P_METADATA,
    PODINFO_VOLUME,
    SHM_MOUNT,
    SHM_VOLUME,
    JsonDict,
    StoreAddress,
    pod_ip_env,
    pod_name_env,
    pod_security_context,
    pool_env,
    rdma_capabilities,
    resources,
    security_context,
    store_segment_bytes,
    tmp_mount,
    tmp_volume,
)
from .support import (
    RELEASES,
    EngineRelease,
    Handshake,
    UnsupportedEngine,
    engine_version,
    image_version,
    release_of,
)
from .worker import worker_container

__all__ = [
    "ANNOTATIONS_FILE",
    "LABELS_FILE",
    "P2P_METADATA",
    "PODINFO_VOLUME",
    "RELEASES",
    "EngineRelease",
    "Handshake",
    "StoreAddress",
    "UnsupportedEngine",
    "engine_containers",
    "engine_version",
    "engine_volumes",
    "handshake",
    "image_version",
    "pod_ip_env",
    "pod_security_context",
    "rdma_capabilities",
    "release_of",
    "security_context",
    "store_config_data",
    "store_segment_bytes",
    "tmp_mount",
    "tmp_volume",
]
#: a real engine's user, for torch's compile cache (``getpass.getuser()`` needs ``USER``
#: for a UID with no passwd entry)
ENGINE_USER = "mooncake"


def handshake(spec: MooncakeClusterSpec) -> Handshake:
    """How the gateway hands KV from prefill to decode for this cluster's engines (our
    simulated worker speaks vLLM's MooncakeConnector shape)."""
    if spec.engine.kind is EngineKind.SIMULATED:
        return Handshake.KV_TRANSFER_PARAMS
    return release_of(spec).handshake(spec.store.enabled)


def bootstrap_port(spec: MooncakeClusterSpec) -> int | None:
    """The prefill engines' Mooncake bootstrap port, when the handshake names it."""
    if spec.engine.kind is EngineKind.SIMULATED:
        return None
    return release_of(spec).bootstrap_port


def engine_volumes(spec: MooncakeClusterSpec, store_configmap: str | None) -> list[JsonDict]:
    """The volumes of an engine pod besides its downward-API one (``store_configmap``: the
    cluster's ConfigMap of Mooncake settings, where the release reads them from a file)."""
    out = [tmp_volume()]
    if spec.engine.kind is not EngineKind.SIMULATED:
        out += [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
                {"name": HOME_VOLUME, "emptyDir": {}}]
    if spec.engine.kind is EngineKind.VLLM:
        out += vllm.volumes(store_configmap)
    return out


def store_config_data(spec: MooncakeClusterSpec, store: StoreAddress | None
                      ) -> dict[str, str] | None:
    """The data of the cluster's Mooncake-settings ConfigMap, where the engines read their
    store settings from a file (vLLM); None where they do not."""
    if store is None or spec.engine.kind is not EngineKind.VLLM:
        return None
    return {vllm.STORE_CONFIG_KEY: json.dumps(vllm.store_config(spec, store), indent=2) + "\n"}


def engine_containers(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                      store: StoreAddress | None) -> list[JsonDict]:
    """Containers of a prefill or decode pod of this cluster (a real engine's release must
    be supported: :func:`release_of` raises :class:`UnsupportedEngine` otherwise)."""
    kind = spec.engine.kind
    if kind is EngineKind.SIMULATED:
        return [worker_container(spec, role, settings, store)]
    assert spec.engine.image is not None  # the CRD's CEL rule guarantees it
    release = release_of(spec)
    p = spec.engine.ports
    if kind is EngineKind.VLLM:
        command, args = vllm.COMMAND, vllm.args(spec, role, release, store)
        extra_env = vllm.env(spec, role, release, store)
        ports = vllm.ports(role, release, store)
        mounts = vllm.mounts(store)
        host = LOOPBACK
    else:
        command, args = sglang.COMMAND, sglang.args(spec, role, release, store)
        extra_env = sglang.env(spec, role, release, store)
        ports = sglang.ports(role, release)
        mounts = []
        host = sglang.engine_host(role)
    home = [{"name": "HOME", "value": HOME_MOUNT}, {"name": "USER", "value": ENGINE_USER}]
    engine: JsonDict = {
        "name": "engine",
        "image": spec.engine.image,
        "command": list(command),
        "args": args,
        "env": pool_env(spec, role, [pod_name_env(), *home, *extra_env]),
        "ports": [{"name": "engine-http", "containerPort": p.engine_http, "protocol": "TCP"},
                  *ports],
        "volumeMounts": [tmp_mount(), {"name": SHM_VOLUME, "mountPath": SHM_MOUNT},
                         {"name": HOME_VOLUME, "mountPath": HOME_MOUNT}, *mounts],
        "securityContext": security_context(rdma_capabilities(spec)),
        "resources": resources(spec, role, settings),
    }
    if spec.engine.image_pull_policy:
        engine["imagePullPolicy"] = spec.engine.image_pull_policy
    relay = ["--engine-url", f"http://{host}:{p.engine_http}",
             "--engine-kv-events", ENGINE_KV_EVENTS, "--engine-kv-replay", ENGINE_KV_REPLAY,
             "--engine-kind", kind.value]
    return [engine, worker_container(spec, role, settings, store, relay)]
