"""The gateway's Prometheus metrics, in a private registry (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: :data:`TTFT_BUCKETS` per decade between 10 ms and 100 s: bounds 10^(1/40) = 5.9% apart
TTFT_STEPS_PER_DECADE = 40
#: TTFT buckets (seconds): vLLM's ``time_to_first_token_seconds`` range (1 ms to 2560 s),
#: 5.9% apart from 10 ms to 100 s, so ``histogram_quantile`` lands within about one bucket
#: of the true quantile (docs/monitoring.md measures it against the replay client's)
TTFT_BUCKETS = (0.001, 0.005,
                *(float(f"{10.0 ** (k / TTFT_STEPS_PER_DECADE - 2):.3g}")
                  for k in range(4 * TTFT_STEPS_PER_DECADE + 1)),
                160.0, 640.0, 2560.0)
#: time-between-tokens buckets (seconds), as vLLM's ``inter_token_latency_seconds``
TBT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: decision latency buckets (seconds): tens of microseconds to tens of milliseconds
DECISION_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
#: time-to-429 buckets (seconds): a refusal at once takes milliseconds, one after a hold
#: up to the TTFT SLO
REJECTION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                     10.0, 30.0, 60.0)
#: how a 429 came about: refused at the first decision, or after holding for decode room
REJECTION_PATHS = ("at-once", "after-hold")


#: why the Conductor refuses a request (``Decision.reject_reason``); each model's series
#: start at 0, so ``rate()`` counts a model's first rejection too
REJECT_REASONS = ("ttft-slo", "tbt-slo", "overload", "no-prefill-instance",
                  "no-decode-instance")
#: ``requests_total`` outcomes of the completion endpoints, exported from 0 likewise
#: (``limited``: the client's key was over its own limit, see ``auth.py``)
OUTCOMES = ("ok", "rejected", "limited", "error", "bad_request", "not_found", "too_large",
            "cancelled")
ENDPOINTS = ("completions", "chat")


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mooncake_gateway_requests", "Requests by model, endpoint and outcome",
            ["model", "endpoint", "outcome"], registry=r)
        self.ttft = Histogram(
            "mooncake_gateway_time_to_first_token_seconds", "TTFT seen by the gateway",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram(
            "mooncake_gateway_time_between_tokens_seconds",
            "Time between streamed chunks seen by the gateway", ["model"],
            buckets=TBT_BUCKETS, registry=r)
        self.decision = Histogram(
            "mooncake_gateway_decision_seconds",
            "Tokens → block keys → Conductor decision", ["model"],
            buckets=DECISION_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "mooncake_gateway_prompt_tokens", "Prompt tokens by how the index predicted them",
            ["model", "kind"], registry=r)  # kind: reused | computed
        self.engine_cached_tokens = Counter(
            "mooncake_gateway_engine_cached_tokens",
            "Prompt tokens the prefill engines reported as prefix-cache hits", ["model"],
            registry=r)
        self.engine_prompt_tokens = Counter(
            "mooncake_gateway_engine_prompt_tokens",
            "Prompt tokens of prefills the engines answered", ["model"], registry=r)
        self.auth_denied = Counter(
            "mooncake_gateway_auth_denied", "Requests refused by the front door (401/403), by "
            "code", ["code"], registry=r)
        self.key_limited = Counter(
            "mooncake_gateway_key_limited", "Requests refused (429) for being over their "
            "key's own limit, by code", ["code"], registry=r)
        self.buffered_bytes = Gauge(
            "mooncake_gateway_buffered_request_bytes", "Request body bytes held now (reserved "
            "against max_buffered_bytes)", registry=r)
        self.buffer_refusals = Counter(
            "mooncake_gateway_buffer_refusals", "Requests refused (503) because the request "
            "bodies held at once reached max_buffered_bytes", registry=r)
        self.rejections = Counter(
            "mooncake_gateway_rejections", "Requests answered 429, by reason",
            ["model", "reason"], registry=r)
        self.rejection_seconds = Histogram(
            "mooncake_gateway_rejection_seconds", "From a request's arrival to the "
            "scheduler's 429 (path: at-once, or after-hold for decode room)",
            ["model", "path"], buckets=REJECTION_BUCKETS, registry=r)
        self.held = Counter(
            "mooncake_gateway_held", "Requests refused for decode room that waited for it "
            "(holding), by how the wait ended: placed, or rejected at its deadline",
            ["model", "outcome"], registry=r)
        self.steals = Counter(
            "mooncake_gateway_steals", "Prefills held in the gateway that an instance gone "
            "idle took from another's queue (work stealing)", ["model"], registry=r)
        self.retries = Counter(
            "mooncake_gateway_retries", "Upstream attempts repeated elsewhere",
            ["model", "role"], registry=r)
        self.index_blocks = Gauge(
            "mooncake_gateway_index_blocks", "Distinct block keys in the index", ["model"],
            registry=r)
        self.events = Counter(
            "mooncake_gateway_kv_events", "KV events applied to the index", ["model"],
            registry=r)
        self.slo_requests = Counter(
            "mooncake_gateway_slo_requests", "Requests by whether they met the model's SLO "
            "(slo: ttft, tbt or both; result: met or missed). Rejected and failed requests "
            "count as missed; TBT is the mean of a streamed request's longest 10% of intervals",
            ["model", "slo", "result"], registry=r)
        self.routable = Gauge(
            "mooncake_gateway_routable_instances",
            "Instances of a served model the gateway can route to now, by role (0 when none "
            "is listed: pods that are not Ready or are gone)", ["model", "role"], registry=r)
        self.instance_up = Gauge(
            "mooncake_gateway_instance_up", "1 when an instance is routable",
            ["model", "role", "instance"], registry=r)
        self.instance_inflight = Gauge(
            "mooncake_gateway_instance_inflight", "Requests this gateway has in flight there",
            ["model", "role", "instance"], registry=r)
        self.instance_queue_s = Gauge(
            "mooncake_gateway_instance_predicted_wait_seconds",
            "Predicted prefill wait (modelled seconds)", ["model", "instance"], registry=r)
        self.instance_prefills = Counter(
            "mooncake_gateway_instance_prefills", "Prefills an instance answered",
            ["model", "instance"], registry=r)
        self.instance_events = Counter(
            "mooncake_gateway_instance_kv_events", "KV events applied from an instance",
            ["model", "role", "instance"], registry=r)
        self.instance_event_gaps = Counter(
            "mooncake_gateway_instance_kv_event_gaps",
            "Gaps in an instance's KV-event stream that its replay could not fill (its "
            "index entries were kept, to age out as its cache turns over)",
            ["model", "role", "instance"],
            registry=r)
        self.model_documents = Gauge(
            "mooncake_gateway_model_documents",
            "Model ConfigMaps by state (served, invalid, conflict)", ["state"], registry=r)
        self.model_document_errors = Counter(
            "mooncake_gateway_model_document_errors",
            "Model documents found invalid (each new error of a ConfigMap once)",
            ["source"], registry=r)


class ModelMetrics:
    """One model's labelled children, looked up once (``labels()`` takes a lock and
    validates its arguments on every call: a few microseconds per request each)."""

    def __init__(self, m: GatewayMetrics, model: str) -> None:
        self.family = m
        self.model = model
        for reason in REJECT_REASONS:
            m.rejections.labels(model, reason)
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                m.requests.labels(model, endpoint, outcome)
        self.decision = m.decision.labels(model)
        self.rejection_seconds = {path: m.rejection_seconds.labels(model, path)
                                  for path in REJECTION_PATHS}
        self.ttft = m.ttft.labels(model)
        self.tbt = m.tbt.labels(model)
        self.prompt_reused = m.prompt_tokens.labels(model, "reused")
        self.prompt_computed = m.prompt_tokens.labels(model, "computed")
        self.engine_cached_tokens = m.engine_cached_tokens.labels(model)
        self.engine_prompt_tokens = m.engine_prompt_tokens.labels(model)
        self.events = m.events.labels(model)
        self.steals = m.steals.labels(model)
        self.retries_prefill = m.retries.labels(model, "prefill")
        self.retries_decode = m.retries.labels(model, "decode")

    def inflight(self, role: str, instance: str) -> Gauge:
        return self.family.instance_inflight.labels(self.model, role, instance)


class RequestCounter:
    """``requests_total`` children by (model, endpoint, outcome), cached."""

    def __init__(self, m: GatewayMetrics) -> None:
        self._family = m.requests
        self._children: dict[tuple[str, str, str], Counter] = {}

    def inc(self, model: str, endpoint: str, outcome: str) -> None:
        key = (model, endpoint, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._family.labels(model, endpoint, outcome)
        child.inc()
