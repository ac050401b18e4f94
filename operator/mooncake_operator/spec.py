"""The ``MooncakeCluster`` API as typed models: the one source of the CRD's schema.

``crds/mooncake.io_mooncakeclusters.yaml`` is generated from these models by
:mod:`mooncake_operator.crd` (a test fails when the file drifts), so every field here
carries the description ``kubectl explain`` shows, its default and its bounds; rules
that span fields are CEL rules (``x-kubernetes-validations``) the API server checks,
each with a message and the field it points at.

Kept small on purpose (what Dynamo's and AIBrix's users complain about is the size of
full PodTemplateSpecs): per pool a handful of placement fields and a ``podOverrides``
block, not a pod template.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

from mooncake_conductor.decode import DECODE_SELECTORS
from mooncake_conductor.policies.registry import policy_names
from mooncake_contract.topology import MAX_LEVELS as MAX_TOPOLOGY_LEVELS
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel

#: Kubernetes resource.Quantity, as the API server's own schema spells it.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
#: Longest MooncakeCluster name: pod names add ``-prefill-<10-char revision>-<ordinal>``
#: and Service names must stay DNS-1035 labels (63 characters).
MAX_NAME_LENGTH = 40
#: Engine flags the operator sets itself; ``extraArgs`` may not repeat them.
OWNED_FLAGS = ("--host", "--port", "--model", "--model-path", "--served-model-name",
               "--block-size", "--page-size", "--max-model-len", "--kv-events-config",
               "--kv-transfer-config", "--kv-events-port", "--kv-replay-port",
               "--kv-events-host", "--annotations-file", "--role", "--store",
               "--store-metadata", "--engine-url", "--tensor-parallel-size", "--tp",
               "--disaggregation-mode", "--disaggregation-transfer-backend",
               "--disaggregation-bootstrap-port", "--hicache-storage-backend",
               "--context-length")
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
#: An engine release: ``0.33.0``, ``0.5.23``, ``0.6.0rc1``, ``0.9.2.post1``.
ENGINE_VERSION_PATTERN = r"^[0-9]+\.[0-9]+\.[0-9]+((\.post|rc|\.dev)[0-9]+)?$"


def owned_flags_regex(flags: tuple[str, ...]) -> str:
    """One regex matching each of ``flags`` (``--x`` or ``--x=...``) and nothing else,
    written short: the API server prices a CEL rule by its regex's length times the
    strings it may scan (64 arguments of up to 4096 characters) and refuses one over its
    budget. Flags are grouped by their first word: ``--model|--model-path`` becomes
    ``model(|-path)``."""
    groups: dict[str, list[str]] = {}
    for flag in flags:
        name = flag.removeprefix("--")
        word, dash, rest = name.partition("-")
        groups.setdefault(word, []).append(dash + rest)
    parts = [w + (f"({'|'.join(tails)})" if len(tails) > 1 else tails[0])
             for w, tails in groups.items()]
    return "^--(" + "|".join(parts) + ")(=|$)"


def _cel(rule: str, message: str, field_path: str | None = None,
         reason: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    if reason is not None:
        out["reason"] = reason
    return out


def _validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


#: An int-or-string quantity (``4``, ``"64Gi"``, ``"500m"``).
Quantity = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN,
                    "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
#: A quantity written as a string, so CEL's ``quantity()`` can compare it.
QuantityString = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
#: Free-form Kubernetes objects kept as given (affinity, topology spread constraints).
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
#: An int (number of pods) or a percentage of the pool (``"25%"``).
IntOrPercent = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "minimum": 1,
                    "pattern": r"^[1-9][0-9]*%$",
                    "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]


def quantity_bytes(q: int | str) -> int:
    """A Kubernetes quantity in bytes (rounded down); raises ValueError if malformed."""
    if isinstance(q, int):
        return q
    if not _QUANTITY_RE.match(q):
        raise ValueError(f"not a quantity: {q!r}")
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "m": 10**-3, "n": 10**-9, "u": 10**-6}
    for suffix in sorted(units, key=len, reverse=True):
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * units[suffix])
    return int(float(q))


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
    )


# -- model ------------------------------------------------------------------------------------
class ModelSpec(_Model):
    """The model every engine of the cluster serves."""

    name: str = Field(..., min_length=1, max_length=256, description=(
        "Model the engines load: a Hugging Face id or a path in the image "
        "(the simulated engine only uses it as a name)."))
    served_name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\w.:/-]+$",
                                    description=(
        "Name clients send in the OpenAI `model` field and the gateway routes by; "
        "defaults to name. Unique among the clusters one gateway serves."))
    block_size: int = Field(16, ge=1, le=1024, description=(
        "KV-cache block size in tokens. Engines and the gateway's prefix index must agree, "
        "or no prefix ever matches."))
    cache_salt: str = Field("", max_length=256, description=(
        "Salt folded into every block key: clusters (or tenants) with different salts "
        "never share cached prefixes."))
    hash_seed: str = Field("0", pattern=r"^[0-9]+$", max_length=10, description=(
        "PYTHONHASHSEED given to every engine of the cluster. Engines that share a "
        "Mooncake Store must hash blocks alike; engines that disagree hit 0%."))
    max_model_len: int = Field(32768, ge=16, le=10_000_000, description=(
        "Longest prompt plus output, in tokens, the engines and the gateway accept."))

    @property
    def served(self) -> str:
        return self.served_name or self.name


# -- engine -----------------------------------------------------------------------------------
class EngineKind(StrEnum):
    SIMULATED = "simulated"
    VLLM = "vllm"
    SGLANG = "sglang"


class EnginePorts(_Model):
    """Ports of the pod's OpenAI server and KV-event sockets (the worker's, in relay mode)."""

    http: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    kv_events: int = Field(5557, ge=1, le=65535, description="KV-event ZeroMQ PUB port.")
    kv_replay: int = Field(5558, ge=1, le=65535, description=(
        "KV-event replay (ZeroMQ ROUTER) port, for gap recovery."))
    engine_http: int = Field(8100, ge=1, le=65535, description=(
        "vllm/sglang only: the engine's own HTTP port inside the pod, behind the worker's "
        "relay."))


class SimulatedEngine(_Model):
    """Settings of the simulated engine (a calibrated stand-in for vLLM on LLaMA3-70B)."""

    time_scale: float = Field(1.0, gt=0, le=100, description=(
        "Wall seconds per modelled second: 1 runs in real time, 0.1 ten times faster. The "
        "gateway's Conductor runs its clock at the same scale."))
    cache_tokens: int | None = Field(None, ge=16, description=(
        "KV-cache capacity per engine in tokens (default: the cost model's HBM)."))
    max_running: int = Field(256, ge=1, le=100000, description=(
        "Largest running batch of one engine."))


class EngineSpec(_Model):
    """Which engine the prefill and decode pods run, and how."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("self.kind == 'simulated' || has(self.image)",
             "image is required for vllm and sglang engines", ".image"),
        _cel("self.extraArgs.all(a, !a.matches('" + owned_flags_regex(OWNED_FLAGS) + "'))",
             "extraArgs may not set flags the operator owns: " + ", ".join(OWNED_FLAGS),
             ".extraArgs"),
        _cel("[self.ports.http, self.ports.kvEvents, self.ports.kvReplay].all(p, "
             "[self.ports.http, self.ports.kvEvents, self.ports.kvReplay]"
             ".exists_one(q, q == p))",
             "ports.http, ports.kvEvents and ports.kvReplay must differ", ".ports"),
    ))

    kind: EngineKind = Field(EngineKind.SIMULATED, description=(
        "simulated (our worker, no GPU needed), vllm or sglang. Real engines run with the "
        "worker beside them as a relay and pod agent."))
    image: str | None = Field(None, min_length=1, max_length=512, description=(
        "Engine container image. Defaults to the worker image the operator is configured "
        "with (ghcr.io/mooncake-operator/worker) for simulated; required for vllm and "
        "sglang."))
    version: str | None = Field(None, pattern=ENGINE_VERSION_PATTERN, max_length=32,
                                description=(
        "vllm/sglang only: the engine release the image holds; the pods' flags, files and "
        "handshake follow it. Defaults to the version in the image tag "
        "(vllm/vllm-openai:v0.33.0). Supported: vllm 0.33.0, sglang 0.5.23 "
        "(docs/real-cluster.md); any other leaves the cluster Degraded (UnsupportedEngine)."))
    image_pull_policy: str | None = Field(None, pattern=r"^(Always|IfNotPresent|Never)$",
                                          description="Image pull policy of the engine.")
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64, description=(
            "Arguments appended to the engine's command line (changing them rolls both "
            "pools)."))
    ports: EnginePorts = Field(default_factory=EnginePorts, description="Ports in the pods.")
    simulated: SimulatedEngine = Field(default_factory=SimulatedEngine, description=(
        "Simulated-engine settings (ignored by vllm and sglang)."))


