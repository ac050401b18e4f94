"""Effective request capacity, the Mooncake paper's headline metric (FAST'25 §5).

*Effective request capacity* is the highest load at which at least 90% of **all** requests
(rejected ones count as misses) meet both the TTFT and the TBT SLO. Load is the replay speed
(arrivals at ``timestamp / speed``), so capacity is a speed, found here by bisection over
simulated replays. It assumes attainment does not rise with load; each probe is recorded so
a reader can check that on the run at hand.

Next to it stands the *compute-bound limit* of the trace on the prefill pool: the speed at
which the pool would be busy all the time computing each prompt with ideal reuse (every
prefix block any earlier request produced is reused, the unbounded global cache of
:func:`~mooncake_sim.trace.reuse_ceiling`), priced by the same cost model. No scheduler
can serve all requests faster than that. It is not a bound on the capacity, and
``capacity / limit`` is no efficiency: the metric counts requests, not tokens, so a policy
that rejects the longest prompts (up to ``1 - target`` of the requests) sheds far more than
that share of the work and passes the all-requests limit (conductor reached 213% of it);
and on a short trace the TTFT SLO lets a backlog outlive the last arrival.
:func:`compute_bound_speed` with ``share=target, drain_s=ttft_slo`` (and the run's
execution factors) is the bound that holds for both: ``limit_target_speed`` in the
output, and ``of_bound`` the capacity over it (never above 100%). Beside it,
``rejected_work_share``: the share of the ideal-reuse work the requests rejected at
capacity carry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake_conductor.cost import CostModel, CostModelConfig

from .trace import TRACE_BLOCK_TOKENS, TraceRecord, seen_prefix_blocks

#: the paper's definition: share of all requests that must meet both SLOs
DEFAULT_TARGET = 0.9
#: stop bisecting when the bracket is this narrow (hi / lo - 1)
DEFAULT_REL_TOL = 0.02
#: at most this many doublings (or halvings) to bracket the capacity
MAX_BRACKET_STEPS = 10
#: at most this many probes in all, bracket included
DEFAULT_MAX_PROBES = 24


def ideal_reuse_prefill_times(
    records: list[TraceRecord], cost: CostModel | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS, factors: Sequence[float] | None = None,
) -> list[float]:
    """Each request's prefill GPU seconds when it reuses every leading block any earlier
    request held (unbounded global cache, no transfer cost); times its execution factor
    when ``factors`` are given (:func:`~mooncake_sim.bound.execution_factors`)."""
    cm = cost or CostModel(CostModelConfig())
    times = [cm.prefill_compute_time(r.input_length, min(k * block_tokens, r.input_length))
             for r, k in seen_prefix_blocks(records)]
    if factors is None:
        return times
    if len(factors) != len(times):
        raise ValueError("one factor per request, please")
    return [t * f for t, f in zip(times, factors, strict=True)]


def ideal_reuse_prefill_seconds(
    records: list[TraceRecord], cost: CostModel | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> float:
    """Prefill GPU seconds of the whole trace with ideal reuse."""
    return sum(ideal_reuse_prefill_times(records, cost, block_tokens))


def trace_span_s(records: list[TraceRecord]) -> float:
    """Seconds from the first to the last arrival at speed 1."""
    if len(records) < 2:
        return 0.0
    return (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0


def compute_bound_speed(
    records: list[TraceRecord], prefill: int, cost: CostModel | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS, share: float = 1.0, drain_s: float = 0.0,
    factors: Sequence[float] | None = None,
) -> float:
    """Replay speed at which ``prefill`` instances are busy all the time with the trace's
    ideal-reuse prefill work (``inf`` for a trace with no span or no work).

    ``share < 1`` counts only the cheapest ``share`` of the requests: a policy may reject
    the rest and still meet a ``share`` target, and the requests it drops first are the
    longest prompts, whose prefill dominates the work. ``drain_s`` (the TTFT SLO) lets
    the work run on past the last arrival by that much, as a served request may start its
    first token that late. With both, the result is a true upper bound on the capacity
    of any policy that serves the ``share`` target (with ``factors``, the execution
    factors of the replays it bounds, when they have any)."""
    if not 0 < share <= 1:
        raise ValueError("share must be in (0, 1]")
    times = ideal_reuse_prefill_times(records, cost, block_tokens, factors)
    if share < 1:
        times = sorted(times)[: math.ceil(share * len(times))]
    busy_s = sum(times) / prefill  # wall seconds the pool needs, all instances busy
    span = trace_span_s(records)
    if busy_s <= drain_s or span <= 0:
        return math.inf
    return span / (busy_s - drain_s)


@dataclass(frozen=True, slots=True)
class Probe:
    speed: float
    attainment: float
    ok: bool


@dataclass(slots=True)
class CapacitySearch:
    """Outcome of :func:`search_capacity`: ``capacity_speed`` is the highest probed speed
    that met the target (0 when none did); ``bracketed`` says a failing speed above it was
    found, i.e. the result is a capacity and not just a lower bound."""

    capacity_speed: float
    bracketed: bool
    probes: list[Probe] = field(default_factory=list)
    #: rounds of probes (one probe each for :func:`search_capacity`)
    rounds: int = 0


def search_capacity(
    attainment_at: Callable[[float], float],
    start: float,
    target: float = DEFAULT_TARGET,
    rel_tol: float = DEFAULT_REL_TOL,
    max_probes: int = DEFAULT_MAX_PROBES,
    on_probe: Callable[[Probe], None] | None = None,
) -> CapacitySearch:
    """Highest speed with ``attainment_at(speed) >= target``: bracket by doubling or halving
    from ``start``, then bisect geometrically until ``hi / lo - 1 <= rel_tol``."""
    return search_capacity_batched(lambda speeds: [attainment_at(s) for s in speeds], start,
                                   1, target, rel_tol, max_probes, on_probe)


def search_capacity_batched(
    attainments_at: Callable[[list[float]], list[float]],
    start: float,
    width: int,
    target: float = DEFAULT_TARGET,
    rel_tol: float = DEFAULT_REL_TOL,
    max_probes: int | None = None,
    on_probe: Callable[[Probe], None] | None = None,
) -> CapacitySearch:
    """:func:`search_capacity` with ``width`` speeds probed per round (``attainments_at``
    may replay them in parallel): the bracket grows by ``2**width`` a round instead of 2,
    and a round splits it into ``width + 1`` geometric parts instead of 2, so the rounds
    fall from about ``log2`` to ``log_{width+1}`` of the bracket's ratio over the
    tolerance. With ``width`` 1 it probes exactly the speeds :func:`search_capacity` did.

    Inside a round the lowest speed that missed bounds the capacity from above and the
    highest speed under it that met the target from below; speeds past the first miss are
    kept in ``probes`` but decide nothing (attainment is assumed not to rise with load,
    and ``probes`` lets a reader check that). ``max_probes`` defaults to
    ``DEFAULT_MAX_PROBES`` rounds' worth (``width`` probes each)."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError("start must be a positive, finite speed")
    if not 0 < target <= 1:
        raise ValueError("target must be in (0, 1]")
    if rel_tol <= 0:
        raise ValueError("rel_tol must be positive")
    if width < 1:
        raise ValueError("width must be at least 1")
    budget = DEFAULT_MAX_PROBES * width if max_probes is None else max_probes
    out = CapacitySearch(capacity_speed=0.0, bracketed=False)

    def probe(speeds: list[float], at_least: int = 0) -> list[bool]:
        """Probe ``speeds`` in one round, as many as the budget leaves (``at_least`` in
        any case); whether each met the target."""
        speeds = speeds[: max(at_least, budget - len(out.probes))]
        out.rounds += 1
        oks = []
        for speed, att in zip(speeds, attainments_at(speeds), strict=True):
            p = Probe(speed, att, att >= target)
            out.probes.append(p)
            oks.append(p.ok)
            if on_probe is not None:
                on_probe(p)
        return oks

    # the first round: start, and the speeds above it (capacity is often above the start)
    speeds = [start * 2.0 ** i for i in range(min(width, MAX_BRACKET_STEPS + 1))]
    oks = probe(speeds, at_least=1)
    lo, hi = _narrow(speeds[: len(oks)], oks, None, None)
    # then double from the last speed probed until one misses, or (start missed) halve
    # from start until one meets the target
    grow = 2.0 if oks[0] else 0.5
    edge = speeds[len(oks) - 1] if oks[0] else start
    steps = len(oks) - 1 if oks[0] else 0
    while ((hi if grow > 1 else lo) is None and steps < MAX_BRACKET_STEPS
           and len(out.probes) < budget):
        speeds = [edge * grow ** i for i in range(1, width + 1)][: MAX_BRACKET_STEPS - steps]
        oks = probe(speeds)
        steps += len(oks)
        edge = speeds[len(oks) - 1]
        ordered = sorted(zip(speeds[: len(oks)], oks, strict=True))  # ascending
        lo, hi = _narrow([sp for sp, _ in ordered], [ok for _, ok in ordered], lo, hi)
    if lo is None:  # nothing met the target, down to start / 2**MAX_BRACKET_STEPS
        return out
    if hi is None:  # met it up to the highest speed probed: a lower bound only
        out.capacity_speed = lo
        return out
    while hi / lo - 1 > rel_tol and len(out.probes) < budget:
        ratio = hi / lo
        speeds = [lo * ratio ** (i / (width + 1)) for i in range(1, width + 1)]
        if width == 1:
            speeds = [math.sqrt(lo * hi)]  # bit for bit the bisection's midpoint
        oks = probe(speeds)
        new_lo, new_hi = _narrow(speeds[: len(oks)], oks, lo, hi)
        assert new_lo is not None and new_hi is not None  # a bracket only narrows
        lo, hi = new_lo, new_hi
    out.capacity_speed = lo
    out.bracketed = True
    return out


def _narrow(speeds: list[float], oks: list[bool], lo: float | None,
            hi: float | None) -> tuple[float | None, float | None]:
    """The bracket after one round of ``speeds`` (ascending) and whether each met the
    target: the first miss becomes ``hi``; the last speed that met it before that, ``lo``
    (either stays as it was when the round has none)."""
    for speed, ok in zip(speeds, oks, strict=True):
        if ok:
            lo = speed
        else:
            return lo, speed
    return lo, hi


def pd_splits(total: int, step: int = 1) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of ``total`` instances with at least one of each,
    prefill counts ``step`` apart (the last split always included)."""
    if total < 2:
        raise ValueError("a P/D sweep needs at least 2 instances")
    if step <= 0:
        raise ValueError("step must be positive")
    prefills = list(range(1, total, step))
    if prefills[-1] != total - 1:
        prefills.append(total - 1)
    return [(p, total - p) for p in prefills]
