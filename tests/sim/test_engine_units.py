"""The simulator's per-request metrics and its store pool on tiny hand-made traces, with
expectations worked out from the cost model by hand (no trace, no tuning)."""

import math
from typing import Any

import pytest
from mooncake_conductor.cpp import plan_cpp
from mooncake_conductor.engine import ConductorConfig
from mooncake_conductor.replication import ReplicationAction
from mooncake_conductor.state import DecodeState, RequestInfo
from mooncake_sim.engine import SimConfig, Simulation, _Decoder, _Req, simulate
from mooncake_sim.trace import TraceRecord

BT = 512


def sim(records: list[TraceRecord], policy: str = "least-load", *, prefill: int = 2,
        decode: int = 1, conductor: ConductorConfig | None = None, **kw: Any) -> Simulation:
    return Simulation(records, SimConfig(prefill=prefill, decode=decode,
                                         conductor=conductor or ConductorConfig(policy=policy),
                                         **kw))


# -- TBT: mean of the longest 10% of a request's token intervals ------------------------------

def _tbt_of(segments: list[tuple[float, float, int]], t_first: float, share: float) -> float:
    """TBT the simulator reports for a request whose first token came at ``t_first`` and
    that then decoded through ``segments`` of ``(start, step seconds, steps)``."""
    s = Simulation([], SimConfig(prefill=1, decode=1, tbt_top_share=share))
    dec = _Decoder(state=DecodeState(iid=0))
    for start, dt, k in segments:
        dec.seg_start.append(start)
        dec.seg_dt.append(dt)
        dec.seg_steps.append(k)
    req = _Req(info=RequestInfo(0, 0.0, 100, 11, [1], BT))
    req.t_first, req.seg0 = t_first, 0
    return s._tbt(dec, req)


# intervals: 0.5 + 0.1 - 0 = 0.6 once (join wait + first step), then 0.1 x3, 0.3 x3, 0.2 x3
SEGMENTS = [(0.5, 0.1, 4), (0.9, 0.3, 3), (1.8, 0.2, 3)]


def test_tbt_is_the_mean_of_the_longest_tenth_of_intervals() -> None:
    # 10 intervals: the top 10% is the single longest one, 0.6
    assert _tbt_of(SEGMENTS, 0.0, 0.1) == pytest.approx(0.6)


def test_tbt_top_share_counts_intervals_not_segments() -> None:
    # top 50% of 10 intervals = 5: 0.6 + 0.3 * 3 + 0.2 * 1
    assert _tbt_of(SEGMENTS, 0.0, 0.5) == pytest.approx((0.6 + 0.9 + 0.2) / 5)
    # top 25%: ceil(2.5) = 3 intervals: 0.6 + 0.3 + 0.3
    assert _tbt_of(SEGMENTS, 0.0, 0.25) == pytest.approx(1.2 / 3)
    # everything: the plain mean, (0.6 + 0.3 + 0.9 + 0.6) / 10
    assert _tbt_of(SEGMENTS, 0.0, 1.0) == pytest.approx(0.24)


def test_tbt_first_interval_runs_from_the_first_token() -> None:
    # first token at 0.45: the first interval is 0.5 + 0.1 - 0.45 = 0.15, so the
    # longest ones are now the 0.3-second steps
    assert _tbt_of(SEGMENTS, 0.45, 0.1) == pytest.approx(0.3)
    assert _tbt_of(SEGMENTS, 0.45, 0.5) == pytest.approx((0.9 + 0.2 + 0.2) / 5)


def test_tbt_starts_at_the_requests_own_segment() -> None:
    s = Simulation([], SimConfig(prefill=1, decode=1))
    dec = _Decoder(state=DecodeState(iid=0))
    # an earlier request's slow segment, then this request's: 1 + 19 intervals of 0.05
    for start, dt, k in [(0.0, 0.9, 5), (4.5, 0.05, 20)]:
        dec.seg_start.append(start)
        dec.seg_dt.append(dt)
        dec.seg_steps.append(k)
    req = _Req(info=RequestInfo(0, 0.0, 100, 21, [1], BT))
    req.t_first, req.seg0 = 4.5, 1
    # 20 intervals, top 2: both 0.05
    assert s._tbt(dec, req) == pytest.approx(0.05)


