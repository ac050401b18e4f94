"""The ``conductor`` policy's placement rule as named stages: options → scorers → filter →
picker, the shape of the llm-d inference scheduler (filters, scorers summed, a picker).

For one request over the live prefill instances:

1. **Options** (the policy's ``option_of``): each instance serves the prompt the cheaper
   way by TTFT, recomputing past its own prefix or fetching the longest prefix any
   holder has (never from itself). A chunked-pipeline (CPP) group is one option too.
2. **Scorers**, in seconds, summed in the order of :data:`SCORERS`:

   - ``queue``: until the instance starts the request (FIFO: what runs plus what is
     queued; with priority queues, the work ahead at the request's priority);
   - ``transfer``: the part of the fetch the queue does not hide;
   - ``prefill``: the prefill on the tokens not reused (a CPP group: its makespan);
   - ``work_price``: ``kappa`` times the GPU seconds the option uses (every member of a
     group), ``kappa`` the requests a GPU second delays under the present load
     (:func:`pool_prices`);
   - ``shut_out``: the wait of the arrivals shut out of the pool until its first
     instance is free again, once this option holds its instance to its TTFT
     (``rate * t**2 / 2``, :func:`.arrivals.shut_out_wait`).

   The first three are the option's TTFT.
3. **Filter** (:func:`slo_guard`): while one option meets the TTFT SLO, the shut-out
   price never makes another take an option that breaks it.
4. **Picker** (:func:`tie_band`): the options within the tie band of the best score,
   those that need no new copy if any do; the policy draws one at random.

The fused kernels (:func:`.scoring_kernel.rank_fifo`, :func:`.scoring_kernel.rank_rows`) compute the
same stages for FIFO queues over a whole pool in one compiled pass; tests hold the two
equal bit for bit (``tests/conductor/test_scoring.py``). Rule and sources:
:mod:`.policies.conductor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Option:
    """One way to serve the request: on instance ``iid`` (a CPP group's leader), reusing
    ``local`` blocks of its own and fetching ``fetch`` more. ``position`` is its
    instance's place in the live list (-1: a group, which holds several)."""

    iid: int
    local: int
    fetch: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    priority: float
    position: int = -1
    #: instances the option holds for ``prefill_s`` (a CPP group's members)
    size: int = 1

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s

    @property
    def gpu_s(self) -> float:
        return self.size * self.prefill_s if self.size > 1 else self.prefill_s


@dataclass(frozen=True, slots=True)
class PoolPrices:
    """What the scorers read of the pool: ``kappa`` (seconds of delay per GPU second),
    the earliest free time over the live instances (``first``, at live position
    ``first_at``) and the earliest of the others (``second``), and the arrival rate
    that prices a shut-out (0: not priced)."""

    kappa: float
    first: float
    second: float
    first_at: int
    shut_rate: float


def pool_prices(ends: Sequence[float], queued: Sequence[int], running: Sequence[bool],
                work_weight: float, shut_rate: float, open_s: float) -> PoolPrices:
    """The pool's prices from each live instance's free time (``ends``, seconds from now),
    queue length and whether it runs a prefill: ``kappa = work_weight * (busy instances
    + waiting requests) / instances``; the shut-out is priced only while the first
    instance frees within ``open_s`` (past it the pool saturates and every arrival
    queues anyway)."""
    busy = sum([bool(q) or r for q, r in zip(queued, running, strict=True)])
    kappa = work_weight * (busy + sum(queued)) / len(ends)
    j1 = min(range(len(ends)), key=ends.__getitem__)
    first, second = ends[j1], min([*ends[:j1], *ends[j1 + 1:]], default=math.inf)
    return PoolPrices(kappa, first, second, j1, shut_rate if first <= open_s else 0.0)


Scorer = Callable[[Option, PoolPrices], float]


def queue(o: Option, pool: PoolPrices) -> float:
    return o.queue_s


def transfer(o: Option, pool: PoolPrices) -> float:
    return o.transfer_s


def prefill(o: Option, pool: PoolPrices) -> float:
    return o.prefill_s


def work_price(o: Option, pool: PoolPrices) -> float:
    return pool.kappa * o.gpu_s


def shut_out(o: Option, pool: PoolPrices) -> float:
    """``rate * t**2 / 2``, ``t`` when the first live instance is free once ``o`` holds
    its instance until its TTFT (for a group, see :func:`.arrivals.shut_out_wait`)."""
    if pool.shut_rate <= 0.0:
        return 0.0
    free = min(pool.second if o.position == pool.first_at else pool.first, o.ttft_s)
    return pool.shut_rate * free * free / 2.0  # free times are never negative


#: the scorers by name, in the order their seconds are summed (the kernels' order: TTFT
#: first, then the price of work, then the shut-out)
SCORERS: tuple[tuple[str, Scorer], ...] = (
    ("queue", queue), ("transfer", transfer), ("prefill", prefill),
    ("work_price", work_price), ("shut_out", shut_out),
)


def score(o: Option, pool: PoolPrices) -> float:
    """The sum of every scorer's seconds for ``o``."""
    total = 0.0
    for _, scorer in SCORERS:
        total += scorer(o, pool)
    return total


def breakdown(o: Option, pool: PoolPrices) -> dict[str, float]:
    """Each scorer's seconds for ``o`` (what ``explain`` shows)."""
    return {name: scorer(o, pool) for name, scorer in SCORERS}


def slo_guard(options: Sequence[Option], scores: list[float], slo_s: float,
              pool: PoolPrices) -> list[float]:
    """With the shut-out priced and some option meeting the TTFT SLO ``slo_s``, the
    options that break it score infinity (the price never costs a request its SLO)."""
    if pool.shut_rate > 0.0 and any(o.ttft_s <= slo_s for o in options):
        return [s if o.ttft_s <= slo_s else math.inf
                for o, s in zip(options, scores, strict=True)]
    return scores


def tie_band(options: Sequence[Option], scores: Sequence[float], tol: float,
             tol_s: float) -> list[int]:
    """Positions of the options whose score is within ``tol`` (relative) plus ``tol_s``
    of the best, in order; only those that fetch nothing when any of them does."""
    band = min(scores) * (1.0 + tol) + tol_s
    ties = [i for i, s in enumerate(scores) if s <= band]
    no_copy = [i for i in ties if not options[i].fetch]
    return no_copy or ties
