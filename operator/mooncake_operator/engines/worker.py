"""Our worker's container: the simulated engine itself, or the relay and pod agent beside a
real engine (``mooncake-operator worker``; the image's entrypoint is the CLI)."""

from __future__ import annotations

from ..settings import OperatorSettings
from ..spec import MooncakeClusterSpec
from .pod import (
    ANNOTATIONS_FILE,
    P2P_METADATA,
    JsonDict,
    StoreAddress,
    http_probes,
    numba_env,
    pod_ip_env,
    pod_ports,
    podinfo_mount,
    pool_env,
    resources,
    security_context,
    tmp_mount,
)

WORKER_SUBCOMMAND = "worker"
STORE_CONNECT_TIMEOUT_S = 60


def worker_args(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                store: StoreAddress | None, relay: list[str] | None) -> list[str]:
    """``mooncake-operator worker`` arguments: the engine itself (simulated, ``relay`` None)
    or the relay and pod agent in front of a real engine (``relay``: the engine-specific
    relay arguments)."""
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
    if relay is not None:
        return args + relay
    sim = spec.engine.simulated
    args += ["--time-scale", repr(sim.time_scale), "--max-running", str(sim.max_running)]
    if sim.cache_tokens is not None:
        args += ["--cache-tokens", str(sim.cache_tokens)]
    if store is not None:
        args += ["--store", store.rpc, "--store-metadata", P2P_METADATA,
                 "--store-local-hostname", "$(POD_IP)",
                 "--store-connect-timeout", str(STORE_CONNECT_TIMEOUT_S)]
    return args + list(spec.engine.extra_args)


def worker_container(spec: MooncakeClusterSpec, role: str, settings: OperatorSettings,
                     store: StoreAddress | None, relay: list[str] | None = None) -> JsonDict:
    """The simulated engine's container (``relay`` None), or the sidecar beside a real one."""
    sidecar = relay is not None
    image = settings.image if sidecar else (spec.engine.image or settings.image)
    pull = settings.image_pull_policy if sidecar else (
        spec.engine.image_pull_policy or settings.image_pull_policy)
    container: JsonDict = {
        "name": "worker" if sidecar else "engine",
        "image": image,
        "imagePullPolicy": pull,
        "args": worker_args(spec, role, settings, store, relay),
        "env": [pod_ip_env(), numba_env()] if sidecar else pool_env(spec, role, [numba_env()]),
        "ports": pod_ports(spec),
        "volumeMounts": [podinfo_mount(settings), tmp_mount()],
        "securityContext": security_context(),
        **http_probes("http"),
    }
    if not sidecar:
        container["resources"] = resources(spec, role, settings)
    return container
