"""Every generated engine pod, as the kubelet would start it, through the engine's own
command line, config classes and loaders (one probe run per release; see the probes'
docstrings in ``mooncake_conformance/probes``).

What a pod must get right, per release and combination (store on/off, TCP/RDMA, prefill
and decode, every supported block size and tensor-parallel size):
- it parses and the engine's configuration builds (vLLM: ``EngineArgs`` and the whole
  ``VllmConfig`` on the CPU platform; SGLang: ``ServerArgs`` resolved and checked with
  ``--device cpu``, the one step that needs a GPU to find the accelerator);
- the engine reads the model, ports, block size, context and parallelism we meant;
- the connector named is registered and imports (vLLM), the transfer backend and
  protocol are the cluster's (SGLang);
- the Mooncake settings load through the engine's own loader from exactly the files and
  environment the pod gets, and reach the store's master;
- KV events go to IPC sockets in the pod's shared ``/tmp``, where the worker beside the
  engine reads them: nothing of the engine's KV-event stream is on a TCP address;
- the kubelet's probes only ask what answers on the pod's IP.
"""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_operator import names
from mooncake_operator.engines.pod import TMP_MOUNT

from .conftest import case_ids, case_of, cli_results
from .matrix import Built, Case, cases


def _result(case_id: str) -> tuple[Built, dict[str, Any]]:
    built, result = cli_results(case_of(case_id).release)[case_id]
    assert result["ok"], f"{case_id}: {result['stage']}: {result['error']}"
    return built, result


def _worker_arg(built: Built, flag: str) -> str:
    args = built.worker.args
    return args[args.index(flag) + 1]


def _assert_ipc_in_tmp(built: Built, endpoint: str) -> None:
    """An IPC endpoint in the pod's /tmp, which both containers mount."""
    tmp = built.engine.mounts[TMP_MOUNT]
    assert endpoint.startswith(f"ipc://{tmp}/"), endpoint
    assert built.worker.mounts[TMP_MOUNT] == tmp


