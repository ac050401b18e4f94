"""Pure manifest builders: names, labels, owner references, GPU placement, the store, the
gateway's view, the revision hash; golden manifests for engines that cannot run here."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from mooncake_contract import conventions as c
from mooncake_contract.annotations import parse_annotations
from mooncake_operator import builders, names

from .manifests import SETTINGS, example, with_updates

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MOONCAKE_UPDATE_GOLDEN") == "1"


def _golden(name: str, objs: list[dict[str, Any]]) -> None:
    path = GOLDEN / f"{name}.yaml"
    text = yaml.safe_dump_all(objs, sort_keys=False, width=100)
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with MOONCAKE_UPDATE_GOLDEN=1 once"
    assert path.read_text() == text, f"{path} differs (MOONCAKE_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("engine", ["simulated", "vllm", "sglang"])
def test_golden_manifests(engine: str) -> None:
    ref, spec = example(engine)
    rev = builders.revision(ref, spec, SETTINGS)
    objs = [builders.engine_pod(ref, spec, SETTINGS, role, rev, 0)
            for role in builders.POOL_ROLES]
    _golden(f"{engine}-pods", objs)
    _golden(f"{engine}-children", builders.children(ref, spec, SETTINGS))


def test_engine_pod_shape() -> None:
    ref, spec = example("simulated")
    rev = builders.revision(ref, spec, SETTINGS)
    pod = builders.engine_pod(ref, spec, SETTINGS, c.ROLE_PREFILL, rev, 3)
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["name"] == f"llama-prefill-{rev}-3"
    assert names.parse_pod_name(meta["name"]) == ("llama", "prefill", rev, 3)
    assert meta["labels"][c.LABEL_REVISION] == rev
    assert meta["labels"][c.LABEL_CLUSTER] == "llama"
    assert meta["labels"][c.LABEL_ROLE] == "prefill"
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("MooncakeCluster",
                                                                 "uid-1234", True)
    assert meta["annotations"][c.ANNOTATION_HTTP_PORT] == "8000"
    (engine,) = ps["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        ps["tolerations"]
    assert ps["nodeSelector"] == {"mooncake.io/pool": "prefill"}
    # the agent's annotations file is the downward-API volume the container mounts
    mount = engine["volumeMounts"][0]
    vol = next(v for v in ps["volumes"] if v["name"] == mount["name"])
    assert {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}} in \
        vol["downwardAPI"]["items"]
    args = engine["args"]
    assert args[args.index("--annotations-file") + 1] == f"{mount['mountPath']}/annotations"
    # the store through its Service's variables, never a pod IP
    store = args[args.index("--store") + 1]
    assert store == "$(LLAMA_STORE_SERVICE_HOST):$(LLAMA_STORE_SERVICE_PORT_RPC)"
    assert {"name": "PYTHONHASHSEED", "value": "0"} in engine["env"]
    assert "command" not in engine  # the image's entrypoint (the CLI) runs "worker ..."


def test_revision_ignores_replicas_but_not_engine_changes() -> None:
    ref, spec = example("simulated")
    base = builders.revision(ref, spec, SETTINGS)

    def changed(**update: Any) -> str:
        return builders.revision(ref, with_updates(spec, **update), SETTINGS)

    assert changed(prefill__replicas=7, decode__replicas=1) == base
    assert changed(conductor__policy="dynamo-kv") == base  # the gateway's, not the engines'
    assert changed(engine__extraArgs=["--max-waiting=9"]) != base
    assert changed(model__blockSize=32) != base
    assert changed(decode__gpusPerReplica=4) != base  # both pools roll together
    assert changed(model__hashSeed="7") != base


#: What Go's YAML reader (kubectl) takes for a number: YAML 1.2 core-schema ints and floats.
_YAML12_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?"
                            r"|0o[0-7]+|0x[0-9a-fA-F]+")


def test_hashes_stay_strings_in_any_yaml() -> None:
    """A revision label or spec hash dumped by PyYAML must read back as a string in Go.

    Hex hashes did not: ``1234e56789`` is a string to PyYAML (so it is written unquoted)
    and a float to kubectl. The inputs below include such hex hashes, so this could fail.
    """
    inputs = [{"i": i} for i in range(3000)]
    old_hex = [hashlib.sha256(json.dumps(o, sort_keys=True, separators=(",", ":")).encode())
               .hexdigest()[:names.REVISION_CHARS] for o in inputs]
    assert sum(bool(_YAML12_NUMBER.fullmatch(h)) for h in old_hex) > 0
    alphabet = set(builders.HASH_ALPHABET)
    seen = set()
    for obj in inputs:
        h = builders.digest(obj, names.REVISION_CHARS)
        assert len(h) == names.REVISION_CHARS and set(h) <= alphabet, h
        assert h[0].isalpha() and not _YAML12_NUMBER.fullmatch(h), h
        doc = yaml.safe_dump({"labels": {"rev": h}})
        assert yaml.safe_load(doc) == {"labels": {"rev": h}}
        assert names.parse_pod_name(names.pod_name("c", "decode", h, 2)) == ("c", "decode", h, 2)
        seen.add(h)
    assert len(seen) == len(inputs)  # no collisions among 3,000
    # a spec hash is the same encoding, 16 characters
    assert builders.digest({"a": 1}) != builders.digest({"a": 2})
    assert len(builders.digest({"a": 1})) == 16


def test_hash_seed_is_shared_by_every_engine() -> None:
    for engine in ("simulated", "vllm", "sglang"):
        ref, spec = example(engine)
        rev = builders.revision(ref, spec, SETTINGS)
        seeds = {e["value"] for role in builders.POOL_ROLES
                 for ctr in builders.engine_pod(ref, spec, SETTINGS, role, rev, 0)["spec"]
                 ["containers"] for e in ctr.get("env", []) if e["name"] == "PYTHONHASHSEED"}
        assert seeds == {spec.model.hash_seed}, engine


def test_real_engines_get_relay_sidecar_with_owned_ports() -> None:
    ref, spec = example("vllm")
    rev = builders.revision(ref, spec, SETTINGS)
    pod = builders.engine_pod(ref, spec, SETTINGS, c.ROLE_DECODE, rev, 0)
    engine, worker = pod["spec"]["containers"]
    assert engine["command"] == ["vllm", "serve"]
    assert engine["args"][0] == "meta-llama/Llama-3.1-70B-Instruct"
    assert '"kv_role":"kv_consumer"' in engine["args"][engine["args"].index(
        "--kv-transfer-config") + 1]
    assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "8"
    assert worker["args"][:3] == ["worker", "--role", "decode"]
    assert "--engine-url" in worker["args"] and "--engine-kv-events" in worker["args"]
    assert [p["containerPort"] for p in worker["ports"]] == [8000, 5557, 5558]


def test_store_children() -> None:
    ref, spec = example("simulated")
    kids = {o["kind"]: o for o in builders.children(ref, spec, SETTINGS)}
    svc, dep, ds = kids["Service"], kids["Deployment"], kids["DaemonSet"]
    assert svc["metadata"]["name"] == "llama-store"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--rpc_address=$(POD_IP)" in args
    node = ds["spec"]["template"]["spec"]
    assert node["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    client = node["containers"][0]
    assert client["args"][client["args"].index("--segment-bytes") + 1] == str(64 << 20)
    assert client["resources"]["limits"]["memory"] == "512Mi"
    for o in kids.values():
        assert o["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
        assert builders.SPEC_HASH_ANNOTATION in o["metadata"]["annotations"]


def test_no_store_no_store_objects() -> None:
    ref, spec = example("simulated")
    off = spec.model_copy(update={"store": spec.store.model_copy(update={"enabled": False})})
    kinds = [o["kind"] for o in builders.children(ref, off, SETTINGS)]
    assert kinds == ["ConfigMap"]
    rev = builders.revision(ref, off, SETTINGS)
    args = builders.engine_pod(ref, off, SETTINGS, "prefill", rev, 0)["spec"]["containers"][0][
        "args"]
    assert "--store" not in args


def test_gateway_view_is_a_valid_gateway_model() -> None:
    from mooncake_gateway.settings import ModelSettings

    ref, spec = example("simulated")
    cm = builders.gateway_configmap(ref, spec)
    assert cm["metadata"]["labels"][c.LABEL_GATEWAY_MODEL] == "true"
    model = ModelSettings.model_validate(yaml.safe_load(cm["data"][c.GATEWAY_MODEL_KEY]))
    assert model.name == "llama3-70b-sim" and model.block_size == 16
    assert model.kubernetes is not None
    assert model.kubernetes.prefill_selector == "mooncake.io/cluster=llama,mooncake.io/role=prefill"
    assert model.conductor.policy == "conductor"
    assert model.conductor.slo.tbt_s == 0.1
    assert model.time_scale == 0.5  # the Conductor's clock at the simulated engines' pace


@pytest.mark.parametrize("value", [None, True, False])
@pytest.mark.parametrize("field", ["shedding", "holding", "overrun"])
def test_conductor_switches_reach_the_gateway_and_the_controller(
        field: str, value: bool | None) -> None:
    """spec.conductor.shedding / .holding / .overrun: unset keeps the policy's own (None), else the
    value, in the gateway's model document and in the controller's Conductor."""
    from mooncake_gateway.settings import ModelSettings
    from mooncake_operator.reconcile import conductor_config

    ref, spec = example("simulated")
    spec = spec.model_copy(update={"conductor": spec.conductor.model_copy(
        update={field: value})})
    cm = builders.gateway_configmap(ref, spec)
    model = ModelSettings.model_validate(yaml.safe_load(cm["data"][c.GATEWAY_MODEL_KEY]))
    assert getattr(model.conductor, field).enabled is value
    assert getattr(conductor_config(spec), field).enabled is value


@pytest.mark.parametrize("risk", [None, 0.01])
def test_ttft_miss_risk_reaches_the_admission_rule(risk: float | None) -> None:
    """spec.conductor.ttftMissRisk: the prediction rule's margin in the gateway's model
    document and in the controller's Conductor; unset keeps the rule without a margin."""
    from mooncake_gateway.settings import ModelSettings
    from mooncake_operator.reconcile import conductor_config

    ref, spec = example("simulated")
    spec = spec.model_copy(update={"conductor": spec.conductor.model_copy(
        update={"ttft_miss_risk": risk})})
    cm = builders.gateway_configmap(ref, spec)
    model = ModelSettings.model_validate(yaml.safe_load(cm["data"][c.GATEWAY_MODEL_KEY]))
    assert model.conductor.admission_rule.ttft_miss_risk == risk
    assert model.conductor.admission_rule.rule == "prediction"
    assert conductor_config(spec).admission_rule.ttft_miss_risk == risk


