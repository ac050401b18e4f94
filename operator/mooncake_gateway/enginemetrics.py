"""The engine series the gateway reads from each instance's ``/metrics``, per engine.

Names are the engines' own (``tests/conformance`` checks each against that release's
metric definitions): vLLM 0.33's ``PrometheusStatLogger`` and SGLang 0.5.23's scheduler
and tokenizer collectors. Our simulated engine and our worker's relay in front of a real
one expose the engine's names unchanged.

- load: requests running and waiting (vLLM sums its data-parallel engines; SGLang's
  scheduler gauges may repeat per tensor-parallel rank, so their largest counts);
- cache: KV-cache usage as a fraction (the fullest engine), prompt tokens served from
  the prefix cache and prompt tokens asked (counters);
- shape: the block size and the number of KV blocks, where the engine tells them.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass

from .instances import EngineStats

SUM, MAX = "sum", "max"


@dataclass(frozen=True, slots=True)
class Series:
    field: str
    reduce: str = SUM


#: name -> which EngineStats field it feeds, and how label sets combine
SERIES: dict[str, Series] = {
    # vLLM (vllm/v1/metrics/loggers.py)
    "vllm:num_requests_running": Series("running"),
    "vllm:num_requests_waiting": Series("waiting"),
    "vllm:prefix_cache_hits_total": Series("prefix_hits"),
    "vllm:prefix_cache_queries_total": Series("prefix_queries"),
    "vllm:kv_cache_usage_perc": Series("kv_usage", MAX),
    # SGLang (sglang/srt/observability/metrics_collector.py)
    "sglang:num_running_reqs": Series("running", MAX),
    "sglang:num_queue_reqs": Series("waiting", MAX),
    "sglang:cached_tokens_total": Series("prefix_hits"),
    "sglang:prompt_tokens_total": Series("prefix_queries"),
    "sglang:token_usage": Series("kv_usage", MAX),
    "sglang:page_size": Series("block_size", MAX),
    "sglang:max_total_num_tokens": Series("max_tokens", MAX),
}
#: vLLM's info series: the cache configuration in its labels
VLLM_CACHE_INFO = "vllm:cache_config_info"
PREFIXES = ("vllm:", "sglang:")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_engine_metrics(text: str) -> EngineStats:
    """The series above, combined over label sets.

    Reads only the lines of those series (Prometheus text format: ``name{labels} value
    [timestamp]``), which is ~40x cheaper than parsing every family of the page: a scrape
    runs on the event loop, and a full parse of vLLM's page held it for over a millisecond.
    A malformed line is skipped."""
    st = EngineStats(scraped_at=time.monotonic())
    got: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIXES):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            close = line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :].split()
        else:
            name, _, tail = line.partition(" ")
            labels, rest = "", tail.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        series = SERIES.get(name)
        if series is not None:
            old = got.get(series.field)
            got[series.field] = value if old is None else (
                old + value if series.reduce == SUM else max(old, value))
        elif name == VLLM_CACHE_INFO:
            found = dict(_LABEL.findall(labels))
            with contextlib.suppress(KeyError, ValueError):
                st.block_size = int(found["block_size"])
            with contextlib.suppress(KeyError, ValueError):
                st.num_gpu_blocks = int(found["num_gpu_blocks"])
    for name in ("running", "waiting", "kv_usage", "prefix_hits", "prefix_queries"):
        if name in got:
            setattr(st, name, got[name])
    if got.get("block_size", 0) >= 1:  # SGLang tells its page size and token capacity
        st.block_size = int(got["block_size"])
        if got.get("max_tokens", 0) >= 1:
            st.num_gpu_blocks = int(got["max_tokens"]) // st.block_size
    return st