def test_one_request_end_to_end_ttft_and_tbt() -> None:
    """One 8192-token prompt with 11 output tokens, alone: TTFT is the prefill; the first
    interval waits for the last layer's KV (transfer / layers) plus one step, the other
    9 are one step each at context 8193; TBT is the longest tenth (1 of 10) of them."""
    rec = [TraceRecord(0.0, 8192, 11, tuple(range(16)))]
    s = sim(rec)
    r = s.run()
    cost = s.cost
    join = cost.transfer_time(8192) / cost.config.model.layers
    step = cost.decode_step_time(1, 8193)
    assert r["ttft_mean_s"] == pytest.approx(cost.prefill_time(8192), rel=1e-12)
    assert s.reqs[0].tbt == pytest.approx(join + step, rel=1e-9)
    assert r["tbt_p90_ms"] == pytest.approx(1000 * (join + step), rel=1e-9)
    assert r["tbt_mean_ms"] == pytest.approx(1000 * (join + step), rel=1e-9)
    # the same run averaging every interval instead
    everything = sim(rec, tbt_top_share=1.0).run()
    assert everything["tbt_mean_ms"] == pytest.approx(1000 * (join + 10 * step) / 10, rel=1e-9)


def test_one_output_token_has_no_tbt() -> None:
    r = sim([TraceRecord(0.0, 4096, 1, tuple(range(8)))]).run()
    assert r["tbt_mean_ms"] == 0.0 and r["completed"] == 1


# -- decode batching and KV capacity ----------------------------------------------------------

def _pair(capacity: int | None) -> Simulation:
    """Two 4096-token prompts with 3 output tokens each at 0 s, prefilled side by side
    (round robin over 2 instances), decoded on one instance of ``capacity`` tokens."""
    recs = [TraceRecord(0.0, 4096, 3, tuple(range(8))),
            TraceRecord(0.0, 4096, 3, tuple(range(100, 108)))]
    s = sim(recs, "round-robin", decode_capacity_tokens=capacity)
    s.run()
    return s


def test_two_requests_that_fit_decode_in_one_batch() -> None:
    s = _pair(2 * (4096 + 3))  # exactly room for both
    cost = s.cost
    join = cost.transfer_time(4096) / cost.config.model.layers
    step2 = cost.decode_step_time(2, 2 * 4097)  # both join at once: 2 steps at batch 2
    for r in s.reqs:
        assert r.ttft == pytest.approx(cost.prefill_time(4096), rel=1e-12)
        assert r.tbt == pytest.approx(join + step2, rel=1e-9)


def test_a_request_without_kv_room_waits_for_the_batch_to_finish() -> None:
    s = _pair(2 * (4096 + 3) - 1)  # one token short: the second waits
    cost = s.cost
    join = cost.transfer_time(4096) / cost.config.model.layers
    step1 = cost.decode_step_time(1, 4097)
    first, second = sorted(s.reqs, key=lambda r: r.tbt)
    assert first.tbt == pytest.approx(join + step1, rel=1e-9)
    # joins when the first finishes (2 steps after the common join), then 1 step
    assert second.tbt == pytest.approx(join + 3 * step1, rel=1e-9)
    d = s.cluster.decode[0]
    assert (d.batch, d.context_tokens, d.reserved_tokens, d.waiting) == (0, 0, 0, 0)


def test_a_waiting_request_joins_when_a_finish_leaves_exactly_enough_room() -> None:
    """A (10 output tokens) and B (3) fill the decode instance exactly; C (3) waits.
    When B finishes, A's reservation plus C's is exactly the capacity: C joins then,
    next to A, instead of waiting for A too."""
    recs = [TraceRecord(0.0, 4096, 10, tuple(range(8))),
            TraceRecord(0.0, 4096, 3, tuple(range(100, 108))),
            TraceRecord(0.0, 4096, 3, tuple(range(200, 208)))]
    s = sim(recs, "round-robin", prefill=3, decode_capacity_tokens=(4096 + 10) + (4096 + 3))
    waited: list[int] = []
    join = s._decode_join

    def spy(now: float, did: int, rid: int) -> None:
        join(now, did, rid)
        waited.append(s.cluster.decode[did].waiting)

    s._decode_join = spy  # type: ignore[method-assign]
    s.run()
    assert waited == [0, 0, 1]
    cost = s.cost
    kv_wait = cost.transfer_time(4096) / cost.config.model.layers
    step_ab = cost.decode_step_time(2, 2 * 4097)
    step_ac = cost.decode_step_time(2, (4097 + 2) + 4097)  # A has 2 more tokens by then
    _, b, c = s.reqs
    assert b.tbt == pytest.approx(kv_wait + step_ab, rel=1e-9)
    assert c.tbt == pytest.approx(kv_wait + 2 * step_ab + step_ac, rel=1e-9)
    d = s.cluster.decode[0]
    assert (d.batch, d.context_tokens, d.reserved_tokens, d.waiting) == (0, 0, 0, 0)