# -- pools ------------------------------------------------------------------------------------
class ResourceRequirements(_Model):
    """CPU and memory for the engine container (GPUs come from gpusPerReplica)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description=(
        "Requests by resource name, e.g. cpu: 8, memory: 64Gi."))
    limits: dict[str, Quantity] = Field(default_factory=dict, description=(
        "Limits by resource name."))


class Toleration(_Model):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = Field(None, max_length=316, description="Taint key to tolerate.")
    operator: str | None = Field(None, pattern=r"^(Exists|Equal)$",
                                 description="Exists or Equal (default Equal).")
    value: str | None = Field(None, max_length=63, description="Taint value (with Equal).")
    effect: str | None = Field(None, pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$",
                               description="Taint effect; empty matches all effects.")
    toleration_seconds: int | None = Field(None, description=(
        "How long a NoExecute taint is tolerated."))


class EnvVar(_Model):
    """An environment variable with a literal value."""

    name: str = Field(..., min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Variable name.")
    value: str = Field("", max_length=32768, description="Variable value ($(VAR) expands).")


class PodOverrides(_Model):
    """Small additions to the generated pods, instead of a whole pod template."""

    labels: dict[str, str] = Field(default_factory=dict, description=(
        "Extra pod labels (the operator's own labels win)."))
    annotations: dict[str, str] = Field(default_factory=dict, description=(
        "Extra pod annotations (the operator's own annotations win)."))
    env: list[EnvVar] = Field(default_factory=list, max_length=128, description=(
        "Extra environment variables for the engine container."))
    service_account_name: str | None = Field(None, max_length=253, description=(
        "Service account of the pods."))
    image_pull_secrets: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Names of image pull secrets.")


class PoolSpec(_Model):
    """One pool of engine pods (prefill or decode), each pod one engine instance."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("!has(self.resources) || !has(self.resources.limits) || "
             f"!('{DEFAULT_GPU_RESOURCE}' in self.resources.limits)",
             "set GPUs with gpusPerReplica, not in resources", ".resources"),
        _cel("!has(self.resources) || !has(self.resources.requests) || "
             f"!('{DEFAULT_GPU_RESOURCE}' in self.resources.requests)",
             "set GPUs with gpusPerReplica, not in resources", ".resources"),
    ))

    replicas: int = Field(1, ge=0, le=1024, description=(
        "Engine pods in the pool. The operator is the only writer: there is no scale "
        "subresource, each pool scales on its own."))
    gpus_per_replica: int = Field(1, ge=0, le=64, description=(
        "GPUs each pod requests (the nvidia.com/gpu resource); tensor parallelism of real "
        "engines follows it."))
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                             description="CPU and memory of the engine.")
    node_selector: dict[str, str] = Field(default_factory=dict, description=(
        "Node labels the pods require, e.g. a GPU pool label."))
    affinity: FreeForm = Field(default_factory=dict, description=(
        "core/v1 Affinity of the pods, as given."))
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description=(
        "Tolerations added to the GPU toleration the operator always sets."))
    topology_spread_constraints: list[FreeForm] = Field(
        default_factory=list, max_length=8, description=(
            "core/v1 TopologySpreadConstraints of the pods, as given."))
    priority_class_name: str | None = Field(None, max_length=253, description=(
        "PriorityClass of the pods."))
    pod_overrides: PodOverrides = Field(default_factory=PodOverrides, description=(
        "Labels, annotations, env and service account added to the pods."))


