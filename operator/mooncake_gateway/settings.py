"""The gateway's one settings object (YAML or JSON file, plus ``MOONCAKE_GATEWAY_*`` env).

Every tunable of the gateway process lives here with its default and meaning; the CLI
only loads the file. A model lists its prefill and decode endpoints (or gets them from
a Kubernetes label selector), the engine's block size and key namespace, the Conductor
policy with its parameters and SLOs, and the rule that skips disaggregation for short
uncached prompts.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from mooncake_conductor.engine import ConductorConfig
from mooncake_contract import conventions as c
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Parameters the gateway applies to the ``conductor`` policy unless the config sets them:
#: the simulated and vLLM workers cannot run chunked pipeline prefill or priority queues.
GATEWAY_CONDUCTOR_DEFAULTS: dict[str, Any] = {"cpp": {"enabled": False}, "priority_weight": 0.0}


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class TokenizerMode(StrEnum):
    LOCAL = "local"  # the worker's deterministic tokenizer, in-process
    ENGINE = "engine"  # POST /tokenize on an engine of the model


class Endpoint(BaseModel):
    """One engine: its HTTP base URL and, optionally, its KV-event sockets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(..., description="HTTP base URL, e.g. http://127.0.0.1:8100")
    kv_events: str | None = Field(None, description="ZMQ PUB endpoint, tcp://host:port")
    kv_replay: str | None = Field(None, description="ZMQ ROUTER replay endpoint")
    kv_topic: str = Field("", description="topic frame to subscribe to")
    name: str = Field("", description="display name (default: the URL)")
    pod: str = Field("", description="the pod serving it, namespace/name (Kubernetes)")
    revision: str = Field(
        "", description="engine revision (the pod's mooncake.io/revision label): while a "
        "model's routable instances span several, prefill and decode are paired by it",
    )
    draining: bool = Field(
        False, description="no new requests (the pod's mooncake.io/drain annotation); "
        "requests in flight finish",
    )
    topology: dict[str, str] = Field(
        default_factory=dict, description="where the engine sits in the network: each "
        "topology level's node label and its value (the pod's mooncake.io/topology "
        "annotation); read against the Conductor's topology levels")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return v.rstrip("/")

    @property
    def label(self) -> str:
        return self.name or self.url


class KubernetesSource(BaseModel):
    """Find a model's engines as pods: label selector per role, ports from annotations."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = "default"
    prefill_selector: str = Field(..., description="label selector of prefill pods")
    decode_selector: str = Field(..., description="label selector of decode pods")
    http_port: int = Field(c.PORT_HTTP, gt=0, le=65535, description="default HTTP port")
    kv_events_port: int | None = Field(c.PORT_KV_EVENTS, gt=0, le=65535)
    kv_replay_port: int | None = Field(c.PORT_KV_REPLAY, gt=0, le=65535)
    http_port_annotation: str = c.ANNOTATION_HTTP_PORT
    kv_events_port_annotation: str = c.ANNOTATION_KV_EVENTS_PORT
    kv_replay_port_annotation: str = c.ANNOTATION_KV_REPLAY_PORT
    kv_topic_annotation: str = c.ANNOTATION_KV_TOPIC
    drain_annotation: str = c.ANNOTATION_DRAIN
    topology_annotation: str = c.ANNOTATION_TOPOLOGY
    revision_label: str = c.LABEL_REVISION
    watch_timeout_s: int = Field(300, gt=0, description="server-side watch timeout")


class KubernetesModels(BaseModel):
    """Serve the models the operator describes in ConfigMaps (one per MooncakeCluster):
    each labelled ConfigMap holds a :class:`ModelSettings` document under ``key``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str | None = Field(None, description="where to look; None: every namespace")
    label_selector: str = Field(
        f"{c.LABEL_GATEWAY_MODEL}=true", description="label selector of the ConfigMaps")
    key: str = Field(c.GATEWAY_MODEL_KEY, description="data key of the model document")
    watch_timeout_s: int = Field(300, gt=0, description="server-side watch timeout")