def test_a_decoding_instance_reports_its_per_sequence_token_rate() -> None:
    """AIBrix's decode rule reads ``tokens_per_s``: 1 / step time while a batch runs,
    0 once it is empty."""
    recs = [TraceRecord(0.0, 4096, 200, tuple(range(8))),
            TraceRecord(2000.0, 1024, 2, tuple(range(100, 102)))]
    s = sim(recs, "round-robin")
    seen: list[tuple[int, float]] = []
    arrive = s._arrive

    def spy(now: float, rid: int) -> None:
        d = s.cluster.decode[0]
        seen.append((d.batch, d.tokens_per_s))
        arrive(now, rid)

    s._arrive = spy  # type: ignore[method-assign]
    s.run()
    # at 2 s the first request is decoding alone; its last chunk was priced at a context
    # between 4097 and 4097 + 199
    batch, rate = seen[1]
    assert batch == 1
    fastest = 1.0 / s.cost.decode_step_time(1, 4097)
    slowest = 1.0 / s.cost.decode_step_time(1, 4097 + 199)
    assert slowest <= rate <= fastest
    assert s.cluster.decode[0].tokens_per_s == 0.0


def test_a_request_joining_mid_step_starts_at_the_next_step_boundary() -> None:
    """A (20 output tokens) decodes alone; B's KV arrives half way through A's third
    step: the step finishes, B joins at its end and the two decode at the batch-2 step."""
    probe = sim([])
    cost = probe.cost
    layers = cost.config.model.layers
    j_a = cost.prefill_time(4096) + cost.transfer_time(4096) / layers
    step1 = cost.decode_step_time(1, 4097)
    pre_b = cost.prefill_time(2048) + cost.transfer_time(2048) / layers
    t_b = j_a + 2.5 * step1 - pre_b  # B's join falls inside A's third step
    recs = [TraceRecord(0.0, 4096, 20, tuple(range(8))),
            TraceRecord(t_b * 1000.0, 2048, 5, tuple(range(100, 104)))]
    s = sim(recs, "round-robin")
    s.run()
    a, b = s.reqs
    # A's first two steps run as one chunk priced at context 4097, the third (cut short
    # by B's arrival) at 4099; then B joins with 2049 next to A's 4100
    step1b = cost.decode_step_time(1, 4099)
    step2 = cost.decode_step_time(2, 4100 + 2049)
    assert b.ttft == pytest.approx(cost.prefill_time(2048), rel=1e-9)
    b_first = b.info.arrival + b.ttft
    # B: the wait to the boundary plus one batch-2 step, then 3 more batch-2 steps
    assert b.tbt == pytest.approx(j_a + 2 * step1 + step1b + step2 - b_first, rel=1e-9)
    # A: 19 intervals, the longest 2: its first (KV wait + one step) and a batch-2 step
    assert a.tbt == pytest.approx((j_a - a.ttft + step1 + step2) / 2, rel=1e-9)


def test_everything_is_released_at_the_end() -> None:
    # outputs long enough that batches of several requests form, and some wait for room
    recs = [TraceRecord(float(i * 50), 3000 + 100 * i, 20 + 7 * i, tuple(range(i, i + 6)))
            for i in range(12)]
    s = sim(recs, "round-robin", prefill=3, decode=2, decode_capacity_tokens=9000)
    r = s.run()
    assert r["completed"] == 12
    assert all(math.isfinite(q.ttft) and math.isfinite(q.tbt) for q in s.reqs)
    for d in s.cluster.decode:
        assert (d.batch, d.context_tokens, d.reserved_tokens, d.waiting) == (0, 0, 0, 0)
    for dec in s.decoders:
        assert not dec.running and not dec.waiting
    for p in s.cluster.prefill:
        assert not p.queue and p.queued_work_s == 0.0 and p.queued_blocks == 0
        assert p.queued_tokens == 0 and p.running_tokens == 0 and p.running_blocks == 0
    assert s._running_rid == [-1, -1, -1]
    assert not s.index.has_pending
    assert sum(p.completed for p in s.cluster.prefill) == 12


def test_speed_divides_the_timestamps() -> None:
    recs = [TraceRecord(0.0, 1024, 2, (1,)), TraceRecord(4000.0, 1024, 2, (2,))]
    s = sim(recs, "round-robin", speed=2.0)
    r = s.run()
    assert [q.info.arrival for q in s.reqs] == [0.0, 2.0]
    assert r["simulated_seconds"] == 2.0