@pytest.mark.parametrize("value", [True, False])
def test_decode_calibration_reaches_the_gateway(value: bool) -> None:
    """spec.conductor.decodeCalibration (on unless set off): the gateway's Conductor
    learns the decode-step scale from relayed streams."""
    from mooncake_gateway.settings import ModelSettings

    ref, spec = example("simulated")
    assert spec.conductor.decode_calibration is True
    spec = spec.model_copy(update={"conductor": spec.conductor.model_copy(
        update={"decode_calibration": value})})
    cm = builders.gateway_configmap(ref, spec)
    model = ModelSettings.model_validate(yaml.safe_load(cm["data"][c.GATEWAY_MODEL_KEY]))
    assert model.conductor.decode_calibration.enabled is value


@pytest.mark.parametrize("risk", [0, 0.5, -0.1])
def test_ttft_miss_risk_out_of_range_is_refused_by_field(risk: float) -> None:
    from mooncake_operator.spec import ConductorSpec

    with pytest.raises(ValueError, match=r"ttftMissRisk|ttft_miss_risk"):
        ConductorSpec.model_validate({"ttftMissRisk": risk})


def test_spec_hash_changes_only_with_content() -> None:
    ref, spec = example("simulated")
    a = builders.gateway_configmap(ref, spec)
    b = builders.gateway_configmap(ref, spec)
    h = builders.SPEC_HASH_ANNOTATION
    assert a["metadata"]["annotations"][h] == b["metadata"]["annotations"][h]
    other = spec.model_copy(update={"gateway": spec.gateway.model_copy(
        update={"direct_below_tokens": 64})})
    assert builders.gateway_configmap(ref, other)["metadata"]["annotations"][h] != \
        a["metadata"]["annotations"][h]


def test_downward_file_round_trip_of_replicas() -> None:
    """What the controller writes is what the agent reads, through the kubelet's format."""
    from mooncake_contract.annotations import ReplicaSpec, format_replicas, go_quote, parse_replicas

    value = format_replicas([ReplicaSpec("ab", tokens=[1, 2, 3])])
    text = f"{c.ANNOTATION_REPLICAS}={go_quote(value)}\n"
    assert parse_replicas(parse_annotations(text)[c.ANNOTATION_REPLICAS])[0].tokens == [1, 2, 3]
