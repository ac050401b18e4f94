"""The worker's one settings object.

Every tunable of the worker process lives here, with its default and meaning;
the CLI (:mod:`mooncake_worker.cli`) only maps flags onto these fields.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from mooncake_conductor.cost import CostModelConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Role(StrEnum):
    """What a worker is deployed as (informational for the engine; any role serves any
    request, ``kv_transfer_params`` decide the P/D behaviour)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


#: the real engines a relay fronts
EngineKind = Literal["vllm", "sglang"]


class WorkerSettings(BaseModel):
    """Settings of one worker process (simulated engine + pod agent)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- serving ---------------------------------------------------------------------------
    role: Role = Role.BOTH
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: pick a free one)")
    model: str = Field("llama3-70b-sim", min_length=1, description="served model name")
    max_model_len: int = Field(32768, gt=0, description="context window in tokens")
    default_max_tokens: int = Field(16, gt=0, description="max_tokens when a request omits it")
    max_running: int = Field(256, gt=0, description="sequences in the running batch at most")
    max_waiting: int = Field(1024, ge=0, description="queued requests at most; then 429")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with a 429")
    max_body_bytes: int = Field(64 << 20, gt=0, description="largest request body accepted")

    # -- engine model ----------------------------------------------------------------------
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    cache_tokens: int | None = Field(
        None, gt=0, description="KV cache capacity in tokens (default: the cost model's HBM)"
    )
    time_scale: float = Field(
        1.0, ge=0, description="multiplier on modelled times; 0 = never sleep"
    )
    chunked_prefill_tokens: int = Field(
        8192, ge=0, description="prefill tokens per engine step at most, shared by the "
        "prompts in it in arrival order, as vLLM's max_num_batched_tokens (its default for "
        "`vllm serve` on an 80 GB GPU other than an A100, the cost model's A800; 0: every "
        "admitted prompt whole in one step, which makes the first of a burst wait for the "
        "last)"
    )
    cost: CostModelConfig = CostModelConfig()
    warm_kernels: bool = Field(
        True, description="compile (or load from numba's cache) the block-key loop before "
        "serving, so the first long prompt does not wait for it (~0.4 s once cached)")
    prefill_noise: float = Field(
        0.0, ge=0, le=2, description="sigma of a per-request log-normal factor on prefill "
        "time (median 1): real prefills stray from any cost model (kernels, interference, "
        "runtime variance), so a scheduler's predictions are wrong by about this much; "
        "0: exactly the cost model")
    noise_seed: int = Field(0, description="seed of the prefill-noise draws")
    lora_name: str = Field("", description="LoRA name folded into the block-key namespace")
    cache_salt: str = Field("", description="salt folded into the block-key namespace")

    # -- KV events -------------------------------------------------------------------------
    kv_events_port: int | None = Field(None, ge=0, le=65535, description="ZMQ PUB port")
    kv_replay_port: int | None = Field(None, ge=0, le=65535, description="ZMQ ROUTER port")
    kv_events_host: str = Field("127.0.0.1", description="ZMQ bind address")
    kv_events_topic: str = Field("", description="topic frame (vLLM default: empty)")
    kv_buffer_steps: int = Field(10000, gt=0, description="batches kept for replay")
    kv_events_medium: str = Field("GPU", description="medium reported in events")

    # -- Mooncake Store --------------------------------------------------------------------
    store_master: str | None = Field(None, description="mooncake_master RPC address host:port")
    store_metadata: str | None = Field(None, description="metadata server URL")
    store_local_hostname: str = Field("127.0.0.1", description="transfer-engine address")
    store_protocol: str = Field("tcp", description="transfer protocol")
    store_segment_bytes: int = Field(64 << 20, gt=0, description="memory this worker lends")
    store_buffer_bytes: int = Field(16 << 20, gt=0, description="local transfer buffer")
    store_payload_scale: float = Field(
        1e-4, gt=0, le=1, description="stored bytes per block = tokens*kv_bytes_per_token*scale"
    )
    store_key_prefix: str = Field("kv/", description="prefix of block objects in the store")
    store_connect_timeout_s: float = Field(
        5.0, gt=0, description="give up starting when the store does not answer by then"
    )
    store_batch_blocks: int = Field(
        256, gt=0, description="most blocks in one store call; larger requests are split"
    )
    store_calls_in_flight: int = Field(
        4, gt=0, description="most store calls this client runs at once (its store threads)"
    )
    store_timeout_s: float = Field(
        5.0, gt=0, description="a request waits this long for one store call, then "
        "recomputes (the call may be stuck in the binding: a peer that stopped answering)"
    )

    # -- relay mode (in front of a real engine) --------------------------------------------
    engine_url: str | None = Field(None, description="real engine's HTTP base URL: relay mode")
    engine_kv_events: str | None = Field(None, description="real engine's KV-event PUB endpoint")
    engine_kv_replay: str | None = Field(None, description="real engine's replay endpoint")
    engine_kind: EngineKind = Field("vllm", description=(
        "relay mode: which engine it fronts (how a warm-up request is made)"))

    # -- pod agent -------------------------------------------------------------------------
    annotations_file: str | None = Field(None, description="downward-API annotations file")
    agent_poll_s: float = Field(1.0, gt=0, description="annotations file mtime poll period")
    agent_event_wait_s: float = Field(
        1.0, ge=0, description="relay mode: how long a warm-up waits for the engine's events"
    )
    agent_rewarm_s: float = Field(
        30.0, gt=0, description="relay mode: least seconds between warm-ups of one prefix"
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if (self.store_master is None) != (self.store_metadata is None):
            raise ValueError("--store and --store-metadata go together")
        if self.max_model_len < self.block_size:
            raise ValueError("max_model_len must be at least one block")
        return self

    @property
    def capacity_tokens(self) -> int:
        if self.cache_tokens is not None:
            return self.cache_tokens
        from mooncake_conductor.cost import CostModel

        return CostModel(self.cost).kv_capacity_tokens

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.capacity_tokens // self.block_size)

    @property
    def store_enabled(self) -> bool:
        return self.store_master is not None