def test_prefill_gpu_seconds_and_observed_average() -> None:
    recs = [TraceRecord(0.0, 2048, 2, tuple(range(4))),
            TraceRecord(1000.0, 6144, 2, tuple(range(100, 112)))]
    s = sim(recs, "round-robin", prefill=1)
    r = s.run()
    cost = s.cost
    t1, t2 = cost.prefill_time(2048), cost.prefill_time(6144)
    assert r["prefill_gpu_seconds"] == pytest.approx(t1 + t2, rel=1e-12)
    p = s.cluster.prefill[0]
    assert p.completed == 2
    assert p.avg_prefill_s == pytest.approx((t1 + t2) / 2, rel=1e-12)


def test_observed_prefill_average_counts_reuse() -> None:
    # the second turn reuses the first's 4 blocks on the one instance
    recs = [TraceRecord(0.0, 2048, 2, tuple(range(4))),
            TraceRecord(1000.0, 6144, 2, tuple(range(12)))]
    s = sim(recs, "round-robin", prefill=1)
    s.run()
    cost = s.cost
    t1, t2 = cost.prefill_time(2048), cost.prefill_time(6144, 2048)
    assert s.reqs[1].reused_tokens == 2048
    assert s.cluster.prefill[0].avg_prefill_s == pytest.approx((t1 + t2) / 2, rel=1e-12)
    assert s.prefill_gpu_s == pytest.approx(t1 + t2, rel=1e-12)


# -- chunked pipeline prefill (CPP) gangs -----------------------------------------------------

def test_a_cpp_group_prefills_in_the_plans_makespan() -> None:
    """A 100k-token prompt on an idle pool of 4 (one instance alone would break the 30 s
    TTFT SLO): the conductor serves it with a pipeline group of all 4; TTFT is the
    group's makespan, and every member is held for it, so a short request arriving
    next waits for the whole group."""
    recs = [TraceRecord(0.0, 100_000, 2, tuple(range(196))),
            TraceRecord(1.0, 1024, 2, (5000, 5001))]
    conductor = ConductorConfig(policy="conductor", decode_selector="least-load",
                                admission=False, replicate=False)
    s = sim(recs, prefill=4, conductor=conductor)
    r = s.run()
    big, small = s.reqs
    assert big.decision is not None
    pl = big.decision.placement
    group = pl.cpp_group
    assert sorted(group) == [0, 1, 2, 3] and pl.prefill == group[0]
    plan = plan_cpp(s.cost, 100_000, 0, len(group), pl.cpp_chunk_tokens)
    assert big.ttft == pytest.approx(plan.makespan_s, rel=1e-12)
    assert r["prefill_gpu_seconds"] == pytest.approx(
        plan.gpu_seconds + s.cost.prefill_time(1024), rel=1e-12)
    # only the leader keeps the prompt's blocks
    for iid in range(4):
        assert s.index.match(iid, big.info.keys) == (196 if iid == group[0] else 0)
    assert sum(p.completed for p in s.cluster.prefill) == 2
    assert small.info.arrival + small.ttft == pytest.approx(
        plan.makespan_s + s.cost.prefill_time(1024), rel=1e-9)



def test_a_cpp_group_reuses_the_leaders_cached_prefix() -> None:
    """The group's leader is the member holding the longest prefix: a 120k prompt whose
    first 16384 tokens an earlier prompt left on one instance reuses them."""
    recs = [TraceRecord(0.0, 16_384, 2, tuple(range(32))),
            TraceRecord(60_000.0, 120_000, 2, tuple(range(235)))]
    conductor = ConductorConfig(policy="conductor", decode_selector="least-load",
                                admission=False, replicate=False)
    s = sim(recs, prefill=4, conductor=conductor)
    s.run()
    first, big = s.reqs
    assert first.decision is not None and big.decision is not None
    pl = big.decision.placement
    assert len(pl.cpp_group) == 4 and pl.prefill == first.decision.placement.prefill
    assert big.reused_tokens == 16_384
    plan = plan_cpp(s.cost, 120_000, 16_384, 4, pl.cpp_chunk_tokens)
    assert big.ttft == pytest.approx(plan.makespan_s, rel=1e-12)


def test_a_member_serves_the_earliest_committed_group_first() -> None:
    """Of the queued requests whose group other members already wait for, the one
    committed first goes first (so no two groups wait on each other); none: None."""
    s = Simulation([], SimConfig(prefill=1, decode=1))
    inst = s.cluster.prefill[0]
    for rid, prio in ((5, 1.0), (6, 2.0), (7, 3.0), (8, 0.5)):
        inst.enqueue(rid, prio, 1.0, 1, BT)
    assert s._committed_gang(inst) is None
    s._gang_order.update({6: 4, 7: 2, 9: 1})  # 9 waits elsewhere, not queued here
    assert s._committed_gang(inst) == 7
    s._gang_order[8] = 0
    assert s._committed_gang(inst) == 8