class DirectRule(BaseModel):
    """Skip disaggregation: a prompt with fewer uncached tokens goes straight to decode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uncached_tokens_below: int = Field(
        0, ge=0, description="threshold in tokens; 0 disables the rule"
    )


#: the handshakes :mod:`mooncake_gateway.handshake` implements (a test holds them equal)
HandshakeName = Literal["kv-transfer-params", "store", "bootstrap"]


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, description="model name clients send")
    block_size: int = Field(16, gt=0, description="the engines' KV block size in tokens")
    lora_name: str = Field("", description="LoRA name in the block-key namespace")
    cache_salt: str = Field("", description="cache salt in the block-key namespace")
    max_model_len: int = Field(131072, gt=0, description="longest prompt + output accepted")
    default_max_tokens: int = Field(16, gt=0, description="max_tokens when a request omits it")
    conductor: ConductorConfig = ConductorConfig()
    prefill: list[Endpoint] = Field(default_factory=list)
    decode: list[Endpoint] = Field(default_factory=list)
    kubernetes: KubernetesSource | None = None
    endpoints_file: str | None = Field(
        None, description="YAML/JSON file {prefill: [...], decode: [...]} re-read on change "
        "(e.g. a mounted ConfigMap); replaces the lists above",
    )
    time_scale: float | None = Field(
        None, gt=0, description="wall seconds per modelled second of this model's engines "
        "(their --time-scale; default: the gateway's time_scale): the model's Conductor runs "
        "its clock at wall / time_scale")
    direct: DirectRule = DirectRule()
    handshake: HandshakeName = Field(
        "kv-transfer-params", description="how the prefill's KV cache reaches the decode "
        "engine (mooncake_gateway.handshake): kv-transfer-params (vLLM's MooncakeConnector, "
        "the simulated engine), store (vLLM's MooncakeStoreConnector), bootstrap (SGLang)")
    bootstrap_port: int | None = Field(
        None, gt=0, le=65535, description="the prefill engines' Mooncake bootstrap port "
        "(default: the worker's HTTP port, where the simulated engine answers)")
    index_capacity_blocks: int = Field(
        1 << 20, gt=0, description="index capacity per instance until its metrics tell"
    )

    @model_validator(mode="before")
    @classmethod
    def _conductor_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            cond = dict(data.get("conductor") or {})
            if cond.get("policy", "conductor") == "conductor":
                params = dict(GATEWAY_CONDUCTOR_DEFAULTS)
                params.update(cond.get("params") or {})
                cond["params"] = params
            data = {**data, "conductor": cond}
        return data


class AuthSettings(BaseModel):
    """Where the API keys live and what each may spend (``GatewaySettings.auth``; the
    rules are in ``auth.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys_dir: Path | None = Field(
        None, description="directory of API keys, one file per key (a mounted Secret); "
        "None with admin_keys_dir None: no key is asked for")
    admin_keys_dir: Path | None = Field(
        None, description="directory of admin keys: these may also call /conductor/*")
    reload_s: float = Field(10.0, gt=0, description="read the key directories again at "
                            "most this often (rotation without a restart)")
    requests_per_minute: float = Field(0.0, ge=0, description="requests per key per minute "
                                       "(0: no limit)")
    tokens_per_minute: float = Field(0.0, ge=0, description="prompt + max_tokens per key per "
                                     "minute (0: no limit)")

    @property
    def enabled(self) -> bool:
        return self.keys_dir is not None or self.admin_keys_dir is not None


class PeerSettings(BaseModel):
    """The other replicas of this gateway, whose in-flight load each adds to its own
    (``GatewaySettings.peers``; the rule is in ``mooncake_conductor/peerload.py``, the
    exchange in ``peers.py``). No peers: each replica sees only its own requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(default_factory=list, description="fixed peers' base URLs")
    pod_selector: str | None = Field(
        None, description="label selector of the gateway's pods (Kubernetes): every "
        "running one but this pod is a peer")
    namespace: str | None = Field(None, description="the namespace of those pods")
    port: int = Field(8080, gt=0, le=65535, description="the peers' gateway port")
    pod_name: str | None = Field(None, description="this pod's name (it is not a peer)")
    interval_s: float = Field(0.05, gt=0, description="how often each peer is asked")
    timeout_s: float = Field(0.5, gt=0, description="one ask's limit")
    stale_s: float = Field(2.0, gt=0, description="a report older than this counts nothing")
    watch_timeout_s: int = Field(300, gt=0, description="pod watch length before a re-list")

    @property
    def enabled(self) -> bool:
        return bool(self.urls) or self.pod_selector is not None


class GatewaySettings(BaseSettings):
    """Settings of one gateway process."""

    model_config = SettingsConfigDict(
        extra="forbid", env_prefix="MOONCAKE_GATEWAY_", env_nested_delimiter="__"
    )

    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port (0: pick a free one)")
    models: list[ModelSettings] = Field(default_factory=list)
    tokenizer: TokenizerMode = TokenizerMode.LOCAL
    tokenize_cache_entries: int = Field(
        4096, ge=0, description="cached tokenizations (chat messages, prompts)"
    )
    time_scale: float = Field(
        1.0, gt=0, description="wall seconds per modelled second of the engines "
        "(their --time-scale); the Conductor's clock runs at wall / time_scale",
    )
    health_interval_s: float = Field(1.0, gt=0, description="health-check period")
    health_timeout_s: float = Field(2.0, gt=0, description="health-check timeout")
    unhealthy_after: int = Field(3, gt=0, description="failed checks before marked down")
    metrics_interval_s: float = Field(2.0, gt=0, description="engine /metrics scrape period")
    connect_timeout_s: float = Field(5.0, gt=0, description="engine connect timeout")
    request_timeout_s: float = Field(600.0, gt=0, description="whole upstream request limit")
    prefill_attempts: int = Field(3, gt=0, description="prefill tries on distinct instances")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds with a 429")
    prefill_dispatch_depth: int = Field(
        0, ge=0, description="late binding: with work stealing on (the Conductor's "
        "stealing; on for conductor), prefills sent to one prefill engine at a time, the "
        "rest of its queue waiting in the gateway, where an instance that goes idle can "
        "take it (e.g. 1); 0, the default: every prefill is sent at once, nothing is stolen",
    )
    max_body_bytes: int = Field(64 << 20, gt=0, description="largest request body")
    max_buffered_bytes: int = Field(
        256 << 20, gt=0, description="request bodies held at once, every connection "
        "together; a body that does not fit is refused (503, Retry-After) before it is read "
        "(bodies.py). At least max_body_bytes")
    auth: AuthSettings = Field(default_factory=AuthSettings,
                               description="API keys and per-key limits (auth.py)")
    peers: PeerSettings = Field(default_factory=PeerSettings,
                                description="other replicas sharing their in-flight load")
    decisions_kept: int = Field(1000, gt=0, description="recent decisions kept for inspection")
    explain_top: int = Field(5, gt=0, description="candidates shown per explained decision")
    replay_timeout_s: float = Field(2.0, gt=0, description="KV-event replay request timeout")
    discovery_poll_s: float = Field(1.0, gt=0, description="endpoints_file poll period")
    hot_prefixes_max: int = Field(100, gt=0, description="longest /conductor/hot-prefixes list")
    hot_tokens_prefixes: int = Field(
        256, ge=0, description="prefixes whose token ids are kept for "
        "/conductor/hot-prefixes?tokens=1 (LRU, per model; 0: none)",
    )
    hot_tokens_max: int = Field(
        1 << 21, ge=0, description="token ids kept in all for hot prefixes, per model "
        "(8 bytes each; the least recently used prefixes go first)",
    )
    hot_tokens_rate_share: float = Field(
        0.5, gt=0, le=1, description="a prefix's token ids are kept once its access rate "
        "reaches this share of the hot threshold (conductor.replication.min_rate_per_s)",
    )
    kubernetes_models: KubernetesModels | None = Field(
        None, description="also serve the models described by ConfigMaps (list + watch); "
        "None: only the models above",
    )
    model_swap_timeout_s: float = Field(
        10.0, gt=0, description="when a model's document changes what needs a new runtime "
        "(block size, endpoints, ...), the old one serves until the new one's instances are "
        "registered or failed a check, at most this long",
    )
    registry_chunk_keys: int = Field(
        1 << 16, gt=0, description="index entries counted between event-loop yields when "
        "/conductor/registry computes unique_blocks",
    )
    uvloop: bool = Field(
        True, description="run on uvloop's event loop when it is installed (false: asyncio's)"
    )
    gc_freeze: bool = Field(
        True, description="once started (imports, compiled kernels, indexes and endpoints "
        "in place), move every object alive to the garbage collector's permanent "
        "generation (gc.freeze): full collections then skip the ~200k start-up objects and "
        "the index's tables instead of pausing the loop for tens of milliseconds",
    )
    warm_kernels: bool = Field(
        True, description="compile (or load from numba's cache) the core's compiled loops "
        "at startup, so the first long prompt or large index does not pay for it "
        "mid-request (~1 s once cached, a few seconds the first time)",
    )
    lean_upstream: bool = Field(
        True, description="non-streamed engine calls over the gateway's own keep-alive "
        "HTTP/1.1 client (http:// engines); false: aiohttp's client for every call",
    )
    fast_front: bool = Field(
        True, description="serve plain non-streamed completion requests on the gateway's own "
        "HTTP/1.1 front end (everything else still goes through aiohttp's server)",
    )
    front_idle_s: float = Field(
        75.0, gt=0, description="idle seconds after which the front end closes a client's "
        "keep-alive connection (aiohttp's default)",
    )
    upstream_keepalive_s: float = Field(
        2.0, gt=0, description="idle seconds after which a pooled engine connection is not "
        "reused (below the engines' own keep-alive: uvicorn closes after 5 s)",
    )

    @model_validator(mode="after")
    def _buffer_holds_a_body(self) -> GatewaySettings:
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes}): such a body could never "
                             "be served")
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> GatewaySettings:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique: {sorted(dup)}")
        return self

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> GatewaySettings:
        """Load YAML or JSON (by content), then apply ``overrides``."""
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
