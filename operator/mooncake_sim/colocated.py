"""Colocated baseline: vLLM-style instances that run prefill and decode on the same GPUs.

Each instance is one node of the cost model (the same hardware as one prefill or one
decode instance of :mod:`mooncake_sim.engine`), running continuous batching with
**chunked prefill** (vLLM's scheduler, FCFS):

- **Steps.** Every step has a token budget ``chunk_tokens`` (vLLM's
  ``max_num_batched_tokens``). Each running decode request takes one token of it; the rest
  is filled with prefill chunks, first of the requests already mid-prefill, then of waiting
  requests in arrival order. A request's first token comes out at the end of the step that
  runs its last chunk (TTFT = that time minus arrival); it decodes from the next step on.
- **Step time**: one forward pass for the step's chunks and decodes,
  :func:`mooncake_conductor.stepcost.mixed_step_time` (the simulated worker prices its
  steps the same way). **A decode step that carries a chunk takes the chunk's time on top
  of its own** — the interference the paper's claim rests on.

  Between arrivals, joins and finishes a pure-decode batch is constant, so steps advance
  in runs of at most ``chunk_steps`` at the step time of the run's start (as
  :mod:`mooncake_sim.engine` does); an arrival cuts a run at the end of the step then in
  progress.
- **KV memory.** A request is admitted to the running set (its first chunk scheduled)
  only when prompt plus output fit the instance's HBM KV capacity next to the running
  requests' reservations (the cost model's ``kv_capacity_tokens``, the figure the
  disaggregated decode pool uses); otherwise it waits, blocking the FCFS queue. There is
  no preemption: reservation up front is what makes it unnecessary.
- **Prefix cache.** Per instance an LRU over the trace's block keys, ``cache_tokens``
  tokens (default: the paper-fig5 preset's per-prefill-node DRAM cache, an LMCache-style
  offload tier). A request's prefix held there at admission skips prefill compute and is
  charged at host-to-device bandwidth; every prompt block is stored when its prefill ends.
  At least one prompt token is always computed.
- **Routing** (:mod:`mooncake_sim.colocated_route`): SGLang's cache-aware rule, llm-d's
  weighted scorers, or least load, each on the engines' precise prefix state.
- **Shedding** (off by default): a request is rejected at arrival when its predicted TTFT
  on the chosen instance exceeds the TTFT SLO: the step in progress, plus the queued
  prefill FLOPs (its own included) at the MFU of a full chunk, plus one step's fixed cost
  and decode share per chunk they need (:meth:`ColocatedSim.predicted_ttft`). The
  disaggregated Conductor sheds overload too, so capacity is shown both ways.

Execution is the cost model's times exactly (no prediction error): the colocated design
is not charged the disaggregated presets' lognormal noise, in its favour.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mooncake_conductor.cost import CostModel, CostModelConfig
from mooncake_conductor.policies.base import SLOConfig
from mooncake_conductor.stepcost import decode_share_time, mixed_step_time
from pydantic import BaseModel, ConfigDict, Field

from .colocated_route import InstanceLoad, LlmdWeights, SGLangRule, make_router
from .engine import SimConfig
from .metrics import latency_summary
from .presets import PRESETS
from .trace import TRACE_BLOCK_TOKENS, TraceRecord

#: per-instance prefix cache: the paper-fig5 preset's DRAM cache per prefill node (3M
#: tokens, paper §5), so the colocated node gets the same cache a disaggregated one does
DEFAULT_CACHE_TOKENS = PRESETS["paper-fig5"].prefill_cache_tokens
#: vLLM's ``max_num_batched_tokens`` with chunked prefill in its V0 engine (V1 raises it
#: to 8192 for API servers on large GPUs); the benchmark sweeps it
DEFAULT_CHUNK_TOKENS = 2048
#: longest run of pure-decode steps at one step time (the disaggregated sim's default)
DEFAULT_CHUNK_STEPS = SimConfig.model_fields["chunk_steps"].default
#: TBT = mean of this top share of a request's token intervals (the paper, as SimConfig)
DEFAULT_TBT_TOP_SHARE = SimConfig.model_fields["tbt_top_share"].default


class ColocatedConfig(BaseModel):
    """One colocated cluster and replay."""

    model_config = ConfigDict(extra="forbid")

    instances: int = Field(16, gt=0, description="colocated instances (one node each)")
    speed: float = Field(1.0, gt=0, description="replay speed: arrivals at timestamp / speed")
    cache_tokens: int = Field(DEFAULT_CACHE_TOKENS, ge=0,
                              description="prefix cache per instance, tokens (0 = none)")
    kv_capacity_tokens: int | None = Field(
        None, gt=0, description="KV capacity per instance (default: the cost model's, HBM)")
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, gt=0,
                              description="token budget per step (max_num_batched_tokens)")
    router: Literal["sglang-cache-aware", "llm-d", "least-load"] = "sglang-cache-aware"
    sglang: SGLangRule = SGLangRule()
    llmd: LlmdWeights = LlmdWeights()
    shedding: bool = Field(False, description="reject when the predicted TTFT misses the SLO")
    ttft_s: float = Field(SLOConfig().ttft_s, gt=0, description="TTFT SLO, seconds")
    tbt_s: float = Field(SLOConfig().tbt_s, gt=0, description="TBT SLO, seconds")
    tbt_top_share: float = Field(DEFAULT_TBT_TOP_SHARE, gt=0, le=1)
    seed: int = Field(0, description="router tie-breaks")
    block_tokens: int = Field(TRACE_BLOCK_TOKENS, gt=0)
    chunk_steps: int = Field(DEFAULT_CHUNK_STEPS, gt=0,
                             description="longest pure-decode run at constant step time")
    cost: CostModelConfig = CostModelConfig()


@dataclass(slots=True)
class _Inst:
    iid: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    waiting: deque[int] = field(default_factory=deque)
    prefilling: list[int] = field(default_factory=list)
    #: running decodes as ``(end step, admission number, request id)``
    running: list[tuple[int, int, int]] = field(default_factory=list)
    batch: int = 0
    context: int = 0
    reserved: int = 0
    steps: int = 0
    admitted: int = 0
    #: the instance's step history: every decode in the batch sees each of these
    seg_dt: list[float] = field(default_factory=list)
    seg_k: list[int] = field(default_factory=list)
    #: the step (or run of pure-decode steps) in flight
    busy: bool = False
    step_start: float = 0.0
    step_dt: float = 0.0
    step_k: int = 0
    step_chunks: list[tuple[int, int]] = field(default_factory=list)
    version: int = 0
    #: for the routers and the shedding prediction
    requests: int = 0
    queued: int = 0
    queued_flops: float = 0.0
    queued_tokens: int = 0


ARRIVE, STEP = 0, 1


class ColocatedSim:
    """One replay; :meth:`run` returns the result row, :meth:`served` the served requests'
    ``(ttft_s, tbt_s)`` (to score other SLOs from the same replay: only shedding, which
    reads the TTFT SLO, changes with the SLOs)."""

    def __init__(self, records: Sequence[TraceRecord], config: ColocatedConfig) -> None:
        self.cfg = config
        self.cost = CostModel(config.cost)
        self.kv_cap = config.kv_capacity_tokens or self.cost.kv_capacity_tokens
        self.cap_blocks = config.cache_tokens // config.block_tokens
        self.route = make_router(config.router, config.sglang, config.llmd)
        self.rng = random.Random(config.seed)
        self.insts = [_Inst(iid=i) for i in range(config.instances)]
        n = len(records)
        self.arrival = [r.timestamp_ms / 1000.0 / config.speed for r in records]
        self.n_in = [r.input_length for r in records]
        self.n_out = [max(1, r.output_length) for r in records]
        self.keys = [r.hash_ids for r in records]
        self.where = [-1] * n
        self.done = [0] * n  # prompt tokens in KV (cached + computed)
        self.reused = [0] * n
        self.expect = [0] * n  # new tokens the shedding prediction counted at arrival
        self.ttft = [math.nan] * n
        self.tbt = [math.nan] * n
        self.s0 = [0] * n
        self.seg0 = [0] * n
        self.rejected = [False] * n
        self.kv_waited = [False] * n
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.prefill_steps = 0
        self.decode_steps = 0
        self.kv_waits = 0

    # -- events -------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        for rid, t in enumerate(self.arrival):
            self._push(t, ARRIVE, rid)
        events = self._events
        while events:
            t, _, kind, a, b = heapq.heappop(events)
            if kind == ARRIVE:
                self._arrive(t, a)
            else:
                inst = self.insts[a]
                if b == inst.version:
                    self._step_end(t, inst)
        return self._results(time.perf_counter() - started)

    # -- cache --------------------------------------------------------------------------------
    def _matched_tokens(self, inst: _Inst, rid: int) -> int:
        cache = inst.cache
        k = 0
        for key in self.keys[rid]:
            if key not in cache:
                break
            k += 1
        return min(k * self.cfg.block_tokens, self.n_in[rid])

    def _store(self, inst: _Inst, rid: int) -> None:
        if self.cap_blocks <= 0:
            return
        cache = inst.cache
        for key in self.keys[rid]:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        while len(cache) > self.cap_blocks:
            cache.popitem(last=False)

    # -- arrivals -----------------------------------------------------------------------------
    def _arrive(self, now: float, rid: int) -> None:
        matched = [self._matched_tokens(inst, rid) for inst in self.insts]
        loads = [InstanceLoad(requests=inst.requests, queued=inst.queued,
                              kv_usage=inst.reserved / self.kv_cap,
                              cached_tokens=len(inst.cache) * self.cfg.block_tokens,
                              matched_tokens=m) for inst, m in zip(self.insts, matched,
                                                                   strict=True)]
        inst = self.insts[self.route(loads, self.n_in[rid], self.rng)]
        cached = min(matched[inst.iid], self.n_in[rid] - 1)
        new = self.n_in[rid] - cached
        flops = self.cost.flops(self.n_in[rid]) - self.cost.flops(cached)
        if self.cfg.shedding and self.predicted_ttft(inst, now, new, flops) > self.cfg.ttft_s:
            self.rejected[rid] = True
            return
        self.where[rid] = inst.iid
        self.expect[rid] = new
        inst.requests += 1
        inst.queued += 1
        inst.queued_flops += flops
        inst.queued_tokens += new
        inst.waiting.append(rid)
        if not inst.busy:
            self._plan(inst, now)
        elif not inst.step_chunks and inst.step_k > 1:
            # cut a pure-decode run at the end of the step in progress
            k = min(inst.step_k, int((now - inst.step_start) / inst.step_dt) + 1)
            if k < inst.step_k:
                inst.step_k = k
                inst.version += 1
                self._push(inst.step_start + k * inst.step_dt, STEP, inst.iid, inst.version)

    def predicted_ttft(self, inst: _Inst, now: float, new_tokens: int, flops: float) -> float:
        """TTFT a request of ``new_tokens`` new prompt tokens costing ``flops`` would see on
        ``inst`` now: the rest of the step in flight, then every queued prefill (its own
        included) in full chunks, each step paying the pass's fixed cost and the current
        decode batch's share (KV waits and new arrivals are not foreseen)."""
        rest = max(0.0, inst.step_start + inst.step_k * inst.step_dt - now) if inst.busy else 0.0
        tokens = inst.queued_tokens + new_tokens
        per_step = max(1, self.cfg.chunk_tokens - inst.batch)
        steps = math.ceil(tokens / per_step)
        compute = (inst.queued_flops + flops) / self.cost.prefill_flops_rate(min(tokens, per_step))
        fixed = self.cost.prefill_overhead_s + decode_share_time(self.cost, inst.batch,
                                                                 inst.context)
        return rest + compute + steps * fixed

    # -- steps --------------------------------------------------------------------------------
    def _plan(self, inst: _Inst, now: float) -> None:
        """Schedule the next step (or run of pure-decode steps) of ``inst`` from ``now``."""
        budget = self.cfg.chunk_tokens - inst.batch
        chunks: list[tuple[int, int]] = []
        flops = 0.0
        tokens = 0
        load = 0
        n_in, done, fl = self.n_in, self.done, self.cost.flops
        if budget > 0:
            for rid in inst.prefilling:
                take = min(n_in[rid] - done[rid], budget)
                chunks.append((rid, take))
                flops += fl(done[rid] + take) - fl(done[rid])
                tokens += take
                budget -= take
                if not budget:
                    break
            while budget > 0 and inst.waiting:
                rid = inst.waiting[0]
                need = n_in[rid] + self.n_out[rid]
                if inst.reserved + need > self.kv_cap and (inst.batch or inst.prefilling):
                    if not self.kv_waited[rid]:
                        self.kv_waited[rid] = True
                        self.kv_waits += 1
                    break
                inst.waiting.popleft()
                inst.reserved += need
                cached = self._admit_cached(inst, rid)
                load += cached
                inst.prefilling.append(rid)
                take = min(n_in[rid] - cached, budget)
                chunks.append((rid, take))
                flops += fl(cached + take) - fl(cached)
                tokens += take
                budget -= take
        inst.step_chunks = chunks
        inst.version += 1
        inst.step_start = now
        if chunks:
            inst.step_k = 1
            inst.step_dt = mixed_step_time(self.cost, inst.batch, inst.context, flops, tokens,
                                           load)
            self.prefill_steps += 1
        elif inst.batch:
            inst.step_k = min(inst.running[0][0] - inst.steps, self.cfg.chunk_steps)
            inst.step_dt = self.cost.decode_step_time(inst.batch, inst.context)
        else:
            inst.busy = False
            inst.step_k = 0
            return
        inst.busy = True
        self._push(now + inst.step_k * inst.step_dt, STEP, inst.iid, inst.version)

    def _admit_cached(self, inst: _Inst, rid: int) -> int:
        """Prefix tokens ``rid`` reuses on ``inst`` now (touched in the LRU); the shedding
        prediction's count is corrected to them."""
        cached = min(self._matched_tokens(inst, rid), self.n_in[rid] - 1)
        if cached:
            cache = inst.cache
            for key in self.keys[rid][: -(-cached // self.cfg.block_tokens)]:
                cache.move_to_end(key)
        self.done[rid] = cached
        self.reused[rid] = cached
        fl = self.cost.flops
        n = self.n_in[rid]
        new = n - cached
        inst.queued_tokens += new - self.expect[rid]
        inst.queued_flops += (fl(n) - fl(cached)) - (fl(n) - fl(n - self.expect[rid]))
        self.expect[rid] = new
        return cached

    def _step_end(self, now: float, inst: _Inst) -> None:
        k = inst.step_k
        if inst.batch:
            inst.seg_dt.append(inst.step_dt)
            inst.seg_k.append(k)
            self.decode_steps += k
            inst.context += inst.batch * k
        inst.steps += k
        running = inst.running
        while running and running[0][0] <= inst.steps:
            self._finish(inst, heapq.heappop(running)[2])
        fl = self.cost.flops
        for rid, take in inst.step_chunks:
            d = self.done[rid]
            inst.queued_flops -= fl(d + take) - fl(d)
            inst.queued_tokens -= take
            self.done[rid] = d + take
            if d + take >= self.n_in[rid]:
                self._first_token(inst, rid, now)
        inst.step_chunks = []
        self._plan(inst, now)

    def _first_token(self, inst: _Inst, rid: int, now: float) -> None:
        self.ttft[rid] = now - self.arrival[rid]
        inst.prefilling.remove(rid)
        inst.queued -= 1
        self._store(inst, rid)
        if self.n_out[rid] <= 1:
            self.tbt[rid] = 0.0
            inst.reserved -= self.n_in[rid] + self.n_out[rid]
            inst.requests -= 1
            return
        self.s0[rid] = inst.steps
        self.seg0[rid] = len(inst.seg_dt)
        heapq.heappush(inst.running, (inst.steps + self.n_out[rid] - 1, inst.admitted, rid))
        inst.admitted += 1
        inst.batch += 1
        inst.context += self.n_in[rid] + 1

    def _finish(self, inst: _Inst, rid: int) -> None:
        inst.batch -= 1
        inst.context -= self.n_in[rid] + 1 + inst.steps - self.s0[rid]
        inst.reserved -= self.n_in[rid] + self.n_out[rid]
        inst.requests -= 1
        s0 = self.seg0[rid]
        intervals = sorted(zip(inst.seg_dt[s0:], inst.seg_k[s0:], strict=True), reverse=True)
        total = self.n_out[rid] - 1
        take = max(1, math.ceil(total * self.cfg.tbt_top_share))
        acc, left = 0.0, take
        for dt, c in intervals:
            use = min(c, left)
            acc += dt * use
            left -= use
            if not left:
                break
        self.tbt[rid] = acc / take

    # -- results ------------------------------------------------------------------------------
    def served(self) -> list[tuple[float, float]]:
        """``(ttft_s, tbt_s)`` of every request served (after :meth:`run`)."""
        return [(self.ttft[i], self.tbt[i]) for i in range(len(self.ttft))
                if not self.rejected[i]]

    def _results(self, wall: float) -> dict[str, Any]:
        n = len(self.arrival)
        served = self.served()
        rejected = sum(self.rejected)
        prompt = sum(self.n_in[i] for i in range(n) if not self.rejected[i])
        reused = sum(self.reused[i] for i in range(n) if not self.rejected[i])
        latency = latency_summary(served, n, self.cfg.ttft_s, self.cfg.tbt_s)
        return {
            "policy": f"colocated/{self.cfg.router}",
            "requests": n,
            "completed": len(served),
            "rejected": rejected,
            "reject_reasons": {"overload": rejected} if rejected else {},
            **latency,
            "token_hit_ratio": reused / prompt if prompt else 0.0,
            "chunk_tokens": self.cfg.chunk_tokens,
            "instances": self.cfg.instances,
            "shedding": self.cfg.shedding,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "kv_waits": self.kv_waits,
            "simulated_seconds": max(self.arrival, default=0.0),
            "wall_seconds": wall,
        }


def simulate_colocated(records: Sequence[TraceRecord], config: ColocatedConfig) -> dict[str, Any]:
    """Replay ``records`` on a colocated cluster; one result row (the key names of
    :func:`mooncake_sim.engine.simulate` where they apply)."""
    return ColocatedSim(records, config).run()