def test_overlapping_groups_on_busy_instances_all_complete() -> None:
    """Groups that may include busy instances (``rescue_idle_only`` off) overlap and
    wait for their members; every request still completes (no two groups deadlock)."""
    def blocks(i: int, n: int) -> tuple[int, ...]:
        return tuple(range(i * 1000, i * 1000 + math.ceil(n / BT)))

    arrivals = [(100, 1000), (200, 1000), (200, 1000), (300, 20_000), (400, 110_000),
                (500, 20_000), (600, 110_000), (600, 110_000), (600, 1000), (700, 110_000),
                (700, 60_000), (800, 20_000)]
    recs = [TraceRecord(float(t), n, 2, blocks(i, n)) for i, (t, n) in enumerate(arrivals)]
    conductor = ConductorConfig(
        policy="conductor", admission=False, decode_selector="least-load", replicate=False,
        params={"priority_weight": 1.0, "cpp": {"rescue_idle_only": False,
                                                "reserve_idle_share": 0.0,
                                                "trigger_share": 0.3}})
    s = sim(recs, prefill=4, decode=2, conductor=conductor)
    r = s.run()
    assert sum(1 for q in s.reqs if q.decision and q.decision.placement.cpp_group) >= 4
    assert r["completed"] == 12
    assert all(math.isfinite(q.ttft) for q in s.reqs)
    assert not s._gangs and not s._gang_order



# -- replication rounds -----------------------------------------------------------------------

def test_replication_rounds_copy_the_planned_blocks() -> None:
    """Rounds every ``interval_s`` from the first arrival until one at or past the last;
    each planned copy lands on its target after its transfer time."""
    recs = [TraceRecord(0.0, 4096, 2, tuple(range(8))),
            TraceRecord(10_000.0, 1024, 2, (900, 901))]
    s = sim(recs, "conductor", prefill=2)
    assert s.conductor.capabilities.replication
    rounds: list[float] = []
    copies: list[int] = []  # instances holding A's blocks at each round
    keys = tuple(s.reqs[0].info.keys)

    def plan(cluster: object, now: float) -> list[ReplicationAction]:
        rounds.append(now)
        copies.append(sum(s.index.match(i, keys) == 8 for i in (0, 1)))
        if len(rounds) == 2:  # at 5 s: A's 8 blocks from where they are to the other
            src = 0 if s.index.match(0, keys) == 8 else 1
            return [ReplicationAction(keys[-1], keys, src, 1 - src, 1.0)]
        return []

    s.conductor.plan_replication = plan  # type: ignore[method-assign]
    r = s.run()
    assert rounds == [0.0, 5.0, 10.0]
    assert copies == [0, 1, 2]  # the copy (a few ms of transfer) landed before 10 s
    assert r["replicated_tokens"] == 8 * BT
    assert s.index.match(0, keys) == 8 and s.index.match(1, keys) == 8


def _decode_views(s: Simulation) -> list[tuple[int, int, int]]:
    """What decode instance 0 shows the scheduler (batch, context, reserved tokens) at
    each arrival of the run to come."""
    seen: list[tuple[int, int, int]] = []
    arrive = s._arrive

    def spy(now: float, rid: int) -> None:
        d = s.cluster.decode[0]
        seen.append((d.batch, d.context_tokens, d.reserved_tokens))
        arrive(now, rid)

    s._arrive = spy  # type: ignore[method-assign]
    return seen


def test_the_schedulers_view_of_decode_kv_is_what_the_requests_hold_and_reserve() -> None:
    """``context_tokens + reserved_tokens`` is the KV a decode instance's requests hold
    or will hold (prompt plus output each), as the gateway reports it (context: prompts,
    reserved: outputs): the tbt-slo room check and ``kv_usage`` read that sum."""
    recs = [TraceRecord(0.0, 4096, 50, tuple(range(8))),
            TraceRecord(1000.0, 2048, 30, tuple(range(100, 104)))]
    s = sim(recs, "round-robin")
    seen = _decode_views(s)
    s.run()
    batch, context, reserved = seen[1]  # at 1 s the first request is decoding
    assert batch == 1
    assert 4097 < context < 4096 + 50  # its prompt plus the tokens decoded so far
    assert context + reserved == 4096 + 50


