"""What vLLM makes of the pods, payloads and request bodies we generate (run by vLLM's
own interpreter; see ``_probe.py`` for the protocol). Checked on vLLM 0.33.

- ``cli``: a pod's engine container (arguments, environment, mounted files) through the
  real ``vllm serve`` parser, ``EngineArgs`` and ``create_engine_config`` (CPU platform:
  no GPU here), the KV connector registry, ``MooncakeStoreConfig.load_from_config`` and
  vLLM's own environment readers.
- ``pd``: the gateway's prefill and decode bodies through vLLM's OpenAI request classes
  into engine ``Request`` objects, driven through ``MooncakeConnector``'s scheduler side
  on the producer's and the consumer's own configurations (from their pods).
- ``events`` (live): vLLM's ``ZmqEventPublisher``, made from the pod's
  ``--kv-events-config``, publishes batches of vLLM's own event classes in every shape
  their annotations allow; the test's subscriber reads them.
- ``metrics``: every metric vLLM's ``PrometheusStatLogger`` defines.
- ``batch_defaults``: the step budget and running cap ``vllm serve`` defaults to on a
  given GPU (``EngineArgs.get_batch_defaults``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from _probe import Pod, each_pod, main, publish_on_command, stage, tiny_model


def _cpu_platform() -> None:
    """No GPU here: vLLM's config classes refuse to infer a device unless the platform is
    set before the rest of vLLM is imported."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()


def _parse(pod: Pod, model: str) -> Any:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    sub = root.add_subparsers(dest="subparser", required=False)
    ServeSubcommand().subparser_init(sub)
    args = [model, *pod.args[1:]]  # the model is the first positional: ours is tiny
    ns = stage("parse", lambda: root.parse_args(["serve", *args]))
    ns.model = ns.model_tag  # what `vllm serve` does before building EngineArgs
    return ns


def _config(pod: Pod, model: str) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs

    ns = _parse(pod, model)
    engine_args = stage("engine_args", lambda: EngineArgs.from_cli_args(ns))
    return ns, stage("config", engine_args.create_engine_config)


