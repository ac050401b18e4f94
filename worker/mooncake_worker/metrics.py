"""Prometheus metrics under vLLM's names (one registry per worker)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from mooncake_contract.kvevents.codec import KVEvent
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric

from .engine import EngineObserver
from .settings import WorkerSettings

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class FastHistogram:
    """A labelled Prometheus histogram whose ``observe`` is a bisect and two adds
    (``prometheus_client``'s locks and per-bucket loop cost more than the engine step)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str],
                 buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cum = 0
        buckets: list[tuple[str, float]] = []
        for bound, c in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cum += c
            buckets.append((("+Inf" if bound == float("inf") else repr(bound)), cum))
        fam.add_metric(list(self.labels.values()), buckets, self.sum)
        yield fam


class WorkerMetrics(EngineObserver):
    def __init__(self, settings: WorkerSettings, publish: EngineObserver | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        lv = (settings.model, "0")
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch",
                             labels, registry=r).labels(*lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting",
                             labels, registry=r).labels(*lv)
        self.usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%)",
                           labels, registry=r).labels(*lv)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens",
                            labels, registry=r).labels(*lv)
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens",
                               labels, registry=r).labels(*lv)
        lmap = dict(zip(labels, lv, strict=True))
        self.ttft = FastHistogram("vllm:time_to_first_token_seconds", "Time to first token",
                                  lmap, TTFT_BUCKETS)
        self.itl = FastHistogram("vllm:inter_token_latency_seconds", "Inter-token latency",
                                 lmap, ITL_BUCKETS)
        r.register(self.ttft)
        r.register(self.itl)
        self.rejected = Counter("mooncake_worker:requests_rejected", "Requests refused (429)",
                                labels, registry=r).labels(*lv)
        info = Gauge("vllm:cache_config_info", "Cache configuration",
                     ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                      "role", "model_name"], registry=r)
        info.labels(str(settings.block_size), str(settings.capacity_blocks), "auto", "True",
                    settings.role.value, settings.model).set(1)
        self._publish = publish

    def on_step(self, running: int, waiting: int, usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.usage.set(usage)

    def on_prefix_query(self, queried: int, hit: int) -> None:
        self.queries.inc(queried)
        if hit:
            self.hits.inc(hit)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token_gap(self, seconds: float, n: int = 1) -> None:
        self.itl.observe(seconds, n)

    def on_events(self, events: list[KVEvent]) -> None:
        if self._publish is not None:
            self._publish.on_events(events)

    def render(self) -> bytes:
        return generate_latest(self.registry)