def test_conductor_sees_room_for_requests_that_fit_the_decode_instance() -> None:
    """A decode instance with room for exactly both requests: the second arrives while
    the first decodes and fits, so the conductor's tbt-slo rule finds room for it
    instead of rejecting it."""
    recs = [TraceRecord(0.0, 4096, 50, tuple(range(8))),
            TraceRecord(1000.0, 2048, 30, tuple(range(100, 104)))]
    s = sim(recs, "conductor", decode_capacity_tokens=(4096 + 50) + (2048 + 30))
    r = s.run()
    assert r["rejected"] == 0 and r["completed"] == 2


def test_the_conductor_books_max_tokens_not_the_streams_true_length() -> None:
    """With ``max_tokens`` the Conductor knows only what a gateway knows: the decode
    instance shows ``prompt + max_tokens`` booked for a stream while the stream decodes
    its trace length."""
    recs = [TraceRecord(0.0, 4096, 50, tuple(range(8))),
            TraceRecord(1000.0, 2048, 30, tuple(range(100, 104)))]
    s = sim(recs, "round-robin", max_tokens=200)
    seen = _decode_views(s)
    s.run()
    batch, context, reserved = seen[1]
    assert batch == 1 and 4097 < context < 4096 + 50
    assert context + reserved == 4096 + 200  # booked, not the 50 it will decode
    first = s.reqs[0]
    assert (first.info.output_tokens, first.output_len) == (200, 50)
    assert first.end_step - first.s0 == 49  # 50 tokens: the first from the prefill
    d = s.cluster.decode[0]
    assert (d.batch, d.context_tokens, d.reserved_tokens) == (0, 0, 0)


def test_a_stream_stops_at_max_tokens() -> None:
    s = sim([TraceRecord(0.0, 4096, 50, tuple(range(8)))], max_tokens=10)
    s.run()
    r = s.reqs[0]
    assert (r.info.output_tokens, r.output_len, r.end_step - r.s0) == (10, 10, 9)


@pytest.mark.parametrize(("max_tokens", "rejected"), [(None, 0), (1000, 1)])
def test_booking_max_tokens_can_leave_no_room(max_tokens: int | None, rejected: int) -> None:
    """Room for both streams' true lengths, not for the max_tokens they ask: the paper's
    rule (no holding) refuses the second for decode room."""
    recs = [TraceRecord(0.0, 4096, 50, tuple(range(8))),
            TraceRecord(1000.0, 2048, 30, tuple(range(100, 104)))]
    s = sim(recs, "kvcache-centric", decode_capacity_tokens=(4096 + 50) + (2048 + 30),
            max_tokens=max_tokens)
    r = s.run()
    assert r["rejected"] == rejected and r["completed"] == 2 - rejected
    assert s.reject_reasons == ({"tbt-slo": 1} if rejected else {})


# -- SLO attainment in the result row ---------------------------------------------------------

def test_sim_slo_attainment_counts_rejected_requests_as_misses() -> None:
    """A short prompt meets a 1 s TTFT SLO; a 60k-token one is predicted past it and
    rejected (admission, no CPP rescue): 1 of 2 requests meets the SLO."""
    recs = [TraceRecord(0.0, 2048, 2, tuple(range(4))),
            TraceRecord(0.0, 60_000, 2, tuple(range(100, 218)))]
    conductor = ConductorConfig(policy="conductor", slo={"ttft_s": 1.0, "tbt_s": 0.1},
                                params={"cpp": {"enabled": False}})
    r = sim(recs, conductor=conductor).run()
    assert (r["completed"], r["rejected"]) == (1, 1)
    assert r["reject_reasons"] == {"ttft-slo": 1}
    assert r["slo_attainment"] == pytest.approx(0.5)


def test_sim_slo_attainment_needs_tbt_too() -> None:
    """Served within the TTFT SLO, but the one decode step takes longer than a 5 ms TBT
    SLO (least-load has no admission, so it is served): a miss."""
    recs = [TraceRecord(0.0, 2048, 3, tuple(range(4)))]
    conductor = ConductorConfig(policy="least-load", slo={"ttft_s": 30.0, "tbt_s": 0.005})
    s = sim(recs, conductor=conductor)
    r = s.run()
    assert r["completed"] == 1
    assert s.reqs[0].ttft < 30.0 and s.reqs[0].tbt > 0.005
    assert r["slo_attainment"] == 0.0
    # the same request under a loose TBT SLO meets it
    loose = ConductorConfig(policy="least-load", slo={"ttft_s": 30.0, "tbt_s": 1.0})
    assert sim(recs, conductor=loose).run()["slo_attainment"] == 1.0


