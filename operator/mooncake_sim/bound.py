"""A lower bound on mean TTFT: what no scheduler can beat on a trace, whatever the load.

Rule, per request: its prefill compute on the tokens no earlier request could have left
cached (ideal reuse: every leading block any earlier request held, the unbounded global
cache of :func:`~mooncake_sim.trace.seen_prefix_blocks`), run the fastest way any
compared design could legally run it: alone (the cost model's compute time, without the
host-to-device load of the reused prefix), or as chunked pipeline prefill (CPP,
:mod:`mooncake_conductor.cpp`) over ``g`` idle instances for the ``g`` in
``2..max_group`` (capped by the pool) and chunk size with the shortest makespan. No
queueing, no fetch, no KV transfer, no hold. Times the request's execution factor where
realism sets one (prediction error, model bias: :func:`execution_factors`, the factors
the simulator executes with), so it holds request by request on every run.

The bound on the *charged* mean TTFT (rejected requests charged the TTFT SLO) takes each
request's term as ``min(bound, SLO)``: a served request takes at least its bound, a
rejected one is charged the SLO. The mean over all requests is :func:`ttft_lower_bound`.

It is a bound, not a target: it ignores that requests share the pool (at any load a
queue forms when prompts arrive together), that a CPP group needs idle instances, and
that a cache is finite. The charged TTFT over it says how much any scheduler could still
win at most; :func:`loss_split` says where a run's excess went.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import CPPConfig

from .engine import ERROR_SEED_OFFSET, SimConfig
from .trace import TRACE_BLOCK_TOKENS, TraceRecord, reuse_ceiling, seen_prefix_blocks


def execution_factors(config: SimConfig, n: int) -> list[float]:
    """The factor each of ``n`` requests' prefill executes with in a replay under
    ``config``: ``1 + model_bias``, times the per-request lognormal draw of
    ``prediction_error`` (the simulator's own draw: same seed, same order)."""
    factor = np.full(n, 1.0 + config.model_bias)
    if config.prediction_error > 0 and n:
        rng = np.random.default_rng(config.conductor.seed + ERROR_SEED_OFFSET)
        factor *= rng.lognormal(0.0, config.prediction_error, n)
    return [float(x) for x in factor]


def cpp_reach(config: SimConfig) -> tuple[int, tuple[int, ...]]:
    """Largest CPP group the policy of ``config`` may form (1: no CPP, or routing only),
    capped by the prefill pool, and the chunk sizes it may use."""
    from mooncake_conductor.policies import policy_class

    params = policy_class(config.conductor.policy).Params.model_validate(
        config.conductor.params)
    cpp = getattr(params, "cpp", None)
    if config.conductor.routing_only or not isinstance(cpp, CPPConfig) or not cpp.enabled:
        return 1, ()
    sizes = (cpp.chunk_tokens,) if cpp.chunk_tokens else tuple(cpp.chunk_choices)
    return min(cpp.max_group, config.prefill), sizes


def request_bounds(
    records: list[TraceRecord], cost: CostModel, max_group: int = 1,
    chunk_sizes: Iterable[int] = (), factors: Sequence[float] | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> list[float]:
    """Each request's TTFT lower bound (see the module's rule), in trace order."""
    if max_group < 1:
        raise ValueError("max_group must be at least 1")
    if factors is not None and len(factors) != len(records):
        raise ValueError("one factor per request, please")
    sizes = sorted(set(chunk_sizes))
    if any(size < 1 for size in sizes):
        raise ValueError("chunk sizes must be positive")
    ns, cached = [], []
    best = []
    for r, k in seen_prefix_blocks(records):
        n = r.input_length
        c = min(k * block_tokens, n)
        ns.append(n)
        cached.append(c)
        best.append(cost.prefill_compute_time(n, c))
    out = np.array(best, dtype=float)
    if sizes and max_group > 1 and len(out):
        n_arr = np.array(ns, dtype=float)
        c_arr = np.array(cached, dtype=float)
        todo = n_arr > c_arr
        groups = list(range(2, max_group + 1))
        for size in sizes:
            spans = pipeline_makespans(cost, n_arr[todo], c_arr[todo], groups, size)
            out[todo] = np.minimum(out[todo], spans.min(axis=0))
    if factors is not None:
        out *= np.asarray(factors, dtype=float)
    return [float(x) for x in out]


def pipeline_makespans(cost: CostModel, n: npt.NDArray[np.float64],
                       cached: npt.NDArray[np.float64], groups: Sequence[int],
                       chunk_tokens: int) -> npt.NDArray[np.float64]:
    """:func:`mooncake_conductor.cpp.cpp_makespan` of many prompts at once (each with
    ``n > cached``), one row per group size of ``groups`` (each at least 2): the chunks'
    compute on one node over the group, plus the activations each stage hands on, plus
    ``group - 1`` times the longest stage (the last full chunk, or the shorter last
    one). The same arithmetic, element by element."""
    m, hw = cost.config.model, cost.config.hardware
    nic = hw.nic_bytes_per_s * cost.config.efficiency.transfer_efficiency
    per_token = m.d_model * m.elem_bytes / nic
    ovh = cost.prefill_overhead_s
    flops: Callable[[Any], Any] = cost.flops  # a*n*n + b*n: element by element too
    new = n - cached
    full = np.floor_divide(new, chunk_tokens)
    rest = new - full * chunk_tokens
    end = cached + full * chunk_tokens
    rate = cost.prefill_flops_rate(chunk_tokens)
    has_full = full > 0
    compute = np.where(has_full, full * ovh + (flops(end) - flops(cached)) / rate,
                       0.0)
    last = np.where(has_full, ovh + (flops(end) - flops(end - chunk_tokens)) / rate,
                    0.0)
    has_rest = rest > 0
    kinds, where = np.unique(rest, return_inverse=True)
    rates = np.array([cost.prefill_flops_rate(float(x)) for x in kinds])[where]
    tail = np.where(has_rest, ovh + (flops(n) - flops(end)) / rates, 0.0)
    compute = compute + tail
    rows = []
    for group in groups:
        top = np.maximum(np.where(has_full, last / group + chunk_tokens * per_token, 0.0),
                         np.where(has_rest, tail / group + rest * per_token, 0.0))
        rows.append(compute / group + new * per_token + (group - 1) * top)
    out: npt.NDArray[np.float64] = np.array(rows, dtype=float).reshape(len(groups), len(n))
    return out


def bounds_for(records: list[TraceRecord], configs: Sequence[SimConfig]) -> list[float]:
    """Per-request bounds that hold for every one of ``configs`` (the same trace, pools,
    realism and seed; the policies may differ): CPP up to the largest group any of them
    may form, over every chunk size any of them may use."""
    if not configs:
        raise ValueError("no configuration given")
    first = configs[0]
    reach = [cpp_reach(c) for c in configs]
    group = max(g for g, _ in reach)
    sizes = {s for _, ss in reach for s in ss}
    return request_bounds(records, CostModel(first.conductor.cost), group, sizes,
                          execution_factors(first, len(records)), first.block_tokens)


def ttft_lower_bound(bounds: Sequence[float], ttft_slo_s: float) -> float:
    """The lower bound on the charged mean TTFT: each request's bound, at most the SLO
    a rejection is charged, averaged over all requests."""
    if not bounds:
        return float("nan")
    return sum(min(b, ttft_slo_s) for b in bounds) / len(bounds)


def loss_split(result: dict[str, Any], bounds: Sequence[float],
               ttft_slo_s: float) -> dict[str, float]:
    """Where a run's charged mean TTFT above the bound went, in seconds per request
    (they sum to charged minus bound): ``wait`` (queueing, fetches, holds before the
    prefill ran), ``prefill`` (execution beyond the ideal: cache misses, smaller or no
    CPP groups, loading the reused prefix), ``rejected`` (the SLO charged for rejected
    requests, beyond their bound)."""
    n = len(bounds)
    rejected = set(result["rejected_ids"])
    served = n - len(rejected)
    clipped = [min(b, ttft_slo_s) for b in bounds]
    served_bound = sum(b for i, b in enumerate(clipped) if i not in rejected)
    wait = result["ttft_wait_mean_s"] * served / n if served else 0.0
    prefill = (result["prefill_exec_mean_s"] * served - served_bound) / n if served else 0.0
    lost = sum(ttft_slo_s - clipped[i] for i in rejected) / n
    return {"wait": wait, "prefill": prefill, "rejected": lost}


def rejected_work_share(work: Sequence[float], rejected_ids: Iterable[int]) -> float:
    """Share of ``work`` (per request, e.g. ideal-reuse prefill seconds) carried by the
    rejected requests."""
    total = sum(work)
    return sum(work[i] for i in set(rejected_ids)) / total if total > 0 else 0.0


def served_reuse_ceiling(records: list[TraceRecord], rejected_ids: Iterable[int],
                         block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """The token reuse ceiling of the requests a run served (what its token hit ratio
    measures): the share of their prompt tokens an unbounded global cache filled only by
    served requests could reuse. Rejected requests compute nothing, so their blocks
    cannot be reused, and their prompts are not in the hit ratio."""
    rejected = set(rejected_ids)
    served = [r for i, r in enumerate(records) if i not in rejected]
    return reuse_ceiling(served, block_tokens)[0] if served else 0.0
