"""``conductor``: our scheduler, Algorithm 1 of the Mooncake paper, improved.

Rule: for every live prefill instance price both ways to serve the prompt —
recompute past the instance's own prefix, or fetch the longest prefix any
holder (instance or store pool) has — as ``TTFT = max(T_queue, T_transfer) +
T_prefill``, plus chunked-pipeline groups for long prompts; rank them by
``TTFT + kappa * GPU seconds`` and take the best; reject (429) when the TTFT
or the decode side's TBT breaks its SLO. The ranking reads as named stages in
:mod:`..scoring` (options, the scorers queue, transfer, prefill, work price and
shut-out, an SLO guard, a tie-band picker); the compiled ranking
(:func:`..scoring_kernel.rank_fifo`) is one tested implementation of their sum.

Where it differs from the paper's Algorithm 1 (``kvcache-centric``), and why
(measured in ``docs/paper-fig5.md``):

1. **Queue time counts the running prefill.** The paper's ``T_queue`` sums the
   predicted times of queued requests; a busy instance with an empty queue
   looks free to it.
2. **Fetch or recompute by cost**, not by the ``kvcache_balancing_threshold``
   ratio the paper uses as a proxy for it.
3. **Transfers overlap the queue.** A fetch starts at placement while earlier
   work runs; only the part longer than the wait delays the prefill.
4. **In-flight prefixes count.** Blocks a queued prefill on an instance will
   have written are matched there, and a request reusing them is never
   ordered ahead of that prefill.
5. **Work has a price under load.** ``kappa = work_weight * (busy instances +
   waiting requests) / instances``: a GPU second spent delays about that many
   requests. An idle pool ranks by TTFT alone; a loaded one favours reuse and
   efficiency (no recomputing a prefix elsewhere to shave a queue, no CPP
   bubbles that would cost others). Times ``min(1, (1 + cv^2) / 2)``
   (:mod:`..spread`, ``spread_price``): when prompts' prefill times are regular
   (coefficient of variation ``cv`` under 1), a second of work delays the
   requests behind it less (the Allen-Cunneen approximation).
6. **Chunked pipeline prefill (CPP)** (paper §3.2, which leaves the when open):
   prompts with at least ``cpp.min_new_tokens`` (2048: two of the smallest chunk) to
   compute are also priced as groups of 2..``cpp.max_group`` instances
   (:mod:`mooncake_conductor.cpp`) under the same score. A group never waits for a
   member: one that waits for busy members idles the others, which costs more than it
   saves. Each
   group's chunk size is planned (:func:`..cpp.plan_cpp_for`). When no SLO is
   at stake, ``cpp.reserve_idle_share`` (0 by default: measured, keeping a
   share idle cost the long prompts more than it saved the short ones once
   chunks are planned) of the pool can stay idle for what arrives next; when
   one instance would break ``cpp.trigger_share`` of the TTFT SLO, a faster
   group serves the prompt instead of a rejection. When no group of idle instances
   meets the SLO, a rescue may also take instances that are still busy but come free
   before their pipeline stage first works (stage ``k`` starts ``k`` first-chunk stage
   times after stage 0, :func:`..cpp.staggered_start`): the group still starts at
   once and waits for nobody (``cpp.rescue_staggered``); so may a group for a prompt
   one instance serves in time (``cpp.opportunistic_staggered``).
   A group also pays for the arrivals it shuts out (:mod:`..arrivals`): each option,
   one instance or a group, adds the wait of the requests expected (at the measured
   arrival rate) before the first instance is free again, so on a small pool or in a
   burst a group that takes the last idle instances for long loses to one instance.
   **So does every one-instance choice** (``placement_shut_out``): when every instance
   is busy, taking the one that frees first keeps the pool shut until the next one
   frees, so a long prompt queues behind another and leaves the first to the short
   requests coming next (shortest-first, across instances). Never past the request's
   own TTFT SLO, only with a rate measured over a full ``arrival_window``, and off
   while even the first instance to free is ``shut_out_open_share`` of the SLO away
   (the pool saturates; every arrival queues anyway).
7. **Migrate, don't copy, on fetch.** The source's copy of fetched blocks goes
   to the cold end of its LRU: the newest copy stays hot, old ones age out
   unless reused, and duplicates stop crowding the pooled cache.
8. **Hot prefixes replicated ahead of need** (seed §7, :mod:`..replication`).
9. **No pile-ups on ties.** Options within ``tie_tolerance`` of the best are
   chosen among at random, preferring ones that need no new copy.
10. **Decode under TBT**: decode selector ``tbt-lookahead`` (``tbt-slo`` that
    also counts the requests placed on an instance whose prefill still runs).
11. **Queue order is a knob, FIFO by default.** ``priority_weight`` > 0 orders
    queues shortest-job-first with aging (``arrival + weight * predicted
    prefill``). It hurt beside CPP groups (members idle while shorter jobs overtake the
    group) until overrunning prefills were re-estimated; now it is faster in the
    simulator, but the default stays 0: engines serve their queues FIFO, and the gateway
    orders them only with late binding (``docs/conductor.md``, item 5).
12. **Overload sheds the costly first** (:mod:`..shedding`): once the chosen
    queue nears the TTFT SLO, a request costing more GPU seconds than the
    average offered one is rejected (``overload``); the paper's rule rejects
    only predicted misses, whoever they are.
13. **Late binding of queued work** (:mod:`..stealing`, capability ``stealing``): an
    instance that goes idle takes the prompt queued elsewhere whose predicted TTFT drops
    most by moving; placement binds on predictions, and executions stray from them.
14. **Full decode pool: wait, don't refuse** (:mod:`..holding`, capability ``holding``):
    a request refused only for decode room waits for room while it can still meet the
    TTFT SLO.
15. **A prefill past its predicted end is not done** (:mod:`..overrun`, capability
    ``reestimation``): an instance whose prefill is still running at its predicted end
    gets a new expected end from the prediction error measured so far, instead of
    counting as idle (the paper's T_queue, which sums predictions only).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from ..arrivals import ArrivalRate, shut_out_wait
from ..candidates import LoadOrder, order_of
from ..capabilities import Capabilities
from ..cpp import ChunkPricer, CPPConfig, first_stage_s, staggered_start
from ..scoring import (
    Option,
    PoolPrices,
    breakdown,
    pool_prices,
    score,
    slo_guard,
    tie_band,
)
from ..scoring_kernel import rank_fifo, rank_rows
from ..spread import ServiceSpread
from ..state import ClusterState, PrefillState, RequestInfo, board_of
from ..topology import FetchSources, domain_orders
from .base import Placement, PolicyContext, PrefillPolicy, register
from .conductor_options import RequestOptions


class ConductorParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority_weight: float = Field(
        0.0, ge=0, description="queue priority = arrival + weight * predicted prefill (0 = FIFO)"
    )
    overlap_transfer: bool = Field(True, description="fetches run while the request queues")
    include_pending: bool = Field(True, description="count prefixes of queued prefills")
    tie_tolerance: float = Field(
        0.02, ge=0, description="relative TTFT band treated as a tie (random pick inside)"
    )
    tie_tolerance_s: float = Field(0.005, ge=0, description="absolute TTFT band for ties")
    migrate_on_fetch: bool = Field(
        True, description="after a fetch the source's copy moves to the cold end of its LRU: "
        "the newest copy stays hot, the old one ages out unless reused there",
    )
    work_weight: float = Field(
        1.0, ge=0, description="weight of a choice's GPU seconds, times (busy share of the "
        "prefill pool + requests waiting per instance), added to its TTFT (0: pure TTFT)",
    )
    shut_out_price: bool = Field(
        True, description="a CPP group and the one-instance option it competes with each "
        "pay the wait of the arrivals they shut out of the pool (measured arrival rate)",
    )
    placement_shut_out: bool = Field(
        True, description="every one-instance choice also pays the wait of the arrivals it "
        "shuts out of the pool (measured arrival rate, times the spread factor): a long "
        "prompt leaves the instance that frees first to the requests coming next",
    )
    shut_out_open_share: float = Field(
        0.5, ge=0, description="the one-instance shut-out price acts only while the first "
        "instance to free is free within this share of the TTFT SLO (past it the pool "
        "saturates and every arrival queues anyway; overload shedding's from_share)",
    )
    arrival_window: int = Field(
        32, ge=1, description="arrivals the measured arrival rate averages over (weighted)"
    )
    spread_price: bool = Field(
        True, description="kappa times min(1, (1 + cv^2) / 2), cv the measured coefficient "
        "of variation of the prompts' cold prefill times (work is cheaper when they are "
        "regular: the Allen-Cunneen approximation)",
    )
    spread_window: int = Field(
        1024, ge=1, description="requests the prefill-time spread averages over (weighted)"
    )
    spread_min_samples: int = Field(
        64, ge=1, description="requests seen before the spread prices work (until then: "
        "factor 1, the price of exponential service)",
    )
    explain: bool = Field(False, description="attach the top candidates to each placement")
    cpp: CPPConfig = CPPConfig()


_ONE = 1


@register
class ConductorPolicy(PrefillPolicy):
    name = "conductor"
    Params = ConductorParams
    default_decode = "tbt-lookahead"
    capabilities = Capabilities(admission=True, shedding=True, stealing=True, holding=True,
                                replication=True, calibration=True, reestimation=True)

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._consts = np.array(ctx.cost.prefill_constants())
        self._consts_version = ctx.cost.version
        # scratch for the ranking: scores, where fetching wins, tie positions
        self._score = np.empty(0)
        self._fetch = np.empty(0, dtype=np.bool_)
        self._ties = np.empty(0, dtype=np.int64)
        assert isinstance(params, ConductorParams)
        self._arrivals = ArrivalRate(params.arrival_window)
        self._spread = ServiceSpread(params.spread_window, params.spread_min_samples)

    def choose(self, req: RequestInfo, cluster: ClusterState, now: float) -> Placement:
        """FIFO queues without ``explain``: the live instances come from the pool's board
        (no pass over the objects); otherwise :meth:`pick` over the live list."""
        assert isinstance(self.params, ConductorParams)
        if self.params.priority_weight or self.params.explain or not cluster.prefill:
            return super().choose(req, cluster, now)
        live_mask = board_of(cluster.prefill).live_mask
        if not live_mask:
            return Placement(prefill=None, reject_reason="no-prefill-instance")
        return self._pick(req, cluster, None, live_mask, now)

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        live_mask = sum(map(_ONE.__lshift__, [p.iid for p in live]))  # distinct: sum = OR
        return self._pick(req, cluster, live, live_mask, now)

    def _pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState] | None,
        live_mask: int, now: float,
    ) -> Placement:
        """The rule over the live instances (``live``: their list, or ``None`` when the
        FIFO ranking reads them from the pool's board)."""
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        cost = self.ctx.cost
        new = self._arrivals.observe(req.rid, req.arrival)
        spread = 1.0
        if prm.spread_price:
            if new:  # a request scheduled again while held is not a new one
                self._spread.observe(cost.prefill_time(req.input_tokens, 0))
            spread = self._spread.factor
        if cost.version != self._consts_version:  # the cost model was recalibrated
            self._consts = np.array(cost.prefill_constants())
            self._consts_version = cost.version
        shut_rate = self._shut_rate(spread)
        slo_s = self.ctx.slo.ttft_s
        open_s = prm.shut_out_open_share * slo_s
        ro = self._options(req, cluster, live_mask, now)
        stored, local_view, holders = ro.stored, ro.local_view, ro.holders
        best_src, best_len = ro.best_src, ro.best_len
        option_of = ro.option_of

        options: list[Option] = []
        pool_size = idle = -1  # the pool's live and idle instances (-1: ``live`` is all)
        if prm.priority_weight or prm.explain:
            # the stages one instance at a time (:mod:`..scoring`): the readable rule, and
            # the only way with priority queues
            assert live is not None
            prices, options, scores = self._staged(ro, live, now, spread, shut_rate)
            kappa = prices.kappa
            ties = tie_band(options, scores, prm.tie_tolerance, prm.tie_tolerance_s)
            chosen = live[ties[0] if len(ties) == 1 else self.ctx.rng.choice(ties)]
        else:
            # FIFO: the same stages (kappa, scores, SLO guard, tie band, no-copy
            # preference) over every live instance in one compiled pass
            # (:func:`..scoring_kernel.rank_fifo`)
            # over the pool's board (rows in pool order: live rows in live order), or
            # over the candidates of a large pool (:mod:`..candidates`)
            want_cpp = prm.cpp.enabled and self.ctx.cpp
            cand = self.ctx.candidates
            if (cand.enabled and len(cluster.prefill) >= cand.min_pool
                    and not board_of(cluster.prefill).masked):  # (masked: a rollout's)
                count, kappa, least = self._rank_candidates(
                    req, cluster.prefill, local_view, best_src, best_len, now, spread,
                    shut_rate, slo_s, open_s, prm.cpp.max_group + 1 if want_cpp else 0,
                    holders)
                if want_cpp:  # CPP groups form from the instances that free first
                    live = [cluster.prefill[row] for row in least.tolist()]
                    pool_size, idle = self._pool_counts(cluster.prefill, now)
            else:
                count, kappa = self._rank(req, cluster.prefill, local_view, best_src,
                                          best_len, now, spread, shut_rate, slo_s, open_s,
                                          holders)
            ties_at = self._ties
            chosen = cluster.prefill[int(ties_at[0] if count == 1
                                         else ties_at[self.ctx.rng.choice(range(count))])]
        option = option_of(chosen)
        choice = self._placement(option, ro.source_for(option.local, chosen.place))
        cpp: Placement | None = None
        if prm.cpp.enabled and self.ctx.cpp:
            if live is None:
                live = [p for p in cluster.prefill if p.up]
            if pool_size < 0:
                pool_size, idle = len(live), -1
            rate = self._arrivals.per_s if prm.shut_out_price else 0.0
            rescue = choice.ttft_s > prm.cpp.trigger_share * self.ctx.slo.ttft_s
            found = self._cpp(req, live, stored, best_src, best_len, choice, now, rescue,
                              kappa, rate, pool_size, idle, holders)
            if found is not None:
                cpp, cpp_shut_out, single_shut_out = found
                if (rescue and cpp.ttft_s < choice.ttft_s) or (
                    cpp.ttft_s + kappa * cpp.gpu_seconds + cpp_shut_out
                    < choice.ttft_s + kappa * choice.gpu_seconds + single_shut_out
                ):
                    choice = cpp
        if prm.explain:
            assert live is not None
            shown = [self._placement(o, ro.source_for(o.local, live[o.position].place))
                     for o in sorted(options, key=lambda o: (o.ttft_s, o.iid))[:5]]
            if cpp is not None:
                shown.append(cpp)
            choice.candidates = [
                {"instance": o.prefill if o.prefill is not None else -1, "ttft_s": o.ttft_s,
                 "queue_s": o.queue_s, "transfer_s": o.transfer_s, "prefill_s": o.prefill_s,
                 "group": len(o.cpp_group) or 1}
                for o in sorted(shown, key=lambda o: o.ttft_s)[:5]
            ]
        return choice

    def explain(self, req: RequestInfo, cluster: ClusterState, now: float,
                top: int) -> list[dict[str, float | int]]:
        """Every live instance's option priced by the named stages (:mod:`..scoring`), best
        score first: its TTFT parts, the price of its work and of the arrivals it shuts
        out, and their sum; read from the measured arrival rate and spread as they stand
        (nothing is observed or drawn). CPP groups are not listed."""
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        live = [p for p in cluster.prefill if p.up]
        if not live:
            return []
        spread = self._spread.factor if prm.spread_price else 1.0
        ro = self._options(req, cluster, sum(map(_ONE.__lshift__, [p.iid for p in live])), now)
        prices, options, scores = self._staged(ro, live, now, spread, self._shut_rate(spread))
        rows: list[dict[str, float | int]] = []
        for o, total in zip(options, scores, strict=True):
            row: dict[str, float | int] = {
                "instance": o.iid, "matched_blocks": o.local,
                "cached_tokens": req.tokens_of(o.local), "fetch_blocks": o.fetch}
            row.update({f"{name}_s": v for name, v in breakdown(o, prices).items()})
            row.update({"ttft_s": o.ttft_s, "score_s": total})
            rows.append(row)
        rows.sort(key=lambda r: (r["score_s"], r["ttft_s"]))  # stable: ties in pool order
        return rows[:top]

    def _staged(self, ro: RequestOptions, live: list[PrefillState], now: float,
                spread: float, shut_rate: float
                ) -> tuple[PoolPrices, list[Option], list[float]]:
        """The named stages over ``live``, one instance at a time (:mod:`..scoring`): the
        pool's prices, each instance's option (at its live position) and its score after
        the SLO guard."""
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        slo_s = self.ctx.slo.ttft_s
        prices = pool_prices([p.wait_time(now) for p in live], [len(p.queue) for p in live],
                             [p.busy_until > now for p in live], prm.work_weight * spread,
                             shut_rate, prm.shut_out_open_share * slo_s)
        options = [ro.option_of(p, pos) for pos, p in enumerate(live)]
        return prices, options, slo_guard(options, [score(o, prices) for o in options],
                                          slo_s, prices)

    def _shut_rate(self, spread: float) -> float:
        """The price of the arrivals a choice shuts out, per second squared: the measured
        arrival rate times the spread factor, once measured over a whole window (a burst
        at start-up is no stream of arrivals); 0 with ``placement_shut_out`` off."""
        assert isinstance(self.params, ConductorParams)
        return (self._arrivals.per_s * spread
                if self.params.placement_shut_out and self._arrivals.settled else 0.0)

    def _options(self, req: RequestInfo, cluster: ClusterState, live_mask: int,
                 now: float) -> RequestOptions:
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        return RequestOptions(req, cluster, live_mask, now, self.ctx.cost, self.ctx.topology,
                              fetch=self.ctx.fetch, include_pending=prm.include_pending,
                              overlap_transfer=prm.overlap_transfer,
                              priority_weight=prm.priority_weight)

    def _rank(
        self, req: RequestInfo, pool: list[PrefillState], local_view: npt.NDArray[np.int64],
        best_src: int | None, best_len: int, now: float, spread: float, shut_rate: float,
        slo_s: float, open_s: float, holders: FetchSources | None = None,
    ) -> tuple[int, float]:
        """Score every live instance of ``pool`` at once (FIFO queues); the rows in the
        tie band land in ``self._ties``. Returns their count and ``kappa`` (the work price
        times ``spread``, :mod:`..spread`); ``shut_rate`` prices the arrivals a choice
        shuts out (0: none) while the first instance frees within ``open_s``, never
        past a choice that meets the TTFT SLO ``slo_s``."""
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        board = board_of(pool)
        m = len(pool)
        if len(self._score) != m:
            self._score, self._fetch = np.empty(m), np.empty(m, dtype=np.bool_)
            self._ties = np.empty(m, dtype=np.int64)
        return rank_fifo(
            self._consts, now, req.input_tokens, req.block_tokens, best_len,
            -1 if best_src is None else board.row_of(best_src), prm.work_weight * spread,
            shut_rate, slo_s, open_s, prm.overlap_transfer, prm.tie_tolerance, prm.tie_tolerance_s,
            board["up"], board["busy_until"], board["queued_work_s"], board["queue_len"],
            board["iid"], local_view, self._score, self._fetch, self._ties,
            None if holders is None else holders.arrays(self.ctx.cost, board["place"]),
        )

    def _rank_candidates(
        self, req: RequestInfo, pool: list[PrefillState], local_view: npt.NDArray[np.int64],
        best_src: int | None, best_len: int, now: float, spread: float, shut_rate: float,
        slo_s: float, open_s: float, least_at_least: int,
        holders: FetchSources | None = None,
    ) -> tuple[int, float, npt.NDArray[np.int64]]:
        """:meth:`_rank` over the candidates of a large pool (:mod:`..candidates`): the
        holders of the longest prefixes (stored or pending) and the instances that free
        first (at least ``least_at_least`` of them, their rows returned in that order),
        with the pool's aggregates from its load order."""
        assert isinstance(self.params, ConductorParams)
        prm, cand = self.params, self.ctx.candidates
        board = board_of(pool)
        order: LoadOrder = order_of(board, LoadOrder)
        least, rows, agg, j1 = order.candidates(
            now, max(cand.least_loaded, least_at_least, 2), local_view, cand.holders)
        up = board["up"]
        m = len(pool)
        if len(self._score) != m:
            self._score, self._fetch = np.empty(m), np.empty(m, dtype=np.bool_)
            self._ties = np.empty(m, dtype=np.int64)
        count, kappa = rank_rows(
            self._consts, now, req.input_tokens, req.block_tokens, best_len,
            -1 if best_src is None else board.row_of(best_src), prm.work_weight * spread,
            shut_rate, slo_s, open_s, prm.overlap_transfer, prm.tie_tolerance,
            prm.tie_tolerance_s, agg, j1, rows, up, board["busy_until"],
            board["queued_work_s"], board["iid"], local_view, self._score, self._fetch,
            self._ties,
            None if holders is None else holders.arrays(self.ctx.cost, board["place"]))
        return count, kappa, least

    @staticmethod
    def _pool_counts(pool: list[PrefillState], now: float) -> tuple[int, int]:
        """Live and idle instances of a large pool, from its load order."""
        order: LoadOrder = order_of(board_of(pool), LoadOrder)
        return order.live, order.live - order.busy(now)

    def _placement(self, o: Option, source: int | None) -> Placement:
        assert isinstance(self.params, ConductorParams)
        return Placement(
            prefill=o.iid, local_blocks=o.local, fetch_blocks=o.fetch,
            source=source if o.fetch else None, queue_s=o.queue_s, transfer_s=o.transfer_s,
            prefill_s=o.prefill_s, priority=o.priority,
            migrate=bool(o.fetch) and self.params.migrate_on_fetch,
        )

    def _cpp(
        self,
        req: RequestInfo,
        live: list[PrefillState],
        stored: npt.NDArray[np.int64],
        best_src: int | None,
        best_len: int,
        single: Placement,
        now: float,
        rescue: bool,
        kappa: float,
        rate: float,
        pool_size: int,
        pool_idle: int,
        holders: FetchSources | None = None,
    ) -> tuple[Placement, float, float] | None:
        """The best chunked-pipeline placement over the least-loaded instances, for prompts
        with at least ``min_new_tokens`` to compute, the wait of the arrivals it shuts out
        at ``rate`` per second, and the same for ``single`` (the one-instance option).
        Group sizes compete on the score: TTFT, ``kappa`` per GPU second, and that wait;
        for a ``rescue`` (``single`` breaks the TTFT SLO) only the groups that meet it do,
        and with none the fastest group is taken. A rescue no group of idle instances
        serves in time also tries the least-loaded instances as they come free, each
        group kept only if it can start at once and meets the SLO
        (``cpp.rescue_staggered``). ``live`` may be the pool's instances that free first
        only (:mod:`..candidates`): ``pool_size`` and ``pool_idle`` (-1: count ``live``)
        are then the whole pool's live and idle instances. With an active topology
        (``holders``: the prefix's holders) the leader fetches from the nearest holder, a
        group's hand-off runs over the slowest link between its members, and beside the
        groups of the instances that free first, each size is also priced as the group
        nearest each place (:func:`..topology.domain_orders`)."""
        assert isinstance(self.params, ConductorParams)
        cfg = self.params.cpp
        n = req.input_tokens
        if not cfg.enabled or cfg.max_group < 2 or len(live) < 2:
            return None
        if n - req.tokens_of(single.reused_blocks) < cfg.min_new_tokens:
            return None
        rng = self.ctx.rng
        order = {p.iid: (p.wait_time(now), rng.random()) for p in live}  # random among equals
        by_wait = sorted(live, key=lambda p: order[p.iid])
        idle = sum(1 for p in by_wait if order[p.iid][0] <= 0.0) if pool_idle < 0 else pool_idle
        largest = min(cfg.max_group, len(by_wait))
        if not rescue:
            # opportunistic: some of the pool stays out of it for what arrives next
            reserve = math.ceil(cfg.reserve_idle_share * pool_size)
            largest = min(largest, pool_size - reserve)
            limit = min(largest, idle - reserve)
        elif cfg.rescue_idle_only:
            limit = min(largest, idle)
        else:
            limit = largest
        best: tuple[Placement, float] | None = None
        best_key = (True, math.inf)  # (misses the SLO in a rescue, score or TTFT)
        options = [(size, False) for size in range(2, limit + 1)]
        if (cfg.rescue_idle_only and cfg.rescue_staggered) if rescue else \
                cfg.opportunistic_staggered:
            # the groups of idle instances were priced above; larger ones may take
            # members still busy that come free before their stage first works
            options += [(size, True) for size in range(max(2, limit + 1), largest + 1)]
        # a group's shut-out counts all its members (below), not one instance's
        prices = PoolPrices(kappa, 0.0, 0.0, -1, 0.0)
        pricers: dict[int, ChunkPricer] = {}  # by reused blocks (the leader's may differ)
        stored_of: list[int] = stored.tolist()  # Python ints: no numpy scalar per member
        cost, topo = self.ctx.cost, self.ctx.topology
        orders = domain_orders(topo, by_wait) if topo.active else [by_wait]
        for size, staggered in options:
            if staggered and rescue and not best_key[0]:
                break  # a group of idle instances meets the SLO
            first_wait = max(order[p.iid][0] for p in by_wait[:size])
            priced: set[frozenset[int]] = set()
            for members_order in orders:
                members = members_order[:size]
                if members_order is not by_wait:
                    ids = frozenset(p.iid for p in members)
                    if len(members) < size or ids in priced or (
                            not staggered and max(order[i][0] for i in ids) > first_wait):
                        continue  # no group of this size there, or one that waits longer
                    priced.add(ids)
                elif len(orders) > 1:
                    priced.add(frozenset(p.iid for p in members))
                leader = max(members, key=lambda p: (stored_of[p.iid], -order[p.iid][1]))
                local = stored_of[leader.iid]
                fetch = best_len - local if best_src is not None and best_len > local else 0
                reuse = local + fetch
                tokens = req.tokens_of(reuse) - req.tokens_of(local)
                source = best_src
                link = None  # the hand-off's link: the cost model's own
                if holders is None:
                    transfer = cost.transfer_time(tokens)
                else:
                    transfer = holders.time_to(cost, tokens, leader.place)
                    source = holders.source_for(cost, tokens, leader.place)
                if len(orders) > 1:
                    level = topo.group_level(p.place for p in members)
                    link = topo.link(cost, level) if level >= 0 else None
                pricer = pricers.get(reuse)
                if pricer is None:
                    pricer = pricers[reuse] = ChunkPricer(cost, n, req.tokens_of(reuse), cfg)
                chunk, makespan = pricer.choose(size, link)
                prio = req.arrival + self.params.priority_weight * makespan
                if staggered:
                    # members take stages in the order they come free; the group must start
                    # now
                    first_stage = first_stage_s(cost, n, req.tokens_of(reuse), size, chunk,
                                                link)
                    if staggered_start([p.wait_time(now, prio) for p in members],
                                       first_stage) > 0:
                        continue
                    wait = 0.0
                else:
                    wait = max(p.wait_time(now, prio) for p in members)
                # the group as one option of the stages (:mod:`..scoring`); its fetch
                # overlaps the wait for the last member
                group = Option(leader.iid, local, fetch, wait, max(0.0, transfer - wait),
                               makespan, prio, size=size)
                ttft = group.ttft_s
                late = rescue and ttft > self.ctx.slo.ttft_s
                if staggered and late:
                    continue  # a group with busy members only if it meets the SLO
                # members free at the group's end, the others as they are
                others = (by_wait[size:] if members_order is by_wait
                          else [p for p in by_wait if p not in members])
                shut_out = shut_out_wait(
                    chain([ttft] * size, (order[p.iid][0] for p in others)), rate)
                key = (late, ttft if late else score(group, prices) + shut_out)
                if key < best_key:
                    best_key = key
                    best = self._placement(group, source), shut_out
                    best[0].cpp_group = [leader.iid] + [p.iid for p in members
                                                        if p is not leader]
                    best[0].cpp_chunk_tokens = chunk
                    best[0].migrate = self.params.migrate_on_fetch
        if best is None:
            return None
        single_shut_out = shut_out_wait(
            (single.ttft_s if p.iid == single.prefill else order[p.iid][0] for p in live), rate)
        return best[0], best[1], single_shut_out
