"""What SGLang makes of the pods, payloads and request bodies we generate (run by SGLang's
own interpreter; see ``_probe.py`` for the protocol). Checked on SGLang 0.5.23.

- ``cli``: a pod's engine container (arguments, environment) through ``ServerArgs``'s own
  parser, ``from_cli_args``, ``resolve_once`` and ``check_server_args`` (with ``--device
  cpu`` added: finding an accelerator is the one step that needs a GPU), the KV-events
  config class and, with HiCache on Mooncake, ``MooncakeStoreConfig.load_from_env``.
- ``pd``: the gateway's prefill and decode bodies through SGLang's OpenAI request classes
  and its own conversion to ``GenerateReqInput`` (where the bootstrap fields must arrive).
- ``events`` (live): SGLang's ``ZmqEventPublisher``, made by its factory from the pod's
  ``--kv-events-config``, publishes batches of SGLang's own event classes in every shape
  their annotations allow; the test's subscriber reads them.
- ``metrics``: every metric SGLang's scheduler, tokenizer, storage and radix-cache
  collectors define.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from _probe import Pod, each_pod, main, publish_on_command, stage, tiny_model

#: SGLang finds its accelerator while resolving arguments; there is none here
CPU = ["--device", "cpu"]


def _model_arg(args: list[str], model: str) -> list[str]:
    out = list(args)
    out[out.index("--model-path") + 1] = model
    return out


def _server_args(pod: Pod, model: str) -> Any:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = stage("parse", lambda: parser.parse_args(_model_arg(pod.args, model) + CPU))
    sa = stage("server_args", lambda: ServerArgs.from_cli_args(ns))
    stage("resolve", sa.resolve_once)
    stage("check", sa.check_server_args)
    return sa


def cli(req: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(with_tokenizer=True)
    return each_pod(req, lambda pod: _cli(pod, model))


def _cli(pod: Pod, model: str) -> dict[str, Any]:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.disaggregation.kv_events import KVEventsConfig
    from sglang.srt.environ import envs

    pod.apply_env()
    os.environ.pop("MC_FORCE_TCP", None)
    sa = _server_args(pod, model)
    cfg = resolving_view(sa)
    events = stage("kv_events", lambda: KVEventsConfig.from_cli(cfg.kv_events_config))
    out: dict[str, Any] = {
        "host": cfg.host, "port": cfg.port, "served_model_name": cfg.served_model_name,
        "page_size": cfg.page_size, "context_length": cfg.context_length,
        "tp_size": cfg.tp_size, "dp_size": cfg.dp_size,
        "enable_metrics": cfg.enable_metrics, "enable_cache_report": cfg.enable_cache_report,
        "disaggregation_mode": cfg.disaggregation_mode,
        "transfer_backend": cfg.disaggregation_transfer_backend,
        "bootstrap_port": cfg.disaggregation_bootstrap_port,
        "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
        "hicache_storage_backend": cfg.hicache_storage_backend,
        "kv_events": events.model_dump(),
        # what the transfer engine initialises with (mooncake_transfer_engine.py)
        "mooncake_protocol": envs.MOONCAKE_PROTOCOL.get(),
        "force_tcp": os.environ.get("MC_FORCE_TCP") == "1",
        "advertised_ip": _local_ip(),
    }
    if cfg.hicache_storage_backend == "mooncake":
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
            MooncakeStoreConfig,
        )

        store = stage("mooncake_store", MooncakeStoreConfig.load_from_env)
        out["mooncake_store"] = dict(vars(store))
    return out


def _local_ip() -> str:
    from sglang.srt.utils.network import get_local_ip_auto

    return str(get_local_ip_auto())


# -- P/D ------------------------------------------------------------------------------------
def pd(req: dict[str, Any]) -> dict[str, Any]:
    """Each body (the gateway's two halves, the relay's warm-up) through SGLang's OpenAI
    request class and its conversion to the internal ``GenerateReqInput`` (a stand-in
    tokenizer manager: the conversion reads its name)."""
    import types

    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    chat = bool(req.get("chat"))
    out: dict[str, Any] = {"fake_bootstrap_host": FAKE_BOOTSTRAP_HOST}
    sides = [s for s in ("prefill", "decode", "warm") if f"{s}_body" in req]
    for side in sides:
        body = req[f"{side}_body"]
        cls = ChatCompletionRequest if chat else CompletionRequest
        parsed = stage(f"{side}_request", lambda cls=cls, body=body: cls.model_validate(body))
        fields = {k: getattr(parsed, k) for k in ("bootstrap_host", "bootstrap_port",
                                                  "bootstrap_room")}
        entry: dict[str, Any] = {"request": fields, "stream": parsed.stream,
                                 "max_tokens": parsed.max_tokens}
        if not chat:
            tm = types.SimpleNamespace(server_args=None, served_model_name=parsed.model)
            tmpl = types.SimpleNamespace(completion_template_name=None)
            serving = OpenAIServingCompletion(tm, tmpl)
            gen, _ = stage(f"{side}_convert",
                           lambda s=serving, p=parsed: s._convert_to_internal_request(p, None))
            entry["internal"] = {k: getattr(gen, k) for k in ("bootstrap_host",
                                                             "bootstrap_port",
                                                             "bootstrap_room")}
        out[side] = entry
    return out


# -- KV events --------------------------------------------------------------------------------
def _batches() -> list[Any]:
    """SGLang's own event classes in every shape their annotations allow."""
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        StorageMedium,
    )

    lo, hi = -(1 << 63), (1 << 63) - 1  # block hashes are signed 64-bit ints
    stored = [
        BlockStored(block_hashes=[1, -2, hi], parent_block_hash=None,
                    token_ids=list(range(48)), block_size=16, lora_id=None),
        BlockStored(block_hashes=[11, 12], parent_block_hash=lo, token_ids=list(range(32)),
                    block_size=16, lora_id=7, medium=StorageMedium.GPU.value,
                    cache_salt="salt-1", session_id="session-1", lora_name="adapter-a"),
        BlockStored(block_hashes=[21], parent_block_hash=12, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium=StorageMedium.CPU.value),
        BlockStored(block_hashes=[31], parent_block_hash=None, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium=StorageMedium.DISK.value),
        BlockStored(block_hashes=[41], parent_block_hash=31, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium=StorageMedium.EXTERNAL.value),
    ]
    removed = [BlockRemoved(block_hashes=[1, -2]),
               BlockRemoved(block_hashes=[11], medium=StorageMedium.CPU.value),
               AllBlocksCleared()]
    return [KVEventBatch(ts=1.7e9 + i, events=evs, attn_dp_rank=rank)
            for i, (evs, rank) in enumerate([(stored[:2], None), (stored[2:], 5),
                                             (removed, None), ([], 0),
                                             (stored + removed, None)])]


