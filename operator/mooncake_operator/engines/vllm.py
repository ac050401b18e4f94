"""vLLM pods: ``vllm serve`` behind our worker (relay and pod agent), per supported release.

What each flag, variable and file is for, and where that release's code reads it
(``tests/conformance`` feeds all of it to that code):

- ``--kv-events-config``: KV events on ZeroMQ with a replay socket, on IPC endpoints in
  the pod's shared ``/tmp``: only the worker beside the engine reads them (an
  all-interfaces bind is the pattern of CVE-2025-30202; vLLM binds wildcard and IPC
  endpoints and *connects* to any concrete TCP address). ``--enable-prompt-tokens-details``
  puts the cached-token count in each answer's usage, which the gateway reports.
- Without a store: ``MooncakeConnector`` (P2P). ``engine_id`` is the pod's name, so the
  gateway can name the prefill engine in the decode's ``kv_transfer_params``; the prefill
  engine's bootstrap server listens on ``VLLM_MOONCAKE_BOOTSTRAP_PORT``; the transfer
  protocol is ``kv_connector_extra_config.mooncake_protocol`` (its default is rdma).
- With a store: ``MooncakeStoreConnector``, whose settings vLLM reads only from the JSON
  file named by ``MOONCAKE_CONFIG_PATH`` (``vllm/distributed/mooncake_store.py``). The
  store nodes own the pool, so the engines join in ``standalone-store`` mode and lend no
  memory (``global_segment_size`` 0, which vLLM allows only in that mode). The file is a
  ConfigMap of the cluster; it reaches the master by the Service's DNS name, because
  nothing expands variables inside a file.
- ``VLLM_HOST_IP``: the address vLLM advertises to peers (else it guesses from a UDP
  socket towards 8.8.8.8).
"""

from __future__ import annotations

import json

from mooncake_contract import conventions as c

from ..spec import MooncakeClusterSpec
from .pod import ENGINE_KV_EVENTS, ENGINE_KV_REPLAY, LOOPBACK, P2P_METADATA, JsonDict, StoreAddress
from .support import EngineRelease

COMMAND = ["vllm", "serve"]
#: the cluster ConfigMap key, and where engines mount it, holding Mooncake's settings
STORE_CONFIG_KEY = "mooncake.json"
STORE_CONFIG_VOLUME = "mooncake-config"
STORE_CONFIG_MOUNT = "/etc/mooncake/store"
#: Mooncake Store topology of an engine that lends no memory (vLLM's MooncakeMode)
STANDALONE_STORE = "standalone-store"


def _compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def kv_events_config() -> JsonDict:
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": ENGINE_KV_EVENTS,
            "replay_endpoint": ENGINE_KV_REPLAY, "topic": ""}


def kv_transfer_config(spec: MooncakeClusterSpec, role: str, release: EngineRelease,
                       store: StoreAddress | None) -> JsonDict:
    kv_role = "kv_producer" if role == c.ROLE_PREFILL else "kv_consumer"
    if store is not None:
        return {"kv_connector": release.store_connector, "kv_role": kv_role}
    return {"kv_connector": release.p2p_connector, "kv_role": kv_role,
            "engine_id": "$(POD_NAME)",
            "kv_connector_extra_config": {"mooncake_protocol": spec.store.protocol.value}}


def args(spec: MooncakeClusterSpec, role: str, release: EngineRelease,
         store: StoreAddress | None) -> list[str]:
    p = spec.engine.ports
    m = spec.model
    pool = spec.pool(role)
    return [m.name, "--served-model-name", m.served, "--host", LOOPBACK,
            "--port", str(p.engine_http), "--block-size", str(m.block_size),
            "--max-model-len", str(m.max_model_len), "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--tensor-parallel-size", str(max(1, pool.gpus_per_replica)),
            "--kv-events-config", _compact(kv_events_config()),
            "--kv-transfer-config",
            _compact(kv_transfer_config(spec, role, release, store)),
            *spec.engine.extra_args]


def env(spec: MooncakeClusterSpec, role: str, release: EngineRelease,
        store: StoreAddress | None) -> list[JsonDict]:
    out: list[JsonDict] = [{"name": "VLLM_HOST_IP", "value": "$(POD_IP)"}]
    if store is not None:
        out.append({"name": "MOONCAKE_CONFIG_PATH",
                    "value": f"{STORE_CONFIG_MOUNT}/{STORE_CONFIG_KEY}"})
    elif role == c.ROLE_PREFILL:
        out.append({"name": "VLLM_MOONCAKE_BOOTSTRAP_PORT",
                    "value": str(release.bootstrap_port)})
    return out


def store_config(spec: MooncakeClusterSpec, store: StoreAddress) -> JsonDict:
    """The JSON ``MooncakeStoreConfig.from_file`` reads."""
    return {"metadata_server": P2P_METADATA, "master_server_address": store.dns,
            "protocol": spec.store.protocol.value, "device_name": "",
            "mode": STANDALONE_STORE, "global_segment_size": 0}


def volumes(configmap: str | None) -> list[JsonDict]:
    if configmap is None:
        return []
    return [{"name": STORE_CONFIG_VOLUME, "configMap": {"name": configmap}}]


def mounts(store: StoreAddress | None) -> list[JsonDict]:
    if store is None:
        return []
    return [{"name": STORE_CONFIG_VOLUME, "mountPath": STORE_CONFIG_MOUNT, "readOnly": True}]


def ports(role: str, release: EngineRelease, store: StoreAddress | None) -> list[JsonDict]:
    """Ports peers reach the engine on: a P2P prefill engine's bootstrap server."""
    if store is None and role == c.ROLE_PREFILL:
        return [{"name": "kv-bootstrap", "containerPort": release.bootstrap_port,
                 "protocol": "TCP"}]
    return []