def _assert_probes_reachable(built: Built, host: str) -> None:
    """The kubelet probes the pod's IP: a container listening on loopback has none."""
    engine = built.container("engine")
    probes = [engine.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe")]
    if host not in (built.pod_ip, "0.0.0.0", "::"):
        assert not [p for p in probes if p and "httpGet" in p], engine


@pytest.mark.parametrize("case_id", case_ids("vllm"))
def test_vllm_pod(case_id: str) -> None:
    built, got = _result(case_id)
    case, spec = built.case, built.spec
    assert (got["host"], got["port"]) == ("127.0.0.1", spec.engine.ports.engine_http)
    assert got["served_model_name"] == [spec.model.served]
    assert got["block_size"] == case.block_size
    assert got["max_model_len"] == spec.model.max_model_len
    assert got["enable_prefix_caching"] and got["enable_prompt_tokens_details"]
    assert (got["tensor_parallel_size"], got["data_parallel_size"]) == (case.tp, 1)
    assert got["advertised_ip"] == built.pod_ip
    # KV events: IPC in the shared /tmp, replay too; the worker reads exactly those
    ev = got["kv_events"]
    assert (ev["enable_kv_cache_events"], ev["publisher"]) == (True, "zmq")
    for key, flag in (("endpoint", "--engine-kv-events"),
                      ("replay_endpoint", "--engine-kv-replay")):
        _assert_ipc_in_tmp(built, ev[key])
        assert _worker_arg(built, flag) == ev[key]
    # the connector
    kt = got["kv_transfer"]
    role = "kv_producer" if case.role == "prefill" else "kv_consumer"
    assert (kt["kv_role"], kt["registered"]) == (role, True)
    if case.store:
        assert kt["kv_connector"] == case.release.store_connector
        store = got["mooncake_store"]  # through MooncakeStoreConfig.load_from_config
        master = f"{names.store_service(built.ref.name)}.{built.ref.namespace}.svc:" \
                 f"{spec.store.master.rpc_port}"
        assert store["master_server_address"] == master
        assert (store["protocol"], store["metadata_server"]) == (case.protocol, "P2PHANDSHAKE")
        # the store nodes own the pool: the engine lends none, which vLLM allows only so
        assert (store["mode"], store["global_segment_size"]) == ("standalone-store", 0)
    else:
        assert kt["kv_connector"] == case.release.p2p_connector
        assert "mooncake_store" not in got
        # the gateway names the prefill engine by its pod's name
        assert kt["engine_id"] == built.pod["metadata"]["name"]
        assert kt["extra_config"]["mooncake_protocol"] == case.protocol
        if case.role == "prefill":
            assert got["bootstrap_port"] == case.release.bootstrap_port
            ports = {p["containerPort"] for p in built.container("engine")["ports"]}
            assert case.release.bootstrap_port in ports
    _assert_probes_reachable(built, got["host"])


@pytest.mark.parametrize("case_id", case_ids("sglang"))
def test_sglang_pod(case_id: str) -> None:
    built, got = _result(case_id)
    case, spec = built.case, built.spec
    # a prefill engine's bootstrap server listens on --host: the decode engines reach it
    host = built.pod_ip if case.role == "prefill" else "127.0.0.1"
    assert (got["host"], got["port"]) == (host, spec.engine.ports.engine_http)
    assert _worker_arg(built, "--engine-url") == f"http://{host}:{got['port']}"
    assert got["served_model_name"] == spec.model.served
    assert got["page_size"] == case.block_size
    assert got["context_length"] == spec.model.max_model_len
    assert (got["tp_size"], got["dp_size"]) == (case.tp, 1)
    assert got["enable_metrics"] and got["enable_cache_report"]
    assert got["disaggregation_mode"] == case.role
    assert got["transfer_backend"] == case.release.p2p_connector
    assert got["mooncake_protocol"] == case.protocol
    assert got["force_tcp"] is (case.protocol == "tcp")
    assert got["advertised_ip"] == built.pod_ip
    if case.role == "prefill":
        assert got["bootstrap_port"] == case.release.bootstrap_port
    ev = got["kv_events"]
    assert (ev["publisher"], ev["bind"]) == ("zmq", True)
    for key, flag in (("endpoint", "--engine-kv-events"),
                      ("replay_endpoint", "--engine-kv-replay")):
        _assert_ipc_in_tmp(built, ev[key])
        assert _worker_arg(built, flag) == ev[key]
    if case.store and case.role == "prefill":
        assert (got["enable_hierarchical_cache"], got["hicache_storage_backend"]) == \
            (True, case.release.store_connector)
        store = got["mooncake_store"]  # through MooncakeStoreConfig.load_from_env
        svc = next(o for o in built.children if o["kind"] == "Service"
                   and o["metadata"]["name"] == names.store_service(built.ref.name))
        ip = svc["spec"].get("clusterIP") or "127.96.0.10"
        assert store["master_server_address"] == f"{ip}:{spec.store.master.rpc_port}"
        assert (store["protocol"], store["metadata_server"]) == (case.protocol, "P2PHANDSHAKE")
        assert store["global_segment_size"] == 0  # the store nodes own the pool
        assert store["local_hostname"] == built.pod_ip
    else:
        assert not got["enable_hierarchical_cache"]
    _assert_probes_reachable(built, got["host"])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_golden_examples_are_among_the_cases(kind: str) -> None:
    """``tests/operator/golden`` pins the pods of ``examples/clusters/<kind>.yaml``: their
    combination is one this suite checks, so a golden changes only with pods the
    engine's own code accepted."""
    from mooncake_operator.engines import release_of

    from ..operator.manifests import example

    _, spec = example(kind)
    release = release_of(spec)
    combo = (spec.store.enabled, spec.store.protocol.value, spec.model.block_size,
             spec.prefill.gpus_per_replica)
    assert spec.decode.gpus_per_replica == spec.prefill.gpus_per_replica
    ids = {c.id for c in cases(release)}
    for role in ("prefill", "decode"):
        assert Case(release, *combo, role).id in ids