def test_sim_slo_attainment_needs_ttft_too() -> None:
    recs = [TraceRecord(0.0, 16_384, 3, tuple(range(32)))]
    s = sim(recs, conductor=ConductorConfig(policy="least-load",
                                            slo={"ttft_s": 0.5, "tbt_s": 1.0}))
    r = s.run()
    assert s.reqs[0].ttft > 0.5 and s.reqs[0].tbt < 1.0
    assert r["slo_attainment"] == 0.0


def test_long_prompts_are_summarised_on_their_own() -> None:
    """Three prompts, two of them at least 8192 tokens: one of those is rejected (predicted
    past a 1 s TTFT SLO), the other served within it. The long-prompt summary counts the
    two long ones only, the rejected one a miss charged the SLO."""
    recs = [TraceRecord(0.0, 2048, 2, tuple(range(4))),
            TraceRecord(0.0, 8192, 2, tuple(range(100, 116))),
            TraceRecord(0.0, 60_000, 2, tuple(range(200, 318)))]
    conductor = ConductorConfig(policy="conductor", slo={"ttft_s": 1.0, "tbt_s": 0.1},
                                params={"cpp": {"enabled": False}})
    s = sim(recs, conductor=conductor, prefill=3, long_prompt_tokens=8192)
    r = s.run()
    long = r["long_prompts"]
    assert (long["threshold_tokens"], long["requests"], long["completed"]) == (8192, 2, 1)
    served = s.reqs[1]
    assert served.ttft < 1.0
    assert long["slo_attainment"] == pytest.approx(0.5)
    assert long["ttft_mean_charged_s"] == pytest.approx((served.ttft + 1.0) / 2)
    none = sim(recs, conductor=conductor, prefill=3, long_prompt_tokens=100_000).run()
    assert none["long_prompts"]["requests"] == 0
    assert math.isnan(none["long_prompts"]["slo_attainment"])


# -- the store pool ---------------------------------------------------------------------------

def _store_only_trace() -> list[TraceRecord]:
    """A (16 blocks) at 0 s; C (16 other blocks) at 10 s evicts A from the one prefill
    instance's 16-block cache; B (A's 16 blocks + 4 more) at 20 s: its prefix is held by
    the store pool only."""
    return [TraceRecord(0.0, 8192, 2, tuple(range(16))),
            TraceRecord(10_000.0, 8192, 2, tuple(range(100, 116))),
            TraceRecord(20_000.0, 10_240, 2, tuple(range(20)))]


@pytest.mark.parametrize("policy", ["conductor", "kvcache-centric"])
def test_store_pool_gets_blocks_and_serves_a_fetch(policy: str) -> None:
    s = sim(_store_only_trace(), policy, prefill=1, prefill_cache_tokens=16 * BT,
            store_tokens=1_000_000)
    r = s.run()
    store = s.cluster.store_id
    assert store == 1
    a, c, b = s.reqs
    # every completed prompt was written to the pool
    assert s.index.match(store, a.info.keys) == 16
    assert s.index.match(store, c.info.keys) == 16
    # A's blocks left the instance; B fetched them from the pool instead of recomputing
    assert b.decision is not None
    pl = b.decision.placement
    assert (pl.source, pl.local_blocks, pl.fetch_blocks) == (store, 0, 16)
    assert b.reused_tokens == 8192
    assert r["token_hit_ratio"] == pytest.approx(8192 / (8192 + 8192 + 10_240))
    # TTFT: the fetch of 8192 tokens, then the prefill of the 2048 new ones
    cost = s.cost
    assert b.ttft == pytest.approx(cost.transfer_time(8192) + cost.prefill_time(10_240, 8192),
                                   rel=1e-9)
    assert s.prefill_gpu_s == pytest.approx(
        2 * cost.prefill_time(8192) + cost.prefill_time(10_240, 8192), rel=1e-9)


def test_a_fetch_enqueues_its_transfer_with_its_prefill() -> None:
    """While D runs, B (prefix in the store pool only) queues behind it with a fetch
    (kvcache-centric: no overlap): the queued work is B's transfer plus its prefill."""
    recs = [*_store_only_trace()[:2],
            TraceRecord(19_900.0, 30_000, 2, tuple(range(300, 359))),  # D, running at 20 s
            _store_only_trace()[2]]
    s = sim(recs, "kvcache-centric", prefill=1, prefill_cache_tokens=16 * BT,
            store_tokens=1_000_000, conductor=ConductorConfig(
                policy="kvcache-centric", decode_selector="least-load",
                admission=False))
    queued: list[float] = []
    arrive = s._arrive

    def spy(now: float, rid: int) -> None:
        arrive(now, rid)
        queued.append(s.cluster.prefill[0].queued_work_s)

    s._arrive = spy  # type: ignore[method-assign]
    s.run()
    b = s.reqs[3]
    assert b.decision is not None
    pl = b.decision.placement
    assert pl.source == s.cluster.store_id and pl.fetch_blocks == 16
    assert pl.transfer_s == pytest.approx(s.cost.transfer_time(8192), rel=1e-12)
    assert queued[3] == pytest.approx(pl.prefill_s + pl.transfer_s, rel=1e-12)


