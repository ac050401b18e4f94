"""Discrete-event replay of a Mooncake-format trace through the Conductor core.

Model (one run):

- **Arrivals** at ``timestamp / speed``. Each asks :class:`~mooncake_conductor.engine.Conductor`
  for a decision; rejections are final (HTTP 429 in the real gateway).
- **Prefill instances** serve their queue one prompt at a time, in the queue's
  priority order (FIFO unless the policy sets priorities). When a prompt
  starts, it reuses what the instance *actually* holds then (its own LRU
  cache, which may have changed since the decision), plus the blocks the
  decision fetched from another holder, if the holder still had them when the
  fetch ran. A fetch starts at placement and runs over the network while the
  prompt queues; the GPU cannot start the prompt before the fetch ends. Run
  time is the cost model's prefill time. On completion every block of the
  prompt is stored in the instance's cache (and the shared store pool, when
  there is one): replication of fetched blocks is a side effect.
- **Decode instances** run continuous batching. Between joins and finishes the
  batch is constant, so steps are advanced in chunks of at most
  ``chunk_steps`` with the cost model's step time at the chunk's start; a
  request joins at the next step boundary after its KV arrives. By default the KV
  streams layer by layer during the prefill (paper §3), so it arrives the last
  layer's share of the transfer after the prefill ends; with ``kv_handoff``
  ``after-prefill`` the decode instance pulls all of it once the prefill ends, as
  vLLM's Mooncake connector does (its ``save_kv_layer`` does nothing) and the
  simulated worker models. Requests reserve KV for prompt plus output and wait when
  the instance is full.
- **Metrics**: TTFT = first token (end of prefill) minus arrival; TBT = mean of
  the longest 10% of a request's token intervals (paper §5); a request meets
  the SLO when served with TTFT and TBT under their thresholds. Where a client's
  first token comes from the decode engine instead (vLLM's and SGLang's P/D serving,
  the gateway), its TTFT ends with the decode instance's first step after the KV
  arrived: ``client_ttft_mean_s``, beside the rest.

Realism, off by default and on in the presets (``SimConfig``), the same for every policy:

- **Prediction error**: a prompt runs for the cost model's prediction times a per-request
  lognormal factor (median 1, ``prediction_error`` = sigma), times ``1 + model_bias`` (a
  systematic error, e.g. the true MFU off the configured one; decode steps too), plus
  ``prefill_overhead_s`` (a serving stack's own time per prefill, none of it predicted).
  With ``engine_chunk_tokens`` a prompt longer than that budget runs as several passes
  (:func:`~mooncake_conductor.stepcost.chunked_prefill_time`), as a vLLM engine with
  chunked prefill runs it; predictions stay one pass per prompt. Policies
  see predictions only: an instance's ``busy_until`` is the predicted end, corrected when
  the completion arrives.
- **NIC contention**: prefix fetches and hot-prefix copies queue on the sending and the
  receiving node's NIC (the store pool has ``store_links`` of them), so concurrent
  transfers slow each other. The KV stream from prefill to decode is not modelled on the
  NIC (it overlaps the prefill layer by layer, paper §3).
- **Event lag**: the index (the gateway's view) learns blocks an instance stored only
  ``event_lag_ms`` later; the instance itself reuses them at once.
- **Topology** (``domains`` with the conductor's ``topology.levels``): instances get
  places, and every transfer is charged by the link between them
  (:class:`~mooncake_conductor.topology.Topology`), whether or not decisions see it:
  fetches and copies, CPP hand-offs (the slowest link of the group), and the stream to
  decode, which also cannot end before the prefill's start plus its whole time over the
  link (:meth:`~mooncake_conductor.topology.Topology.stream_join`).

Work stealing (policies that steal, :mod:`mooncake_conductor.stealing`): when a prefill
instance finishes with nothing queued, the Conductor may move a prompt queued on another
instance to it; the prompt keeps its decode choice and its place in priority order, and
a fetch its old placement started keeps its NIC time.

Holding (policies that hold, :mod:`mooncake_conductor.holding`): a request refused only
for decode room waits, and is scheduled afresh, oldest first, each time a decode
instance finishes a request; it is rejected when its hold ends (the latest start that
could still meet the TTFT SLO). Its TTFT counts from its arrival.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from mooncake_conductor.blockkeys import namespace_seed, trace_block_keys_many
from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import plan_cpp, staggered_start
from mooncake_conductor.engine import Conductor, ConductorConfig, Decision
from mooncake_conductor.index import DRAM, STORE, PrefixIndex
from mooncake_conductor.policies.base import Placement
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo
from mooncake_conductor.stepcost import chunked_prefill_time
from mooncake_conductor.topology import assign_places
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .gcpause import gc_paused
from .metrics import latency_summary
from .replicas import ReplicaViews
from .trace import TRACE_BLOCK_TOKENS, TraceRecord

#: bounds of the realism knobs (beyond them the model says nothing useful)
MAX_PREDICTION_SIGMA = 2.0
MAX_MODEL_BIAS = 4.0
MAX_PREFILL_OVERHEAD_S = 10.0
#: the error factors' random stream is the policy seed plus this, apart from the policy's
ERROR_SEED_OFFSET = 7919
#: completed prefills per entry of ``prediction_error_windows``
ERROR_WINDOW = 200


class SimConfig(BaseModel):
    """One simulated cluster and replay."""

    model_config = ConfigDict(extra="forbid")

    prefill: int = Field(16, gt=0, description="prefill instances")
    decode: int = Field(16, gt=0, description="decode instances")
    speed: float = Field(1.0, gt=0, description="replay speed: arrivals at timestamp / speed")
    prefill_cache_tokens: int = Field(
        3_000_000, gt=0, description="local KV cache (DRAM) per prefill instance, tokens"
    )
    store_tokens: int = Field(0, ge=0, description="shared store pool, tokens (0 = none)")
    decode_capacity_tokens: int | None = Field(
        None, gt=0, description="KV capacity per decode instance (default: from HBM size)"
    )
    block_tokens: int = Field(TRACE_BLOCK_TOKENS, gt=0)
    chunk_steps: int = Field(32, gt=0, description="longest decode chunk at constant step time")
    tbt_top_share: float = Field(0.1, gt=0, le=1, description="TBT = mean of this top share")
    prediction_error: float = Field(
        0.0, ge=0, le=MAX_PREDICTION_SIGMA,
        description="sigma of the per-request lognormal factor on prefill time (0: exact)")
    model_bias: float = Field(
        0.0, gt=-1, le=MAX_MODEL_BIAS,
        description="execution = prediction x (1 + bias), prefill and decode (0: unbiased)")
    prefill_overhead_s: float = Field(
        0.0, ge=0, le=MAX_PREFILL_OVERHEAD_S,
        description="seconds every prefill runs beyond the model, unpredicted (a serving "
        "stack's own time: HTTP hops, scheduling; 0: none)")
    engine_chunk_tokens: int = Field(
        0, ge=0, description="prefill engines' step budget (vLLM's max_num_batched_tokens): "
        "a longer prompt runs as several passes, each with its own fixed cost, unpredicted "
        "(0: one pass per prompt, the paper's engines)")
    event_lag_ms: float = Field(
        0.0, ge=0, description="delay before the index sees blocks an instance stored, ms")
    nic_contention: bool = Field(
        False, description="KV fetches and copies queue on each node's NIC")
    store_links: int = Field(1, gt=0, description="the store pool's bandwidth, in NICs")
    long_prompt_tokens: int = Field(
        65_536, gt=0, description="prompts at least this long are also reported on their own")
    domains: list[int] = Field(
        default_factory=list, description="domains per topology level of the conductor's "
        "config, finest first (each nests in the next coarser); empty: a flat fleet")
    domain_assignment: Literal["blocked", "round-robin"] = Field(
        "blocked", description="instance i of each pool goes to finest domain "
        "i * domains[0] // pool size (blocked) or i % domains[0] (round-robin)")
    replicas: int = Field(1, gt=0, description="Conductor replicas behind a round-robin "
                          "front (replicas.py); 1: one Conductor")
    replica_lag_ms: float = Field(
        0.0, ge=0, description="how late a replica hears of the others' placements, ms "
        "(inf: never, each sees only its own)")
    kv_handoff: Literal["layerwise", "after-prefill"] = Field(
        "layerwise", description="how a prompt's KV reaches its decode instance: streamed "
        "layer by layer during the prefill (paper §3) or pulled whole once the prefill "
        "ends (vLLM's Mooncake connector, the simulated worker)")
    max_tokens: int | None = Field(
        None, ge=1, description="the max_tokens every request asks for, all the Conductor "
        "knows of its output: it books input + max_tokens on its decode instance; the "
        "stream stops at its trace length or there (None: each request asks its trace "
        "length, as the replay client sends it)")
    conductor: ConductorConfig = ConductorConfig()
    progress: bool = False

    @model_validator(mode="after")
    def _domains_match_levels(self) -> SimConfig:
        levels = self.conductor.topology.levels
        if len(self.domains) != len(levels):
            raise ValueError(f"domains needs one count per topology level ({len(levels)}), "
                             f"got {len(self.domains)}")
        if self.domains and (min(self.domains) < 1 or max(self.domains) > self.domains[0]):
            raise ValueError("every level needs at least one domain, at most the finest's")
        return self


@dataclass(slots=True)
class _Req:
    info: RequestInfo
    #: tokens the stream really gets (``info.output_tokens`` is what it asked for, the
    #: Conductor's only knowledge of it)
    output_len: int = 1
    decision: Decision | None = None
    placed_at: float = 0.0
    ttft: float = math.nan
    tbt: float = math.nan
    #: the first token the decode engine gives, after the arrival (a P/D client's TTFT)
    client_ttft: float = math.nan
    reused_tokens: int = 0
    t_first: float = 0.0
    #: the decoder's step count when this request joined, and when it has decoded all
    end_step: int = 0
    s0: int = 0
    seg0: int = 0
    exec_s: float = 0.0
    predicted_s: float = 0.0


@dataclass(slots=True)
class _Decoder:
    state: DecodeState
    #: the batch as a heap of ``(end step, admission number, request id)``: every running
    #: request decodes one token per step, so the soonest to finish is on top and a step
    #: costs nothing per request (a request's context is its prompt + 1 + steps since it
    #: joined)
    running: list[tuple[int, int, int]] = field(default_factory=list)
    waiting: deque[int] = field(default_factory=deque)
    last: float = 0.0
    steps: int = 0
    admitted: int = 0
    version: int = 0
    #: prompt plus output of every admitted request (what the engine's admission checks:
    #: the KV it will hold)
    reserved: int = 0
    #: prompt plus max_tokens of every admitted request (what a gateway books); the state
    #: shows the scheduler the part not yet in ``context_tokens`` as ``reserved_tokens``
    booked: int = 0
    seg_start: list[float] = field(default_factory=list)
    seg_dt: list[float] = field(default_factory=list)
    seg_steps: list[int] = field(default_factory=list)


(ARRIVE, PREFILL_DONE, DECODE_JOIN, DECODE_WAKE, REPLICATE, REPLICA_DONE, VISIBLE,
 HOLD_END, OVERDUE) = range(9)


class Simulation:
    def __init__(self, records: list[TraceRecord], config: SimConfig) -> None:
        with gc_paused():
            self._setup(records, config)

    def _setup(self, records: list[TraceRecord], config: SimConfig) -> None:
        self.cfg = config
        # the true model executes; the Conductor predicts with its own copy (which online
        # calibration may rescale), so a biased or calibrated model never changes execution
        self.cost = CostModel(config.conductor.cost)
        self.conductor = Conductor(config.conductor)
        bt = config.block_tokens
        n_p = config.prefill
        self.index = PrefixIndex(max(1, config.prefill_cache_tokens // bt), instances=n_p)
        store_id = None
        if config.store_tokens > 0:
            store_id = n_p
            self.index.add_instance(store_id, max(1, config.store_tokens // bt))
        dec_cap = config.decode_capacity_tokens or self.cost.kv_capacity_tokens
        self.cluster = ClusterState(
            prefill=[
                PrefillState(iid=i, name=f"prefill-{i}",
                             cache_capacity_tokens=config.prefill_cache_tokens)
                for i in range(n_p)
            ],
            decode=[
                DecodeState(iid=i, name=f"decode-{i}", capacity_tokens=dec_cap)
                for i in range(config.decode)
            ],
            index=self.index,
            store_id=store_id,
        )
        self.decoders = [_Decoder(state=d) for d in self.cluster.decode]
        # places: the conductor's topology interns them; the simulator charges the true
        # costs between them whether or not decisions use them
        self.topology = self.conductor.topology
        names = [lv.name for lv in self.topology.levels]
        blocked = config.domain_assignment == "blocked"
        for pool in (self.cluster.prefill, self.cluster.decode):
            for st, labels in zip(pool, assign_places(len(pool), config.domains, names,
                                                      blocked), strict=True):
                st.place = self.topology.place_id(labels)
        keys = trace_block_keys_many([r.hash_ids for r in records],
                                     namespace_seed("trace", bt))
        self.reqs: list[_Req] = []
        for rid, r in enumerate(records):
            out = max(1, r.output_length)
            info = RequestInfo(
                rid=rid,
                arrival=r.timestamp_ms / 1000.0 / config.speed,
                input_tokens=r.input_length,
                output_tokens=out if config.max_tokens is None else config.max_tokens,
                keys=keys[rid],
                block_tokens=bt,
            )
            self.reqs.append(_Req(info=info, output_len=min(out, info.output_tokens)))
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._chunk = config.chunk_steps
        self._pull_kv = config.kv_handoff == "after-prefill"
        self.prefill_gpu_s = 0.0
        self.reject_reasons: dict[str, int] = {}
        self._running_rid: list[int] = [-1] * n_p
        #: per CPP request, its members that reached it and when
        self._gangs: dict[int, dict[int, float]] = {}
        self._replicas: dict[int, Any] = {}
        self._replica_seq = 0
        self.replicated_tokens = 0
        self.steals = 0
        #: held requests (refused for decode room) -> the end of their hold, oldest first
        self._holding: dict[int, float] = {}
        self.held = 0
        self._now = 0.0
        self._gang_order: dict[int, int] = {}
        self._gang_counter = 0
        # realism: execution factors, NIC queues, blocks stored but not yet visible
        n = len(self.reqs)
        self._slow = 1.0 + config.model_bias
        self._factor = np.full(n, self._slow)
        if config.prediction_error > 0 and n:
            rng = np.random.default_rng(config.conductor.seed + ERROR_SEED_OFFSET)
            self._factor *= rng.lognormal(0.0, config.prediction_error, n)
        self._nic_free = [0.0] * n_p
        self._store_free = [0.0] * config.store_links
        self._fetch_end: dict[int, float] = {}
        self._lag = config.event_lag_ms / 1000.0
        self._unseen: dict[int, dict[int, tuple[Sequence[int], int]]] = {}
        self._unseen_seq = 0
        self.predicted_prefill_s = 0.0
        self._pairs: list[tuple[float, float]] = []  # (predicted, executed) per prefill
        #: (start, predicted seconds) of the prefill running on each instance
        self._started: dict[int, tuple[float, float]] = {}
        self.replicas = ReplicaViews(config.replicas, config.replica_lag_ms / 1000.0)

    # -- event queue ---------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def run(self) -> dict[str, Any]:
        with gc_paused():
            return self._run()

    def _run(self) -> dict[str, Any]:
        started = time.perf_counter()
        for req in self.reqs:
            self._push(req.info.arrival, ARRIVE, req.info.rid)
        if self.conductor.capabilities.replication and self.reqs:
            self._push(self.reqs[0].info.arrival, REPLICATE, 0)
        last_arrival = self.reqs[-1].info.arrival if self.reqs else 0.0
        total = len(self.reqs)
        done_arrivals = 0
        next_report = 0.1
        events = self._events
        pop = heapq.heappop
        decoders = self.decoders
        progress = self.cfg.progress
        while events:
            t, _, kind, a, b = pop(events)
            self._now = t
            if kind == DECODE_WAKE:  # the most frequent kind first: a chunk of decode steps
                dec = decoders[a]
                if b == dec.version:
                    self._schedule_wake(dec, self._advance(dec, t))
            elif kind == ARRIVE:
                self._arrive(t, a)
                done_arrivals += 1
                if progress and done_arrivals / total >= next_report:
                    self._progress(done_arrivals, total, started)
                    next_report += 0.1
            elif kind == PREFILL_DONE:
                self._prefill_done(t, a, b)
            elif kind == DECODE_JOIN:
                self._decode_join(t, a, b)
            elif kind == VISIBLE:
                keys, tier = self._unseen[b].pop(a)
                self.index.store(b, keys, tier)
            elif kind == OVERDUE:
                self._overdue(t, a, b)
            elif kind == HOLD_END:
                if self._holding.pop(a, None) is not None:  # no room came in time
                    self._reject(self.reqs[a].decision)
            elif kind == REPLICATE:
                self._replicate(t)
                if t < last_arrival:
                    self._push(t + self.conductor.config.replication.interval_s, REPLICATE, 0)
            elif kind == REPLICA_DONE:
                action = self._replicas.pop(a)
                self._publish(t, action.target, action.keys, DRAM)
        if progress:
            sys.stderr.write("\n")
        return self._results(time.perf_counter() - started)

    def _progress(self, done: int, total: int, started: float) -> None:
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(
            f"\r  {self.cfg.conductor.policy:<20} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total} requests, {time.perf_counter() - started:5.1f} s"
        )
        sys.stderr.flush()

    # -- hot-prefix replication ---------------------------------------------------------------
    def _replicate(self, now: float) -> None:
        bt = self.cfg.block_tokens
        for action in self.conductor.plan_replication(self.cluster, now):
            tokens = len(action.keys) * bt
            self._replica_seq += 1
            self._replicas[self._replica_seq] = action
            self.replicated_tokens += tokens
            done = self._transfer(action.source, action.target, tokens, now)
            self._push(done, REPLICA_DONE, self._replica_seq)

    # -- realism ------------------------------------------------------------------------------
    def _transfer(self, source: int, target: int, tokens: int, now: float) -> float:
        """When a KV transfer of ``tokens`` from ``source`` to ``target`` started ``now``
        ends: at once over an idle network, or queued behind the transfers already on
        either end's NIC (the store's least busy link) with ``nic_contention``."""
        dur = self.topology.transfer_time(self.cost, tokens, self._place(source),
                                          self._place(target))
        if not self.cfg.nic_contention:
            return now + dur
        ends: list[tuple[list[float], int]] = []
        for node in (source, target):
            if node == self.cluster.store_id:
                link = min(range(len(self._store_free)), key=self._store_free.__getitem__)
                ends.append((self._store_free, link))
            elif 0 <= node < len(self._nic_free):
                ends.append((self._nic_free, node))
        start = max([now, *(q[i] for q, i in ends)])
        for q, i in ends:
            q[i] = start + dur
        return start + dur

    def _place(self, iid: int) -> int:
        """The place of prefill instance ``iid`` (the store pool's is unknown: 0)."""
        pool = self.cluster.prefill
        return pool[iid].place if 0 <= iid < len(pool) else 0

    def _publish(self, now: float, iid: int, keys: Sequence[int], tier: int) -> None:
        """Blocks ``iid`` now holds: in the index at once, or after the event lag (the
        instance reuses them meanwhile, see :meth:`_held`)."""
        if self._lag <= 0:
            self.index.store(iid, keys, tier)
            return
        self._unseen_seq += 1
        self._unseen.setdefault(iid, {})[self._unseen_seq] = (keys, tier)
        self._push(now + self._lag, VISIBLE, self._unseen_seq, iid)

    def _held(self, iid: int, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` instance ``iid`` really holds: what the index knows,
        or a prefix it stored that the index has not seen yet."""
        best = self.index.match(iid, keys)
        for stored, _ in self._unseen.get(iid, {}).values():
            k = 0
            for a, b in zip(stored, keys, strict=False):
                if a != b:
                    break
                k += 1
            best = max(best, k)
        return best

    # -- prefill ------------------------------------------------------------------------------
    def _arrive(self, now: float, rid: int, held: bool = False) -> bool:
        """Schedule ``rid`` now (on arrival, or again while ``held``); whether it was
        placed. A request refused only for decode room is held (policies that hold) and
        stays held on a failed retry; the hold's end rejects it."""
        req = self.reqs[rid]
        views = self.replicas
        if views.active:
            replica = views.replica_of(req.info)
            with views.view(replica, self.cluster, now, self._where, self._running):
                decision = self.conductor.schedule(req.info, self.cluster, now)
        else:
            decision = self.conductor.schedule(req.info, self.cluster, now)
        req.decision = decision
        if decision.rejected:
            until = self.conductor.hold_until(req.info, decision, now)
            if until is not None:  # held, or still held
                if not held:
                    self._holding[rid] = until
                    self.held += 1
                    self._push(until, HOLD_END, rid)
                return False
        if held:
            del self._holding[rid]  # placed now, or rejected outright
        if decision.rejected:
            self._reject(decision)
            return False
        pl = decision.placement
        assert pl.prefill is not None
        req.placed_at = now
        if views.active:
            views.placed(replica, rid, now)
        prio = pl.priority if pl.priority is not None else req.info.arrival
        blocks = len(req.info.keys)
        members = pl.cpp_group or [pl.prefill]
        if pl.cpp_group:
            self._gangs[rid] = {}
        self.index.add_pending(pl.prefill, req.info.keys)
        self._book_fetch(req.info, pl, now)
        for iid in members:
            inst = self.cluster.prefill[iid]
            inst.enqueue(rid, prio, pl.prefill_s + pl.transfer_s, blocks, req.info.input_tokens)
            if self._running_rid[iid] < 0:
                self._start_next(inst, now)
        return True

    def _where(self, rid: int) -> list[int]:
        """The prefill instances request ``rid``'s work is on (none once prefilled)."""
        req = self.reqs[rid]
        if not math.isnan(req.ttft) or req.decision is None or req.decision.rejected:
            return []
        pl = req.decision.placement
        return list(pl.cpp_group) if pl.cpp_group else [] if pl.prefill is None else [pl.prefill]

    def _running(self, iid: int) -> int:
        return self._running_rid[iid]

    def _reject(self, decision: Decision | None) -> None:
        assert decision is not None and decision.reject_reason is not None
        reason = decision.reject_reason
        self.reject_reasons[reason] = self.reject_reasons.get(reason, 0) + 1

    def _release_held(self) -> None:
        """Decode room freed: offer the held requests again, oldest first, until one
        still finds none (one whose retry is rejected outright is dropped, and the next
        is offered)."""
        while self._holding:
            rid = next(iter(self._holding))
            if not self._arrive(self._now, rid, held=True) and rid in self._holding:
                return

    def _start_next(self, inst: PrefillState, now: float) -> None:
        if not inst.queue and not self._steal(inst, now):
            self._running_rid[inst.iid] = -1
            inst.running_blocks = inst.running_tokens = 0
            # the answer came, nothing is queued: idle from now, as the gateway counts it
            # (it drops a prefill's work on its answer), not until the predicted end
            inst.busy_until = min(inst.busy_until, now)
            return
        item = inst.pop(self._committed_gang(inst))
        req = self.reqs[item.rid]
        info = req.info
        assert req.decision is not None
        pl = req.decision.placement
        self._running_rid[inst.iid] = item.rid
        inst.running_blocks = len(info.keys)
        inst.running_tokens = info.input_tokens
        if pl.cpp_group:
            self._gang_member_ready(item.rid, inst, now)
            return
        reuse, start = self._reuse_at_start(req, inst.iid, now)
        cached = info.tokens_of(reuse)
        predicted = self.conductor.cost.prefill_time(info.input_tokens, cached)
        dur = (chunked_prefill_time(self.cost, info.input_tokens, cached,
                                    self.cfg.engine_chunk_tokens)
               * float(self._factor[item.rid]) + self.cfg.prefill_overhead_s)
        req.reused_tokens = cached
        req.exec_s = dur
        req.predicted_s = predicted
        self.prefill_gpu_s += dur
        self.predicted_prefill_s += predicted
        inst.busy_until = start + predicted  # what the gateway can know
        self._push(start + dur, PREFILL_DONE, inst.iid, item.rid)
        self._watch(inst.iid, item.rid, start, predicted)

    def _steal(self, inst: PrefillState, now: float) -> bool:
        """``inst`` went idle: move the prompt the Conductor picks from another queue to
        it (its decode choice stays); whether one moved."""
        steal = self.conductor.steal(inst, self.cluster, self._info_of, now, self._movable)
        if steal is None:
            return False
        req = self.reqs[steal.rid]
        assert req.decision is not None
        self.conductor.take(steal, req.info, req.decision.placement, self.cluster)
        # a fetch the old placement started keeps its NIC time (it is not taken back)
        self._fetch_end.pop(steal.rid, None)
        pl = steal.placement
        req.decision = Decision(pl, req.decision.decode)
        req.placed_at = now
        self._book_fetch(req.info, pl, now)
        self.steals += 1
        return True

    def _book_fetch(self, info: RequestInfo, pl: Placement, now: float) -> None:
        """With NIC contention, put the placement's prefix fetch (if any) on the NICs from
        ``now``; its end is when the prefill can start."""
        if self.cfg.nic_contention and pl.fetch_blocks and pl.source is not None:
            assert pl.prefill is not None
            fetched = (info.tokens_of(pl.local_blocks + pl.fetch_blocks)
                       - info.tokens_of(pl.local_blocks))
            self._fetch_end[info.rid] = self._transfer(pl.source, pl.prefill, fetched, now)

    def _info_of(self, rid: int) -> RequestInfo:
        return self.reqs[rid].info

    def _movable(self, rid: int) -> bool:
        decision = self.reqs[rid].decision
        return decision is not None and not decision.placement.cpp_group

    def _reuse_at_start(self, req: _Req, iid: int, now: float) -> tuple[int, float]:
        """Blocks the prefill on ``iid`` reuses when it starts, and when it can start: its
        own cache now, or the decision's fetched prefix if the holder still had it (the
        fetch ran from placement on, so the start waits for it to finish)."""
        info = req.info
        assert req.decision is not None
        pl = req.decision.placement
        reuse = self._held(iid, info.keys)
        start = now
        if pl.fetch_blocks and pl.source is not None:
            target = pl.local_blocks + pl.fetch_blocks
            if target > reuse and self._held(pl.source, info.keys) >= target:
                fetched = info.tokens_of(target) - info.tokens_of(reuse)
                done = self._fetch_end.pop(info.rid, None)
                if done is None:
                    done = req.placed_at + self.topology.transfer_time(
                        self.cost, fetched, self._place(pl.source), self._place(iid))
                start = max(now, done)
                reuse = target
                if pl.migrate:
                    self.index.demote(pl.source, info.keys[:target])
                else:
                    self.index.touch(pl.source, info.keys[:target])
        return reuse, start

    def _committed_gang(self, inst: PrefillState) -> int | None:
        """A CPP request another group member already waits for goes first, the earliest
        committed first; with that order no two groups can wait on each other."""
        best: tuple[int, int] | None = None
        for q in inst.queue:
            order = self._gang_order.get(q.rid)
            if order is not None and (best is None or order < best[0]):
                best = (order, q.rid)
        return None if best is None else best[1]

    def _gang_member_ready(self, rid: int, inst: PrefillState, now: float) -> None:
        """A CPP group member reached the request; once every member has, the pipeline
        runs from the earliest start its members' free times allow
        (:func:`~mooncake_conductor.cpp.staggered_start`)."""
        req = self.reqs[rid]
        assert req.decision is not None
        pl = req.decision.placement
        ready = self._gangs[rid]
        ready[inst.iid] = now
        if rid not in self._gang_order:
            self._gang_counter += 1
            self._gang_order[rid] = self._gang_counter
        inst.busy_until = now + pl.prefill_s
        if len(ready) < len(pl.cpp_group):
            return
        del self._gangs[rid]
        del self._gang_order[rid]
        info = req.info
        leader = pl.cpp_group[0]
        reuse, fetched = self._reuse_at_start(req, leader, min(ready.values()))
        cached = info.tokens_of(reuse)
        # the hand-offs run over the slowest link between members; the Conductor sees it
        # only when its decisions use the topology
        topo = self.topology
        level = topo.group_level(self._place(i) for i in pl.cpp_group)
        link = topo.link(self.cost, level) if level >= 0 else None
        plan = plan_cpp(self.cost, info.input_tokens, cached, len(pl.cpp_group),
                        pl.cpp_chunk_tokens, link)
        seen = plan_cpp(self.conductor.cost, info.input_tokens, cached, len(pl.cpp_group),
                        pl.cpp_chunk_tokens, link if topo.active else None)
        req.reused_tokens = cached
        factor = float(self._factor[rid])
        # the pipeline starts once the fetch is done and each member is free by the time
        # its stage first works (members take stages in the order they came free): the
        # last one may come up to its stage's offset late, so the start can lie before now
        now = max(fetched, staggered_start(list(ready.values()), plan.stage_s[0] * factor))
        req.exec_s = plan.makespan_s * factor + self.cfg.prefill_overhead_s
        req.predicted_s = seen.makespan_s
        self.prefill_gpu_s += plan.gpu_seconds * factor
        self.predicted_prefill_s += seen.gpu_seconds
        end = now + req.exec_s
        for iid in pl.cpp_group:
            self.cluster.prefill[iid].busy_until = now + seen.makespan_s
            self._push(end, PREFILL_DONE, iid, rid)
            self._watch(iid, rid, now, seen.makespan_s)

    def _watch(self, iid: int, rid: int, start: float, predicted: float) -> None:
        """With overrun re-estimation on, look at ``iid`` again at the predicted end of
        the prefill of ``rid`` that starts there at ``start``."""
        if self.conductor.overrun is not None and predicted > 0.0:
            self._started[iid] = (start, predicted)
            self._push(max(start + predicted, self._now), OVERDUE, iid, rid)

    def _overdue(self, now: float, iid: int, rid: int) -> None:
        """The predicted end of ``rid``'s prefill on ``iid`` passed: if it still runs, the
        gateway knows it (no completion came) and the Conductor re-estimates its end."""
        if self._running_rid[iid] != rid:
            return
        start, predicted = self._started[iid]
        until = self.conductor.overdue_until(now, start, predicted)
        assert until is not None and until > now
        self.cluster.prefill[iid].busy_until = until
        self._push(until, OVERDUE, iid, rid)

    def _prefill_done(self, now: float, iid: int, rid: int) -> None:
        req = self.reqs[rid]
        info = req.info
        inst = self.cluster.prefill[iid]
        assert req.decision is not None
        if iid != req.decision.placement.prefill:  # a CPP member that is not the leader
            self._start_next(inst, now)
            return
        self._fetch_end.pop(rid, None)
        self.index.remove_pending(iid, info.keys)
        self._publish(now, iid, info.keys, DRAM)
        if self.cluster.store_id is not None:
            self._publish(now, self.cluster.store_id, info.keys, STORE)
        observed = req.exec_s  # what the gateway measures
        inst.observe_prefill(observed)
        self._pairs.append((req.predicted_s, observed))
        self.conductor.observe_prefill(req.predicted_s, observed)
        req.ttft = now - info.arrival
        req.t_first = now
        self.conductor.prefilled(info, req.decision)
        self._start_next(inst, now)
        assert req.decision is not None
        did = req.decision.decode.decode
        if req.output_len <= 1 or did is None:
            req.tbt = 0.0
            req.client_ttft = req.ttft  # the prefill's token is the only one
            self.conductor.finished(info, req.decision)
            return
        target = self.decoders[did].state.place
        if self._pull_kv:  # the whole KV moves once the prefill ends
            join = now + self.topology.transfer_time(self.cost, info.input_tokens,
                                                     inst.place, target)
        else:
            # the KV streams layer by layer beside the prefill: the decode instance waits
            # for the last layer's share (and, across a slow link, for the link)
            join = self.topology.stream_join(self.cost, info.input_tokens, inst.place,
                                             target, now - req.exec_s, now)
        self._push(join, DECODE_JOIN, did, rid)

    # -- decode -------------------------------------------------------------------------------
    def _decode_join(self, now: float, did: int, rid: int) -> None:
        dec = self.decoders[did]
        st = dec.state
        req = self.reqs[rid]
        need = req.info.input_tokens + req.output_len
        self._advance(dec, now)
        if st.capacity_tokens and dec.reserved + need > st.capacity_tokens and st.batch:
            dec.waiting.append(rid)
            st.waiting += 1
            return
        self._admit(dec, rid, now)
        self._schedule_wake(dec)

    def _admit(self, dec: _Decoder, rid: int, now: float) -> None:
        st = dec.state
        req = self.reqs[rid]
        if st.batch and dec.last < now:
            self._step_once(dec)  # finish the step in progress; join at its end
        if not st.batch:
            dec.last = max(dec.last, now)
        req.s0 = dec.steps
        req.end_step = dec.steps + req.output_len - 1
        req.seg0 = len(dec.seg_dt)
        heapq.heappush(dec.running, (req.end_step, dec.admitted, rid))
        dec.admitted += 1
        st.batch += 1
        st.context_tokens += req.info.input_tokens + 1
        dec.reserved += req.info.input_tokens + req.output_len
        dec.booked += req.info.input_tokens + req.info.output_tokens
        st.reserved_tokens = dec.booked - st.context_tokens
        if self.replicas.active:
            self.replicas.joined(self.replicas.replica_of(req.info), rid, st.iid,
                                 req.info.input_tokens + 1, req.info.output_tokens - 1, now)

    def _step_time(self, st: DecodeState) -> float:
        return self.cost.decode_step_time(st.batch, st.context_tokens) * self._slow

    def _step_once(self, dec: _Decoder) -> None:
        st = dec.state
        dt = self._step_time(st)
        self._apply_steps(dec, 1, dt)

    def _apply_steps(self, dec: _Decoder, k: int, dt: float) -> None:
        st = dec.state
        dec.seg_start.append(dec.last)
        dec.seg_dt.append(dt)
        dec.seg_steps.append(k)
        dec.last += k * dt
        dec.steps += k
        context = st.context_tokens + st.batch * k
        st.context_tokens = context
        st.reserved_tokens = dec.booked - context
        running = dec.running
        if running[0][0] <= dec.steps:
            # in admission order (k never passes the soonest end, so all end at this step)
            finished = []
            while running and running[0][0] <= dec.steps:
                finished.append(heapq.heappop(running)[2])
            for rid in finished:
                self._finish(dec, rid)

    def _finish(self, dec: _Decoder, rid: int) -> None:
        st = dec.state
        r = self.reqs[rid]
        st.batch -= 1
        st.context_tokens -= r.info.input_tokens + 1 + dec.steps - r.s0
        if self.replicas.active:
            self.replicas.finished(self.replicas.replica_of(r.info), rid, st.iid,
                                   r.info.input_tokens + 1 + dec.steps - r.s0, dec.last)
        dec.reserved -= r.info.input_tokens + r.output_len
        dec.booked -= r.info.input_tokens + r.info.output_tokens
        st.reserved_tokens = dec.booked - st.context_tokens
        r.tbt = self._tbt(dec, r)
        r.client_ttft = dec.seg_start[r.seg0] + dec.seg_dt[r.seg0] - r.info.arrival
        assert r.decision is not None
        # the core's one path for a finished stream (the gateway's too; off by default)
        self.conductor.observe_decode(r.decision.decode.predicted_tbt_s, r.tbt,
                                      dec.steps - r.s0)
        self.conductor.finished(r.info, r.decision)
        if self._holding:
            self._release_held()
        while dec.waiting:
            nxt = self.reqs[dec.waiting[0]]
            need = nxt.info.input_tokens + nxt.output_len
            if st.batch and dec.reserved + need > st.capacity_tokens:
                break
            dec.waiting.popleft()
            st.waiting -= 1
            self._admit(dec, nxt.info.rid, dec.last)

    def _tbt(self, dec: _Decoder, r: _Req) -> float:
        s0 = r.seg0
        seg_dt, seg_steps = dec.seg_dt, dec.seg_steps
        intervals: list[tuple[float, int]] = [
            (dec.seg_start[s0] + seg_dt[s0] - r.t_first, 1)
        ]
        if seg_steps[s0] > 1:
            intervals.append((seg_dt[s0], seg_steps[s0] - 1))
        # the later segments as (step time, steps), built in C: a request spans many
        intervals += zip(seg_dt[s0 + 1:], seg_steps[s0 + 1:], strict=True)
        total = seg_steps[s0] + sum(seg_steps[s0 + 1:])  # the first interval's 1 + the rest
        take = max(1, math.ceil(total * self.cfg.tbt_top_share))
        intervals.sort(reverse=True)
        acc = 0.0
        left = take
        for dt, c in intervals:
            use = min(c, left)
            acc += dt * use
            left -= use
            if not left:
                break
        return acc / take

    def _advance(self, dec: _Decoder, until: float) -> float:
        """Run ``dec``'s batch up to ``until`` in chunks; returns the step time of the
        batch as it stands when that was priced last and not changed since (0.0: none)."""
        st = dec.state
        cap = self._chunk
        # :meth:`_step_time` inlined (the same arithmetic): every chunk prices a step
        step_time, slow = self.cost.decode_step_time, self._slow
        running = dec.running
        while st.batch:
            dt = step_time(st.batch, st.context_tokens) * slow
            k_max = min(running[0][0] - dec.steps, cap)
            k = min(k_max, int((until - dec.last) / dt + 1e-9))
            if k <= 0:
                return dt  # the batch as priced
            self._apply_steps(dec, k, dt)
            if k < k_max:
                return 0.0
        st.tokens_per_s = 0.0
        return 0.0

    def _schedule_wake(self, dec: _Decoder, dt: float = 0.0) -> None:
        """The wake at the end of ``dec``'s next chunk; ``dt``: the batch's step time when
        the caller has it (what :meth:`_advance` returns), else priced here."""
        st = dec.state
        dec.version += 1
        if not st.batch:
            return
        if not dt:
            dt = self.cost.decode_step_time(st.batch, st.context_tokens) * self._slow
        st.tokens_per_s = 1.0 / dt
        k = min(dec.running[0][0] - dec.steps, self._chunk)
        self._seq += 1  # :meth:`_push`, inlined (one wake per chunk of steps)
        heapq.heappush(self._events, (dec.last + k * dt, self._seq, DECODE_WAKE, st.iid,
                                      dec.version))

    # -- results ------------------------------------------------------------------------------
    def _error_windows(self) -> list[float]:
        """Systematic prefill-time error of the policy's predictions per window of
        ``ERROR_WINDOW`` prefills in completion order: |sum predicted / sum executed - 1|
        (per-request noise averages out; a biased model does not)."""
        out = []
        for i in range(0, len(self._pairs), ERROR_WINDOW):
            window = self._pairs[i:i + ERROR_WINDOW]
            executed = sum(e for _, e in window)
            if executed > 0:
                out.append(abs(sum(p for p, _ in window) / executed - 1.0))
        return out

    def _results(self, wall: float) -> dict[str, Any]:
        slo = self.cfg.conductor.slo
        served = [r for r in self.reqs if r.decision is not None and not r.decision.rejected]
        prompt = sum(r.info.input_tokens for r in served)
        reused = sum(r.reused_tokens for r in served)
        n = len(self.reqs)
        latency = latency_summary([(r.ttft, r.tbt) for r in served], n, slo.ttft_s, slo.tbt_s)
        execution = sum(r.exec_s for r in served) / len(served) if served else math.nan
        client = [r.client_ttft for r in served if not math.isnan(r.client_ttft)]
        return {
            "policy": self.cfg.conductor.policy,
            "requests": n,
            "completed": len(served),
            "rejected": n - len(served),
            "reject_reasons": dict(sorted(self.reject_reasons.items())),
            **latency,
            # served requests whose stream ended: TTFT to the decode engine's first token
            # (a P/D client's; ``ttft_mean_s`` ends with the prefill)
            "client_ttft_mean_s": sum(client) / len(client) if client else math.nan,
            "token_hit_ratio": reused / prompt if prompt else 0.0,
            # where the served mean TTFT went: the prefill's own execution (a CPP group's
            # makespan), which placement shortens only through reuse and CPP, and the rest
            # (queueing, fetches, decode holds), the part scheduling controls
            "prefill_exec_mean_s": execution,
            "ttft_wait_mean_s": latency["ttft_mean_s"] - execution,
            "prefill_gpu_seconds": self.prefill_gpu_s,
            "prefill_prediction_error": (self.prefill_gpu_s / self.predicted_prefill_s - 1.0
                                         if self.predicted_prefill_s else 0.0),
            "prediction_error_windows": self._error_windows(),
            "prefill_scale": self.conductor.cost.prefill_scale,
            "replicated_tokens": self.replicated_tokens,
            "steals": self.steals,
            "held": self.held,
            # trace indices of the requests not served (what the rejected work and the
            # served requests' reuse ceiling are computed from)
            "rejected_ids": [r.info.rid for r in self.reqs
                             if r.decision is None or r.decision.rejected],
            "long_prompts": self._long_prompts(served),
            "simulated_seconds": max((r.info.arrival for r in self.reqs), default=0.0),
            "wall_seconds": wall,
        }

    def _long_prompts(self, served: list[_Req]) -> dict[str, Any]:
        """The same summary for the prompts of at least ``long_prompt_tokens`` alone
        (where CPP matters): rejected ones count as misses and are charged the SLO."""
        slo, at_least = self.cfg.conductor.slo, self.cfg.long_prompt_tokens
        requests = sum(1 for r in self.reqs if r.info.input_tokens >= at_least)
        done = [(r.ttft, r.tbt) for r in served if r.info.input_tokens >= at_least]
        summary = latency_summary(done, requests, slo.ttft_s, slo.tbt_s)
        return {"threshold_tokens": at_least, "requests": requests,
                "completed": len(done), "slo_attainment": summary["slo_attainment"],
                "ttft_mean_charged_s": summary["ttft_mean_charged_s"],
                "ttft_p90_s": summary["ttft_p90_s"]}


def simulate(records: list[TraceRecord], config: SimConfig) -> dict[str, Any]:
    """Run one policy over ``records``; returns one result row."""
    return Simulation(records, config).run()