def events(req: dict[str, Any]) -> dict[str, Any]:
    """SGLang's publisher, made by its factory from the pod's ``--kv-events-config``."""
    from sglang.srt.disaggregation.kv_events import (
        EventPublisherFactory,
        KVEventsConfig,
        StorageMedium,
    )

    args = Pod(req["pod"]).args
    raw = args[args.index("--kv-events-config") + 1]
    cfg = stage("kv_events", lambda: KVEventsConfig.from_cli(raw))
    pub = stage("publisher", lambda: EventPublisherFactory.create(raw, 0))
    return publish_on_command(pub, _batches(), {
        "endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint, "topic": cfg.topic,
        "media": sorted(m.value for m in StorageMedium)})


# -- metrics ---------------------------------------------------------------------------------
def metrics(req: dict[str, Any]) -> dict[str, Any]:
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase
    from sglang.srt.observability.metrics_collector import (
        RadixCacheMetricsCollector,
        SchedulerMetricsCollector,
        StorageMetricsCollector,
        TokenizerMetricsCollector,
        tokenizer_metric_labels,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish

    del REGISTRY  # the collectors register there; read from their own objects
    pod = Pod(req["pod"])
    pod.apply_env()
    sa = _server_args(pod, tiny_model(with_tokenizer=True))
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
    sched = stage("collectors", lambda: SchedulerMetricsCollector.init_new(
        server_args=sa, enable_priority_scheduling=False, enable_lora=False,
        enable_hierarchical_cache=True).collector)
    tok = TokenizerMetricsCollector(server_args=sa, labels=tokenizer_metric_labels())
    series: dict[str, dict[str, Any]] = {}
    for obj in (sched, tok, StorageMetricsCollector(labels={**sched.labels}),
                RadixCacheMetricsCollector(labels={**sched.labels})):
        for m in vars(obj).values():
            if isinstance(m, MetricWrapperBase):
                # the exposed sample name: counters gain _total (prometheus_client)
                name = m._name + ("_total" if m._type == "counter" else "")
                series[name] = {"type": m._type, "labels": sorted(m._labelnames)}
    return {"series": series}


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    main({"cli": cli, "pd": pd, "events": events, "metrics": metrics})