def test_a_migrating_fetch_leaves_the_source_copy_coldest() -> None:
    """conductor fetches with migration: right after B's fetch from the store pool,
    A's blocks there are the least recently used, behind C's newer ones."""
    s = sim(_store_only_trace(), "conductor", prefill=1, prefill_cache_tokens=16 * BT,
            store_tokens=1_000_000)
    store = s.cluster.store_id
    assert store is not None
    order: list[list[int]] = []
    reuse = s._reuse_at_start

    def spy(req: _Req, iid: int, now: float) -> tuple[int, float]:
        out = reuse(req, iid, now)
        order.append(list(s.index._table(store)))
        return out

    s._reuse_at_start = spy  # type: ignore[method-assign]
    s.run()
    a, c, b = s.reqs
    assert b.decision is not None and b.decision.placement.migrate
    coldest_first = order[2]
    assert set(coldest_first[:16]) == set(a.info.keys)
    assert set(coldest_first[16:]) == set(c.info.keys)


def test_priority_orders_a_queue_in_the_simulator() -> None:
    """With ``priority_weight`` the conductor orders queues shortest-job-first: behind
    A, the short C overtakes the longer B that arrived before it."""
    recs = [TraceRecord(0.0, 16_000, 2, tuple(range(32))),
            TraceRecord(10.0, 12_000, 2, tuple(range(100, 124))),
            TraceRecord(20.0, 1_000, 2, tuple(range(200, 202)))]
    kw = {"policy": "conductor", "decode_selector": "least-load", "admission": False,
          "replicate": False}
    sjf = sim(recs, prefill=1, conductor=ConductorConfig(
        **kw, params={"priority_weight": 1.0, "cpp": {"enabled": False}}))
    sjf.run()
    fifo = sim(recs, prefill=1, conductor=ConductorConfig(
        **kw, params={"cpp": {"enabled": False}}))
    fifo.run()
    cost = sjf.cost
    ta, tb, tc = cost.prefill_time(16_000), cost.prefill_time(12_000), cost.prefill_time(1_000)
    _, b, c = sjf.reqs
    assert c.info.arrival + c.ttft == pytest.approx(ta + tc, rel=1e-9)
    assert b.info.arrival + b.ttft == pytest.approx(ta + tc + tb, rel=1e-9)
    _, b, c = fifo.reqs
    assert b.info.arrival + b.ttft == pytest.approx(ta + tb, rel=1e-9)
    assert c.info.arrival + c.ttft == pytest.approx(ta + tb + tc, rel=1e-9)


def test_without_a_store_pool_the_evicted_prefix_is_recomputed() -> None:
    s = sim(_store_only_trace(), "conductor", prefill=1, prefill_cache_tokens=16 * BT)
    r = s.run()
    assert s.cluster.store_id is None
    assert s.reqs[2].reused_tokens == 0 and r["token_hit_ratio"] == 0.0
    assert s.reqs[2].ttft == pytest.approx(s.cost.prefill_time(10_240), rel=1e-9)


def test_store_pool_capacity_is_in_blocks_of_the_configured_tokens() -> None:
    # a pool of 16 blocks keeps only the newest prompt: C evicts A there too
    s = sim(_store_only_trace(), "conductor", prefill=1, prefill_cache_tokens=16 * BT,
            store_tokens=16 * BT)
    r = s.run()
    assert s.reqs[2].reused_tokens == 0 and r["token_hit_ratio"] == 0.0


def test_result_row_counts() -> None:
    recs = [TraceRecord(float(i), 1024, 2, (i,)) for i in range(3)]
    r = simulate(recs, SimConfig(prefill=2, decode=1,
                                 conductor=ConductorConfig(policy="round-robin")))
    assert (r["requests"], r["completed"], r["rejected"]) == (3, 3, 0)
    assert r["simulated_seconds"] == pytest.approx(0.002)
    assert math.isfinite(r["ttft_p99_s"])