# -- store ------------------------------------------------------------------------------------
class StoreProtocol(StrEnum):
    TCP = "tcp"
    RDMA = "rdma"


class StoreMaster(_Model):
    """The Mooncake Store master (mooncake_master): a Deployment of one and its Service."""

    rpc_port: int = Field(50051, ge=1, le=65535, description="RPC port.")
    metrics_port: int = Field(9003, ge=1, le=65535, description="Metrics port.")
    lease_ttl_ms: int = Field(5000, ge=1, le=3_600_000, description=(
        "Lease of a stored object in milliseconds before it may be evicted or removed."))
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="CPU and memory of the master.")


class StoreSpec(_Model):
    """A Mooncake Store shared by the cluster's engines: its master, and on every selected
    node a store-node pod (a Mooncake Store client) lending memory to the pool."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("quantity(self.segmentSize).isLessThan(quantity(self.memoryLimit))",
             "segmentSize must be below memoryLimit (the store pod would be OOM-killed)",
             ".segmentSize"),
    ))

    enabled: bool = Field(True, description=(
        "Deploy a Mooncake Store and hand KV cache between prefill and decode through it."))
    image: str | None = Field(None, min_length=1, max_length=512, description=(
        "Image with mooncake_master and the store-node client (default: the worker image "
        "the operator is configured with)."))
    master: StoreMaster = Field(default_factory=StoreMaster, description="The store master.")
    segment_size: QuantityString = Field("4Gi", description=(
        "Memory each store node lends to the pool (its global segment); must be below "
        "memoryLimit."))
    memory_limit: QuantityString = Field("6Gi", description=(
        "Memory limit (and request) of each store-node pod."))
    protocol: StoreProtocol = Field(StoreProtocol.TCP, description="tcp or rdma transfers.")
    client_port: int = Field(50052, ge=1, le=65535, description=(
        "HTTP port (health, metrics) of each store-node pod."))
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"nvidia.com/gpu.present": "true"}, description=(
            "Nodes that run a store client (default: the GPU nodes)."))
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description=(
        "Tolerations added to the GPU toleration."))


# -- conductor --------------------------------------------------------------------------------
class SLOSpec(_Model):
    """Service-level objectives the Conductor schedules for."""

    ttft_seconds: float = Field(30.0, gt=0, le=3600, description=(
        "Time-to-first-token objective in seconds (the paper's 30 s by default)."))
    tbt_seconds: float = Field(0.1, gt=0, le=60, description=(
        "Time-between-tokens objective in seconds (the paper's 100 ms by default)."))


class HotPrefixSpec(_Model):
    """Hot-prefix replication: the operator's Conductor controller asks cooler prefill pods
    to hold copies of prefixes whose holders are overloaded (paper §4.2)."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("self.maxReplicas >= 2 || !self.enabled",
             "maxReplicas must be at least 2 to replicate anything", ".maxReplicas"),
    ))

    enabled: bool = Field(True, description="Replicate hot prefixes.")
    interval_seconds: float = Field(10.0, ge=1, le=3600, description=(
        "How often the controller re-plans."))
    min_rate_per_second: float = Field(0.05, gt=0, description=(
        "Accesses per second (decayed) from which a prefix is hot."))
    half_life_seconds: float = Field(60.0, gt=0, description="Access-rate decay half-life.")
    min_blocks: int = Field(2, ge=1, description="Shorter prefixes are not worth a copy.")
    load_ratio: float = Field(1.5, ge=1, description=(
        "A holder loaded past this multiple of the pool average makes a hot spot."))
    load_floor_seconds: float = Field(0.5, ge=0, description=(
        "Seconds of queue added to the average, so an idle pool never has hot spots."))
    max_replicas: int = Field(4, ge=1, le=64, description="Most copies of one prefix.")
    max_patches_per_interval: int = Field(4, ge=0, le=100, description=(
        "Pod annotation patches per interval at most (rate limit)."))
    max_annotation_bytes: int = Field(131072, ge=1024, le=245760, description=(
        "Largest replica annotation written on one pod (Kubernetes allows 256 KiB of "
        "annotations in all)."))


