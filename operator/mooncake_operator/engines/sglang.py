"""SGLang pods: ``python3 -m sglang.launch_server`` behind our worker, per supported release.

What each flag and variable is for, and where that release's code reads it
(``tests/conformance`` feeds all of it to that code):

- ``--disaggregation-mode``, Mooncake as the transfer backend (``mooncake_tcp`` over TCP:
  SGLang then forces Mooncake's TCP transport, ``MC_FORCE_TCP``, and skips RDMA device
  selection) and ``MOONCAKE_PROTOCOL`` (the transport its transfer engine and store
  client initialise with; SGLang's default is rdma).
- The gateway sends both halves of a request at once with ``bootstrap_host/port/room``;
  the decode engine connects to the prefill engine's bootstrap server, which listens on
  ``--host``. So a prefill engine listens on the pod's IP (its HTTP API too: SGLang has
  no separate bootstrap address); a decode engine stays on loopback behind the worker.
  ``SGLANG_HOST_IP`` is the address its KV manager and transfer engine advertise.
- ``--kv-events-config``: KV events and their replay socket on IPC endpoints in the pod's
  shared ``/tmp`` (only the worker reads them), with ``bind`` (SGLang binds IPC endpoints
  anyway; it *connects* to a concrete TCP address and would open no listener).
- ``--enable-metrics`` for ``/metrics``; ``--enable-cache-report`` puts the cached-token
  count in each answer's usage.
- With a store, on prefill engines: HiCache with the Mooncake backend, configured by the
  ``MOONCAKE_*`` environment (``MooncakeStoreConfig.load_from_env``); the store nodes own
  the pool, so the engines lend none (``MOONCAKE_GLOBAL_SEGMENT_SIZE=0``). A decode engine
  gets its KV from the prefill engine and runs without a radix cache, which SGLang's
  HiCache needs (``--enable-hierarchical-cache`` there is refused: "mutually exclusive"
  with the decode server's ``disable_radix_cache``).
"""

from __future__ import annotations

import json

from mooncake_contract import conventions as c

from ..spec import MooncakeClusterSpec, StoreProtocol
from .pod import ENGINE_KV_EVENTS, ENGINE_KV_REPLAY, LOOPBACK, P2P_METADATA, JsonDict, StoreAddress
from .support import EngineRelease

COMMAND = ["python3", "-m", "sglang.launch_server"]
POD_IP = "$(POD_IP)"


def engine_host(role: str) -> str:
    """Where the engine listens: a prefill engine's bootstrap server must be reachable by
    the decode engines (it binds ``--host``)."""
    return POD_IP if role == c.ROLE_PREFILL else LOOPBACK


def kv_events_config() -> JsonDict:
    return {"publisher": "zmq", "endpoint": ENGINE_KV_EVENTS,
            "replay_endpoint": ENGINE_KV_REPLAY, "topic": "",
            "bind": True}


def transfer_backend(spec: MooncakeClusterSpec, release: EngineRelease) -> str:
    backend = release.p2p_connector
    return f"{backend}_tcp" if spec.store.protocol is StoreProtocol.TCP else backend


def args(spec: MooncakeClusterSpec, role: str, release: EngineRelease,
         store: StoreAddress | None) -> list[str]:
    p = spec.engine.ports
    m = spec.model
    pool = spec.pool(role)
    out = ["--model-path", m.name, "--served-model-name", m.served,
           "--host", engine_host(role), "--port", str(p.engine_http),
           "--page-size", str(m.block_size), "--context-length", str(m.max_model_len),
           "--tp", str(max(1, pool.gpus_per_replica)),
           "--disaggregation-mode", role,
           "--disaggregation-transfer-backend", transfer_backend(spec, release),
           "--kv-events-config", json.dumps(kv_events_config(), separators=(",", ":")),
           "--enable-metrics", "--enable-cache-report"]
    if role == c.ROLE_PREFILL:
        out += ["--disaggregation-bootstrap-port", str(release.bootstrap_port)]
    if store is not None and role == c.ROLE_PREFILL:
        out += ["--enable-hierarchical-cache", "--hicache-storage-backend",
                release.store_connector]
    return out + list(spec.engine.extra_args)


def env(spec: MooncakeClusterSpec, role: str, release: EngineRelease,
        store: StoreAddress | None) -> list[JsonDict]:
    out: list[JsonDict] = [
        {"name": "SGLANG_HOST_IP", "value": POD_IP},
        {"name": "MOONCAKE_PROTOCOL", "value": spec.store.protocol.value},
        {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": POD_IP},
    ]
    if store is not None and role == c.ROLE_PREFILL:
        out += [{"name": "MOONCAKE_MASTER", "value": store.rpc},
                {"name": "MOONCAKE_TE_META_DATA_SERVER", "value": P2P_METADATA},
                {"name": "MOONCAKE_GLOBAL_SEGMENT_SIZE", "value": "0"}]
    return out


def ports(role: str, release: EngineRelease) -> list[JsonDict]:
    """Ports peers reach the engine on: a prefill engine's bootstrap server."""
    if role == c.ROLE_PREFILL:
        return [{"name": "kv-bootstrap", "containerPort": release.bootstrap_port,
                 "protocol": "TCP"}]
    return []