def cli(req: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(with_tokenizer=False)
    return each_pod(req, lambda pod: _cli(pod, model))


def _cli(pod: Pod, model: str) -> dict[str, Any]:
    import vllm.envs as envs
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.utils.network_utils import get_ip

    pod.apply_env()
    ns, vc = _config(pod, model)
    out: dict[str, Any] = {
        "host": ns.host, "port": ns.port, "served_model_name": ns.served_model_name,
        "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
        "block_size": vc.cache_config.block_size,
        "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
        "max_model_len": vc.model_config.max_model_len,
        "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
        "data_parallel_size": vc.parallel_config.data_parallel_size,
        "kv_events": dataclasses.asdict(vc.kv_events_config),
        "advertised_ip": get_ip(),
        "bootstrap_port": envs.VLLM_MOONCAKE_BOOTSTRAP_PORT,
    }
    ktc = vc.kv_transfer_config
    if ktc is not None:
        cls = stage("connector", lambda: KVConnectorFactory.get_connector_class(ktc))
        out["kv_transfer"] = {
            "kv_connector": ktc.kv_connector, "kv_role": ktc.kv_role,
            "engine_id": ktc.engine_id,
            "extra_config": dict(ktc.kv_connector_extra_config),
            "registered": ktc.kv_connector in KVConnectorFactory._registry,
            "class": f"{cls.__module__}.{cls.__qualname__}",
        }
    if "MOONCAKE_CONFIG_PATH" in os.environ:
        from vllm.distributed.mooncake_store import MooncakeStoreConfig

        store = stage("mooncake_store", MooncakeStoreConfig.load_from_config)
        out["mooncake_store"] = dataclasses.asdict(store)
    return out


# -- P/D ------------------------------------------------------------------------------------
class _Side:
    """One engine's scheduler-side connector and KV-cache manager, from its pod."""

    def __init__(self, pod: Pod, model: str) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )

        pod.apply_env()
        _, self.vc = _config(pod, model)
        mc = self.vc.model_config
        bs = self.vc.cache_config.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=mc.get_total_num_kv_heads(),
                                 head_size=mc.get_head_size(), dtype=torch.bfloat16)
        layers = [f"model.layers.{i}.self_attn.attn"
                  for i in range(mc.get_num_layers(self.vc.parallel_config))]
        kcc = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
        self.conn = stage("connector", lambda: KVConnectorFactory.create_connector(
            self.vc, KVConnectorRole.SCHEDULER, kcc))
        self.mgr = KVCacheManager(kcc, mc.max_model_len, bs, bs, enable_caching=True)
        hash_fn = get_hash_fn_by_name(self.vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(bs, hash_fn)
        self.n = 0

    def request(self, body: dict[str, Any], chat: bool, tokens: list[int]
                ) -> tuple[Any, Any]:
        """The engine ``Request`` vLLM's OpenAI server makes of ``body`` (whose prompt
        renders to ``tokens``: no chat template or tokenizer runs here)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.v1.request import Request

        cls = ChatCompletionRequest if chat else CompletionRequest
        parsed = stage("request", lambda: cls.model_validate(body))
        defaults = self.vc.model_config.get_diff_sampling_param()
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        sp = stage("sampling", lambda: parsed.to_sampling_params(max_tokens, defaults))
        self.n += 1
        return parsed, Request(request_id=f"probe-{self.n}", prompt_token_ids=list(tokens),
                               sampling_params=sp, pooling_params=None,
                               block_hasher=self.hasher)

    def schedule(self, req: Any) -> tuple[int, bool, Any]:
        """One pass of the v1 scheduler over a waiting request, as far as the connector
        sees it (``Scheduler.schedule``: computed blocks, matched tokens, allocation)."""
        from vllm.v1.core.sched.output import SchedulerOutput

        self.conn.on_new_request(req)
        computed, local, _ = self.mgr.get_computed_blocks(req)
        ext, load_async = self.conn.get_num_new_matched_tokens(req, local)
        new = 0 if load_async else req.num_tokens - local - ext
        self.mgr.allocate_slots(req, new, local, computed, num_external_computed_tokens=ext,
                                delay_cache_blocks=load_async)
        self.conn.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), ext)
        return ext, load_async, self.conn.build_connector_meta(SchedulerOutput.make_empty())


def pd(req: dict[str, Any]) -> dict[str, Any]:
    """The prefill body on the producer, then the decode body on the consumer."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import RequestStatus

    model = tiny_model(with_tokenizer=False)
    chat = bool(req.get("chat"))
    producer = _Side(Pod(req["producer"]), model)
    tokens = req["prompt_token_ids"]
    parsed, preq = producer.request(req["prefill_body"], chat, tokens)
    ext, _, meta = producer.schedule(preq)
    # the one-token prefill ends capped by max_tokens
    preq.num_computed_tokens = preq.num_tokens
    preq.append_output_token_ids(5)
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held, returned = producer.conn.request_finished_all_groups(
        preq, producer.mgr.get_block_ids(preq.request_id))
    after = producer.conn.build_connector_meta(SchedulerOutput.make_empty())
    out: dict[str, Any] = {
        "producer": {
            "engine_id": producer.conn.engine_id,
            "data_parallel_size": producer.vc.parallel_config.data_parallel_size,
            "request_params": parsed.kv_transfer_params,
            "max_tokens": preq.sampling_params.max_tokens,
            "to_send": {r: t for r, (t, _) in after.reqs_to_send.items()},
            "holds_blocks": held,
            "returned_params": returned,
        }}
    consumer = _Side(Pod(req["consumer"]), model)
    parsed, dreq = consumer.request(req["decode_body"], chat, tokens)
    ext, load_async, meta = consumer.schedule(dreq)
    pulls = [dict(engine=engine, transfer_id=p.transfer_id,
                  remote_engine_id=p.remote_engine_id,
                  remote_bootstrap_addr=p.remote_bootstrap_addr)
             for engine, by_req in meta.reqs_to_recv.items() for p in by_req.values()]
    out["consumer"] = {"request_params": parsed.kv_transfer_params,
                       "external_tokens": ext, "load_async": load_async,
                       "prompt_tokens": dreq.num_prompt_tokens, "pulls": pulls}
    return out


def model(req: dict[str, Any]) -> dict[str, Any]:
    """The tiny model with random weights in ``req["dir"]`` (for a real run on a GPU)."""
    return {"dir": tiny_model(with_tokenizer=True, weights=True, out=req["dir"])}


def store_reads(req: dict[str, Any]) -> dict[str, Any]:
    """Which modules of the store connector's package read ``kv_transfer_params`` (the
    request field a P2P handshake would fill): their source, as installed."""
    import importlib
    import pkgutil

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class_by_name("MooncakeStoreConnector")
    package = importlib.import_module(cls.__module__.rsplit(".", 1)[0])
    modules, reading = [], []
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        modules.append(name)
        with open(spec.origin) as fh:
            if "kv_transfer_params" in fh.read():
                reading.append(name)
    return {"modules": modules, "reading": reading}


# -- KV events --------------------------------------------------------------------------------
def _batches() -> list[Any]:
    """vLLM's own event classes in every shape their annotations allow."""
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        MEDIUM_GPU,
        MEDIUM_STORAGE,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    def digest(n: int) -> bytes:  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests
        return n.to_bytes(32, "big")

    top = (1 << 64) - 1  # an unsigned 64-bit hash past the signed range
    stored = [
        BlockStored(block_hashes=[111, top], parent_block_hash=None,
                    token_ids=list(range(32)), block_size=16, lora_id=None,
                    medium=MEDIUM_GPU, lora_name=None),
        BlockStored(block_hashes=[digest(1), digest(2)], parent_block_hash=digest(0),
                    token_ids=list(range(32, 64)), block_size=16, lora_id=7,
                    medium=MEDIUM_CPU, lora_name="adapter-a",
                    extra_keys=[("adapter-a", ("mm-0f3a", 0), "salt-1", b"\x01\x02"), None],
                    group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=4096, locality="LOCAL",
                    ownership="tier-1", session_id="session-1",
                    lookahead_token_ids=[[64, 65], [80, 81]]),
        BlockStored(block_hashes=[333], parent_block_hash=top, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium=None, lora_name=None,
                    extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention",
                    locality="REMOTE", lookahead_token_ids=[[]]),
        BlockStored(block_hashes=[444], parent_block_hash=333, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium=MEDIUM_STORAGE, lora_name=None,
                    extra_keys=[()], lookahead_token_ids=None),
    ]
    removed = [
        BlockRemoved(block_hashes=[111], medium=MEDIUM_GPU),
        BlockRemoved(block_hashes=[digest(1), 222], medium=None, group_idx=1,
                     locality="LOCAL", ownership="tier-1"),
        BlockRemoved(block_hashes=[digest(2)], medium=MEDIUM_STORAGE),
        AllBlocksCleared(),
    ]
    return [KVEventBatch(ts=1.7e9 + i, events=evs, data_parallel_rank=rank)
            for i, (evs, rank) in enumerate([(stored[:2], None), (stored[2:], 3),
                                             (removed, None), ([], 0),
                                             (stored + removed, None)])]


def events(req: dict[str, Any]) -> dict[str, Any]:
    """vLLM's publisher, made as its scheduler makes it from the pod's config."""
    import vllm.distributed.kv_events as ke

    pod = Pod(req["pod"])
    cfg = _parse(pod, tiny_model(with_tokenizer=False)).kv_events_config
    pub = stage("publisher", lambda: ke.EventPublisherFactory.create(cfg, data_parallel_rank=0))
    media = sorted({getattr(ke, n) for n in dir(ke) if n.startswith("MEDIUM_")})
    return publish_on_command(pub, _batches(), {
        "endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint, "topic": cfg.topic,
        "media": media})


# -- scheduler defaults ----------------------------------------------------------------------
def batch_defaults(req: dict[str, Any]) -> dict[str, Any]:
    """For each of ``req["devices"]`` (``memory_bytes``, ``device_name``, ``capability``,
    ``world_size``): the step budget (``max_num_batched_tokens``) and running cap
    (``max_num_seqs``) that ``vllm serve`` picks when neither is set. That is
    ``EngineArgs.get_batch_defaults`` itself, with the platform's answers about the device
    given (no GPU here)."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.usage.usage_lib import UsageContext

    server = UsageContext.OPENAI_API_SERVER
    saved = arg_utils.current_platform
    out = []
    try:
        for dev in req["devices"]:
            arg_utils.current_platform = _Gpu(dev)
            world = int(dev["world_size"])
            tokens, seqs = stage("batch_defaults", lambda w=world: arg_utils.EngineArgs
                                 .get_batch_defaults(world_size=w))
            out.append({"max_num_batched_tokens": tokens[server], "max_num_seqs": seqs[server]})
    finally:
        arg_utils.current_platform = saved
    return {"defaults": out}


class _Gpu:
    """What vLLM's platform would say about one GPU (the questions get_batch_defaults asks)."""

    def __init__(self, dev: dict[str, Any]) -> None:
        self.dev = dev
        self.capability = tuple(dev["capability"])

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(self.dev["memory_bytes"])

    def get_device_name(self, device_id: int = 0) -> str:
        return str(self.dev["device_name"])

    def is_device_capability(self, cap: Any, device_id: int = 0) -> bool:
        major, minor = self.capability
        return bool(cap == self.capability or cap == major * 10 + minor)

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


# -- metrics ---------------------------------------------------------------------------------
def metrics(req: dict[str, Any]) -> dict[str, Any]:
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    pod = Pod(req["pod"])
    pod.apply_env()
    _, vc = _config(pod, tiny_model(with_tokenizer=False))
    vc.cache_config.num_gpu_blocks = 1000  # set by the engine after profiling memory
    logger = stage("logger", lambda: PrometheusStatLogger(vc, engine_indexes=[0]))
    logger.log_engine_initialized()
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=1, kv_cache_usage=0.5,
                           prefix_cache_stats=PrefixCacheStats(requests=1, queries=32,
                                                               hits=16))
    it = IterationStats()
    it.time_to_first_tokens_iter.append(0.1)
    it.inter_token_latencies_iter.append(0.01)
    logger.record(scheduler_stats=stats, iteration_stats=it, engine_idx=0)
    series: dict[str, dict[str, Any]] = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name.startswith("vllm:") and not s.name.endswith("_created"):
                entry = series.setdefault(s.name, {"type": fam.type, "labels": set()})
                entry["labels"] |= set(s.labels) - {"le"}
    return {"series": {k: {"type": v["type"], "labels": sorted(v["labels"])}
                       for k, v in series.items()}}


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    _cpu_platform()
    main({"cli": cli, "pd": pd, "events": events, "metrics": metrics,
          "store_reads": store_reads, "model": model, "batch_defaults": batch_defaults})