class CPPSpec(_Model):
    """Chunked pipeline prefill of long prompts over several prefill pods (paper §5.1)."""

    enabled: bool = Field(False, description=(
        "Needs an engine that runs one prefill across several instances; none of "
        "simulated, vllm and sglang does yet, so it cannot be enabled (the simulator models "
        "it)."))
    min_new_tokens: int = Field(2048, ge=0, description=(
        "Only prompts with at least this many uncached tokens would be split."))


class ConductorSpec(_Model):
    """The Conductor: the gateway's scheduling policy for this cluster, its SLOs and
    admission, and hot-prefix replication."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("!self.cpp.enabled",
             "chunked pipeline prefill needs an engine that runs it; none of simulated, "
             "vllm, sglang does yet", ".cpp.enabled"),
    ))

    policy: str = Field("conductor", description=(
        "Prefill policy by name: conductor (ours), kvcache-centric (the paper's "
        "Algorithm 1), or a peer's (dynamo-kv, llm-d, sglang-cache-aware, aibrix-conductor, "
        "...); see `mooncake-operator simulate --list-policies`."),
        json_schema_extra={"enum": list[Any](policy_names())})
    params: FreeForm = Field(default_factory=dict, description=(
        "The policy's parameters (weights, thresholds) by name; the operator checks them "
        "against the policy and reports unknown ones in status (Degraded)."))
    decode_selector: str | None = Field(None, description=(
        "Decode selection rule (default: the policy's own)."),
        json_schema_extra={"enum": list[Any](sorted(DECODE_SELECTORS))})
    admission: bool | None = Field(None, description=(
        "Reject (HTTP 429) requests predicted to miss an SLO; default: the policy's own."))
    shedding: bool | None = Field(None, description=(
        "With admission on, under overload reject (HTTP 429, overload) the requests that "
        "cost more GPU time than the average one first; default: the policy's own "
        "(conductor: on)."))
    holding: bool | None = Field(None, description=(
        "With admission on, a request refused only for decode room waits for room while "
        "it can still meet the TTFT objective, instead of an immediate HTTP 429; default: "
        "the policy's own (conductor with the tbt-lookahead decode selector: on)."))
    ttft_miss_risk: float | None = Field(None, gt=0, lt=0.5, description=(
        "With admission on, admit a request only if its chance of missing the TTFT "
        "objective, from the TTFT prediction error the gateway measures (answers to "
        "predictions of at least a tenth of the objective, their late side), is at most "
        "this (e.g. 0.01: a margin that keeps admitted requests within the SLO under "
        "overload, docs/results/reliability.md); unset: the predicted TTFT against the "
        "objective as is (the paper's rule)."))
    decode_calibration: bool = Field(True, description=(
        "Learn how much slower than the cost model the decode engines step, from the TBT "
        "each stream gets through the gateway, and predict decode steps that much slower: "
        "with admission on, requests whose TBT would miss are then held or refused "
        "(mooncake_conductor.calibration)."))
    overrun: bool | None = Field(None, description=(
        "A prefill still running past its predicted end gets a new expected end (from the "
        "prediction error measured so far) instead of its instance counting as free; "
        "default: the policy's own (conductor: on)."))
    slo: SLOSpec = Field(default_factory=SLOSpec, description="TTFT and TBT objectives.")
    hot_prefixes: HotPrefixSpec = Field(default_factory=HotPrefixSpec, description=(
        "Hot-prefix replication."))
    cpp: CPPSpec = Field(default_factory=CPPSpec, description="Chunked pipeline prefill.")


# -- gateway, rollout ---------------------------------------------------------------------------
class GatewaySpec(_Model):
    """How the operator's gateway exposes this cluster's model."""

    enabled: bool = Field(True, description=(
        "Serve the model through the operator's gateway (under model.servedName)."))
    direct_below_tokens: int = Field(0, ge=0, description=(
        "Prompts with fewer uncached tokens skip the prefill pool and go straight to "
        "decode (0: always disaggregate)."))
    default_max_tokens: int = Field(16, ge=1, description=(
        "max_tokens for requests that omit it."))


#: a namespace name (DNS-1123 label)
NAMESPACE_PATTERN = r"^[a-z0-9]$|^[a-z0-9][-a-z0-9]{0,61}[a-z0-9]$"


class NetworkPolicySpec(_Model):
    """Which pods may reach this cluster's pods: engines, workers and the store."""

    enabled: bool = Field(True, description=(
        "Admit traffic to the cluster's pods only from each other (KV transfer, the store) "
        "and from the gateway's pods, with a NetworkPolicy. Made only when the operator "
        "knows the gateway's pods (the chart tells it); enforced only by a network plugin "
        "that implements NetworkPolicy."))
    allowed_namespaces: list[Annotated[str, Field(pattern=NAMESPACE_PATTERN)]] = Field(
        default_factory=list, max_length=16, description=(
            "Namespaces whose pods may also reach every port, e.g. the one where Prometheus "
            "scrapes the engines."))


