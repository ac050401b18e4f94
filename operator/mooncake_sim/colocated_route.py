"""Routers for the colocated baseline (:mod:`mooncake_sim.colocated`).

Each router sees, per instance, an :class:`InstanceLoad` (what a gateway in front of vLLM
or SGLang engines can know: its own count of outstanding requests, the engine's queue and
KV usage metrics, and the prefix of this request the engine's cache holds, as KV events
report it) and returns the index of the instance to send the request to. They are the
published rules of the routers colocated deployments use, with their published defaults
(``shared/reference/peers.md``); the prefix match is always the *precise* one (the
engine's real cache), the strongest reading of either router.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance as the router sees it when a request arrives."""

    #: requests routed there and not finished (the router's own count)
    requests: int
    #: requests there that have not had their first token (waiting or mid-prefill)
    queued: int
    #: share of the instance's KV capacity the running requests reserve, in [0, 1]
    kv_usage: float
    #: tokens in the instance's prefix cache
    cached_tokens: int
    #: leading tokens of this request's prompt the instance's cache holds
    matched_tokens: int


class SGLangRule(BaseModel):
    """SGLang router ``cache_aware`` thresholds; defaults are its CLI defaults
    (``sgl-router``: cache_threshold 0.3, balance_abs 64, balance_rel 1.5)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)


class LlmdWeights(BaseModel):
    """llm-d endpoint-picker scorer weights; defaults are its chart's default profile
    (prefix 3, queue 2, kv-cache-utilization 2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix: float = Field(3.0, ge=0)
    queue: float = Field(2.0, ge=0)
    kv_utilization: float = Field(2.0, ge=0)


Router = Callable[[Sequence[InstanceLoad], int, random.Random], int]


def _argmin(values: Sequence[float], rng: random.Random) -> int:
    """Index of the smallest value, ties broken at random."""
    low = min(values)
    ties = [i for i, v in enumerate(values) if v == low]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def least_load(loads: Sequence[InstanceLoad], prompt_tokens: int, rng: random.Random) -> int:
    """``least-load``: the instance with the fewest outstanding requests; ties to the one
    with the fewest queued prompts, then at random (vLLM production stack / SGLang
    ``shortest_queue`` style; no cache awareness)."""
    del prompt_tokens
    span = 1 + max(w.queued for w in loads)
    return _argmin([float(w.requests * span + w.queued) for w in loads], rng)


def sglang_cache_aware(rule: SGLangRule) -> Router:
    """``sglang-cache-aware``: SGLang router's ``cache_aware`` policy
    (``sgl-router/src/policies/cache_aware.rs``). Load = outstanding requests. When
    ``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold`` the
    least loaded instance wins; else, when the best prefix match covers more than
    ``cache_threshold`` of the prompt, the instance with that match (the first such);
    else the instance with the least cached data (``get_smallest_tenant``)."""

    def route(loads: Sequence[InstanceLoad], prompt_tokens: int, rng: random.Random) -> int:
        req = [w.requests for w in loads]
        hi, lo = max(req), min(req)
        if hi - lo > rule.balance_abs_threshold and hi > lo * rule.balance_rel_threshold:
            return _argmin([float(r) for r in req], rng)
        best = max(w.matched_tokens for w in loads)
        if prompt_tokens > 0 and best / prompt_tokens > rule.cache_threshold:
            return next(i for i, w in enumerate(loads) if w.matched_tokens == best)
        return _argmin([float(w.cached_tokens) for w in loads], rng)

    return route


def llmd_weighted(weights: LlmdWeights) -> Router:
    """``llm-d``: llm-d's endpoint picker, weighted scorers each in [0, 1], highest total
    wins, random tie-break (``llm-d-inference-scheduler``): prefix-cache = matched share of
    the prompt; queue = ``(max_q - q) / (max_q - min_q)`` over the instances' queued
    prompts (1 for all when equal); kv-cache-utilization = ``1 - usage``."""

    def route(loads: Sequence[InstanceLoad], prompt_tokens: int, rng: random.Random) -> int:
        qs = [w.queued for w in loads]
        q_hi, q_lo = max(qs), min(qs)
        scores = []
        for w in loads:
            prefix = w.matched_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - w.queued) / (q_hi - q_lo)
            kv = 1.0 - min(1.0, max(0.0, w.kv_usage))
            scores.append(weights.prefix * prefix + weights.queue * queue
                          + weights.kv_utilization * kv)
        return _argmin([-s for s in scores], rng)

    return route


#: router names :class:`~mooncake_sim.colocated.ColocatedConfig` accepts
ROUTERS = ("sglang-cache-aware", "llm-d", "least-load")


def make_router(name: str, sglang: SGLangRule, llmd: LlmdWeights) -> Router:
    if name == "sglang-cache-aware":
        return sglang_cache_aware(sglang)
    if name == "llm-d":
        return llmd_weighted(llmd)
    if name == "least-load":
        return least_load
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
