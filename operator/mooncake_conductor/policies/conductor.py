"""``conductor``: our scheduler, Algorithm 1 of the Mooncake paper, improved.

Rule: for every live prefill instance consider both ways to serve the prompt —
recompute past the instance's own prefix, or fetch the longest prefix any
holder (instance or store pool) has — and predict
``TTFT = max(T_queue, T_transfer) + T_prefill``; pick the smallest, reject
(429) when it or the decode side's TBT breaks its SLO.

Where it differs from the paper's Algorithm 1 (``kvcache-centric``), and why:

1. **Fetch vs recompute by cost, not by a ratio threshold.** The paper fetches
   when ``best_len / len`` passes ``kvcache_balancing_threshold``; we compare
   the two predicted TTFTs directly, which is what the threshold approximates.
2. **Transfer overlaps the queue.** A fetch starts when the request is placed,
   while earlier work still runs on the GPU, so only the part of the transfer
   longer than the wait delays the prefill (paper §4 adds the two).
3. **In-flight prefixes count.** Blocks a queued prefill on an instance will
   have written before this request runs there are matched as if cached
   (vLLM-style engines reuse them), so a burst of requests sharing a new
   prefix follows the first one instead of recomputing it everywhere.
4. **Short jobs first, with aging.** Each request gets the queue priority
   ``arrival + priority_weight * predicted_prefill``, so a short prompt may
   pass a longer one only if it arrived less than ``priority_weight`` times
   the difference of their prefill times later. Queue time is predicted for
   that order. With heavy-tailed prompt lengths this is the shortest-
   processing-time rule that cuts mean waiting most, aged so that long
   prompts are never starved.
5. **No pile-ups on ties.** Instances whose predicted TTFT is within
   ``tie_tolerance`` of the best are chosen among at random, so a hot shared
   prefix held everywhere does not send every request to instance 0.
6. **Chunked pipeline prefill for long prompts** (paper §3.2, which uses it
   but leaves the when open). When a prompt needs at least
   ``cpp.min_new_tokens`` of new compute, groups of 2..``cpp.max_group``
   instances with the shortest queues are priced with the CPP pipeline model
   (:mod:`mooncake_conductor.cpp`) whenever the best single instance would
   break the TTFT SLO; the best group is used if it does better. Prompts no
   single instance could prefill in time are served instead of rejected, and
   CPP's pipeline bubbles are paid only where they buy an SLO.
7. **Hot prefixes replicated ahead of need** (seed §7): a prefix accessed
   often whose holders are all loaded past the average gets copied to a cool
   instance (:mod:`mooncake_conductor.replication`), instead of waiting for
   fetches to spread it one request at a time.
8. **Decode under TBT.** The default decode selector is ``tbt-slo`` (predicted
   step time with this request added must stay under the TBT SLO).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..cpp import CPPConfig, plan_cpp
from ..state import ClusterState, PrefillState, RequestInfo
from .base import Placement, PrefillPolicy, register


class ConductorParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority_weight: float = Field(
        2.0, ge=0, description="queue priority = arrival + weight * predicted prefill (0 = FIFO)"
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
    explain: bool = Field(False, description="attach the top candidates to each placement")
    cpp: CPPConfig = CPPConfig()


_AFTER = 1e-6  # priority step that orders a request right after another


@register
class ConductorPolicy(PrefillPolicy):
    name = "conductor"
    Params = ConductorParams
    default_decode = "tbt-slo"
    admission = True
    replication = True

    def choose(self, req: RequestInfo, cluster: ClusterState, now: float) -> Placement:
        assert isinstance(self.params, ConductorParams)
        prm = self.params
        live = [p for p in cluster.prefill if p.up]
        if not live:
            return Placement(prefill=None, reject_reason="no-prefill-instance")
        cost = self.ctx.cost
        index = cluster.index
        search = cluster.prefill_mask
        if cluster.store_id is not None:
            search |= 1 << cluster.store_id
        stored = index.match_all(req.keys, search)
        local_view = (
            index.match_all(req.keys, cluster.prefill_mask, include_pending=True)
            if prm.include_pending
            else stored
        )
        best_src, best_len = None, 0
        for iid, m in stored.items():
            if m > best_len:
                best_src, best_len = iid, m
        n = req.input_tokens
        best_tokens = req.tokens_of(best_len)
        fetch_prefill = cost.prefill_time(n, best_tokens)
        options: list[Placement] = []
        for p in live:
            local = local_view.get(p.iid, 0)
            local_tokens = req.tokens_of(local)
            recompute = cost.prefill_time(n, local_tokens)
            prio = req.arrival + prm.priority_weight * recompute
            if local > stored.get(p.iid, 0) and p.queue:
                # reusing blocks a queued prefill will write: never jump ahead of it
                prio = max(prio, max(q.priority for q in p.queue) + _AFTER)
            queue = p.wait_time(now, prio)
            option = Placement(
                prefill=p.iid, local_blocks=local, queue_s=queue, prefill_s=recompute,
                priority=prio,
            )
            if best_len > local and best_src != p.iid:
                transfer = cost.transfer_time(best_tokens - local_tokens)
                f_prio = req.arrival + prm.priority_weight * fetch_prefill
                f_queue = p.wait_time(now, f_prio)
                if prm.overlap_transfer:
                    f_wait, f_transfer = f_queue, max(0.0, transfer - f_queue)
                else:
                    f_wait, f_transfer = f_queue, transfer
                if f_wait + f_transfer + fetch_prefill < option.ttft_s:
                    option = Placement(
                        prefill=p.iid, local_blocks=local, fetch_blocks=best_len - local,
                        source=best_src, queue_s=f_wait, transfer_s=f_transfer,
                        prefill_s=fetch_prefill, priority=f_prio,
                        migrate=prm.migrate_on_fetch,
                    )
            options.append(option)
        # score = TTFT + kappa x GPU seconds. Work a choice adds delays the requests that
        # would have used that time: on average the busy share of the pool plus the
        # requests already waiting per instance (0 when idle: pure TTFT).
        busy = sum(1 for p in live if p.busy_until > now or p.queue)
        waiting = sum(len(p.queue) for p in live)
        kappa = prm.work_weight * (busy + waiting) / len(live)

        def score(o: Placement) -> float:
            return o.ttft_s + kappa * o.gpu_seconds

        best = min(score(o) for o in options)
        band = best * (1.0 + prm.tie_tolerance) + prm.tie_tolerance_s
        ties = [o for o in options if score(o) <= band]
        no_copy = [o for o in ties if not o.fetch_blocks]  # a tie never pays a new copy
        ties = no_copy or ties
        choice = ties[0] if len(ties) == 1 else self.ctx.rng.choice(ties)
        cpp = self._cpp(req, live, stored, choice, now)
        if cpp is not None:
            options.append(cpp)
            rescue = choice.ttft_s > prm.cpp.trigger_share * self.ctx.slo.ttft_s
            if (rescue and cpp.ttft_s < choice.ttft_s) or score(cpp) < score(choice):
                choice = cpp
        if prm.explain:
            choice.candidates = [
                {"instance": float(o.prefill or 0), "ttft_s": o.ttft_s, "queue_s": o.queue_s,
                 "transfer_s": o.transfer_s, "prefill_s": o.prefill_s,
                 "group": float(len(o.cpp_group) or 1)}
                for o in sorted(options, key=lambda o: o.ttft_s)[:5]
            ]
        return choice

    def _cpp(
        self,
        req: RequestInfo,
        live: list[PrefillState],
        stored: dict[int, int],
        single: Placement,
        now: float,
    ) -> Placement | None:
        """The best chunked-pipeline placement over the least-loaded instances, for prompts
        with at least ``min_new_tokens`` to compute."""
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
        best_src, best_len = None, 0
        for iid, m in stored.items():
            if m > best_len:
                best_src, best_len = iid, m
        best: Placement | None = None
        for size in range(2, min(cfg.max_group, len(by_wait)) + 1):
            members = by_wait[:size]
            leader = max(members, key=lambda p: (stored.get(p.iid, 0), -order[p.iid][1]))
            local = stored.get(leader.iid, 0)
            fetch = best_len - local if best_src is not None and best_len > local else 0
            reuse = local + fetch
            transfer = self.ctx.cost.transfer_time(req.tokens_of(reuse) - req.tokens_of(local))
            plan = plan_cpp(self.ctx.cost, n, req.tokens_of(reuse), size, cfg.chunk_tokens)
            prio = req.arrival + self.params.priority_weight * plan.makespan_s
            wait = max(p.wait_time(now, prio) for p in members)
            if best is None or max(wait, transfer) + plan.makespan_s < best.ttft_s:
                best = Placement(
                    prefill=leader.iid, local_blocks=local, fetch_blocks=fetch,
                    source=best_src if fetch else None, queue_s=wait,
                    transfer_s=max(0.0, transfer - wait), prefill_s=plan.makespan_s,
                    priority=prio,
                    cpp_group=[leader.iid] + [p.iid for p in members if p is not leader],
                    cpp_chunk_tokens=cfg.chunk_tokens,
                    migrate=self.params.migrate_on_fetch,
                )
        return best