class RolloutSpec(_Model):
    """How a changed engine revision replaces the pods of both pools."""

    max_surge: IntOrPercent = Field("25%", description=(
        "New pods per pool added in one step, as a number or a percentage of the pool "
        "(at least 1); old pods leave once the gateway has registered their replacements."))
    drain_timeout_seconds: int = Field(300, ge=0, le=86400, description=(
        "Longest wait for a retiring pod's in-flight requests before it is deleted anyway."))


# -- topology -----------------------------------------------------------------------------------
#: A label key: an optional DNS-subdomain prefix and a name (Kubernetes' qualified name).
LABEL_KEY_PATTERN = (r"^([a-z0-9]+(-+[a-z0-9]+)*(\.[a-z0-9]+(-+[a-z0-9]+)*)*/)?"
                     r"[A-Za-z0-9]+([-_.]+[A-Za-z0-9]+)*$")


class TopologyLevel(_Model):
    """One level of the network: the node label naming a node's domain at this level, and
    the link between pods whose domains differ here (and agree on every coarser level)."""

    node_label: str = Field(..., max_length=317, pattern=LABEL_KEY_PATTERN, description=(
        "Node label whose value names the domain, e.g. nvidia.com/gpu.clique (NVLink "
        "domain), a rack label, or topology.kubernetes.io/zone."))
    gbits_per_second: float = Field(..., gt=0, le=1.0e5, description=(
        "Bandwidth of a KV transfer between pods in different domains of this level "
        "(Gbit/s, per transfer)."))
    latency_microseconds: float = Field(0.0, ge=0, le=1.0e7, description=(
        "Latency added once to each such transfer (µs)."))


class TopologySpec(_Model):
    """Where engines sit in the network, so KV transfers are charged by distance and the
    Conductor keeps a request's KV paths inside one domain when it can (paper §5.3).
    Pods in the same domain at every level use the engines' own NIC (the cost model's)."""

    levels: list[TopologyLevel] = Field(
        default_factory=list, max_length=MAX_TOPOLOGY_LEVELS, description=(
            "Levels, finest first (e.g. NVLink domain, rack, zone). Empty: a flat network."),
        json_schema_extra={"x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["nodeLabel"]})
    aware: bool = Field(True, description=(
        "Let the Conductor's choices use the topology (off: pods are still labelled, "
        "the choices ignore distance)."))

    @field_validator("levels")
    @classmethod
    def _distinct(cls, levels: list[TopologyLevel]) -> list[TopologyLevel]:
        seen: set[str] = set()
        for lv in levels:
            if lv.node_label in seen:
                raise ValueError(f"node label {lv.node_label!r} names two levels")
            seen.add(lv.node_label)
        return levels

    @property
    def node_labels(self) -> tuple[str, ...]:
        return tuple(lv.node_label for lv in self.levels)


# -- the whole spec -----------------------------------------------------------------------------
class MooncakeClusterSpec(_Model):
    """Desired state of a KV-cache-centric serving deployment: a model, its engine,
    prefill and decode pools, a Mooncake Store and the Conductor's policy."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("(self.prefill.replicas == 0) == (self.decode.replicas == 0)",
             "prefill and decode replicas must be both zero or both non-zero",
             ".decode.replicas"),
        _cel("self.engine.kind == 'simulated' || "
             "(self.prefill.gpusPerReplica >= 1 && self.decode.gpusPerReplica >= 1)",
             "vllm and sglang engines need at least one GPU per replica",
             ".prefill.gpusPerReplica"),
    ))

    model: ModelSpec = Field(..., description="The model served.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The engine.")
    prefill: PoolSpec = Field(default_factory=PoolSpec, description="The prefill pool.")
    decode: PoolSpec = Field(default_factory=PoolSpec, description="The decode pool.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="The Mooncake Store.")
    conductor: ConductorSpec = Field(default_factory=ConductorSpec, description=(
        "Scheduling policy, SLOs and hot-prefix replication."))
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description=(
        "How the model is exposed."))
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description=(
        "How changes roll through the pools."))
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Who may reach the cluster's pods.")
    topology: TopologySpec = Field(default_factory=TopologySpec, description=(
        "The network's levels, read from node labels, for topology-aware KV paths."))

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode


# -- status -------------------------------------------------------------------------------------
class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """A standard condition (metav1.Condition)."""

    type: str = Field(..., description="Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(..., description="True, False or Unknown.")
    reason: str = Field(..., description="CamelCase reason of the last transition.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str | None = Field(None, description=(
        "When status last changed (RFC 3339)."))
    observed_generation: int | None = Field(None, description=(
        "The spec generation this condition reflects."))


class PoolStatus(_Model):
    """Counts of one pool's pods."""

    desired: int = Field(0, description="Replicas asked for.")
    current: int = Field(0, description="Pods of any revision, not terminating.")
    ready: int = Field(0, description="Pods of the target revision that are Ready.")
    updated: int = Field(0, description="Pods of the target revision.")
    registered: int = Field(0, description=(
        "Pods of the target revision the gateway routes to (healthy and subscribed to "
        "their KV events)."))
    summary: str = Field("0/0", description="ready/desired, for kubectl get.")


class StoreStatus(_Model):
    """State of the Mooncake Store."""

    state: str = Field("Disabled", description="Ready, Pending, Degraded or Disabled.")
    master_ready: bool = Field(False, description="The master pod is Ready.")
    nodes_desired: int = Field(0, description="Store-node pods wanted by the DaemonSet.")
    nodes_ready: int = Field(0, description="Store-node pods Ready.")
    address: str = Field("", description="The master's Service address host:port.")


class GatewayStatus(_Model):
    """Where clients reach the model."""

    endpoint: str = Field("", description="Base URL of the OpenAI-compatible gateway.")
    model: str = Field("", description="Model name clients send.")
    reachable: bool = Field(False, description=(
        "The operator could read the gateway's registry at the last reconcile."))


class RolloutStatus(_Model):
    """An engine-revision rollout in progress (absent when none)."""

    revision: str = Field(..., description="Revision being rolled out.")
    step: int = Field(..., description="Current step (1-based).")
    steps: int = Field(..., description="Steps in all.")
    from_prefill: int = Field(..., description="Old prefill pods when the rollout began.")
    from_decode: int = Field(..., description="Old decode pods when the rollout began.")
    started_at: str = Field(..., description="When the rollout began (RFC 3339).")


class HotPrefixStatus(_Model):
    """A hot prefix the Conductor controller replicated."""

    prefix: str = Field(..., description="Prefix id (its last block key, hex).")
    blocks: int = Field(..., description="Blocks in the prefix.")
    rate_per_second: float = Field(..., description="Decayed accesses per second.")
    pods: list[str] = Field(default_factory=list, description=(
        "Pods asked to hold a replica (besides the pods that hold it on their own)."))


class MooncakeClusterStatus(_Model):
    """Observed state, written by the operator only."""

    observed_generation: int | None = Field(None, description=(
        "The spec generation the status reflects."))
    revision: str = Field("", description="Engine revision the pools are converging to.")
    conditions: list[Condition] = Field(default_factory=list, description=(
        "Ready, Progressing, Degraded."))
    prefill: PoolStatus = Field(default_factory=PoolStatus, description="Prefill pool.")
    decode: PoolStatus = Field(default_factory=PoolStatus, description="Decode pool.")
    store: StoreStatus = Field(default_factory=StoreStatus, description="Mooncake Store.")
    gateway: GatewayStatus = Field(default_factory=GatewayStatus, description="The gateway.")
    rollout: RolloutStatus | None = Field(None, description="The rollout in progress.")
    hot_prefixes: list[HotPrefixStatus] = Field(default_factory=list, description=(
        "Hot prefixes replicated now."))
    policy: str = Field("", description="Prefill policy in use.")
