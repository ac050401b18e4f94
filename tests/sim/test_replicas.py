"""Conductor replicas behind a front (``mooncake_sim/replicas.py``): no lag decides as one
Conductor; a lag hides the other replicas' recent placements from each decision and puts
everything back afterwards; replicas that never share decide worse under load."""

from __future__ import annotations

import math
from typing import Any

import pytest
from mooncake_conductor.engine import ConductorConfig
from mooncake_conductor.state import DecodeState, PrefillState, RequestInfo
from mooncake_sim.engine import SimConfig, Simulation, simulate
from mooncake_sim.replicas import ReplicaViews
from mooncake_sim.trace import bundled_trace, load_trace

from ..conductor.helpers import cluster

REQUESTS = 400
SLO = {"ttft_s": 10.0, "tbt_s": 0.1}


def _run(**kw: Any) -> dict[str, Any]:
    recs = load_trace(bundled_trace(), limit=REQUESTS)
    return simulate(recs, SimConfig(prefill=4, decode=4, speed=4.0,
                                    conductor=ConductorConfig(policy="conductor", slo=SLO),
                                    **kw))


def _decisions(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["completed"], r["ttft_mean_s"], r["tbt_p90_ms"], r["rejected_ids"])


def test_replicas_with_no_lag_decide_as_one_conductor() -> None:
    one = _run()
    assert _decisions(_run(replicas=4, replica_lag_ms=0.0)) == _decisions(one)


def test_replicas_that_never_share_admit_more_and_wait_longer() -> None:
    one = _run()
    blind = _run(replicas=4, replica_lag_ms=math.inf)
    assert blind["completed"] > one["completed"]  # each admits against a quarter's view
    assert blind["ttft_mean_s"] > one["ttft_mean_s"]
    synced = _run(replicas=4, replica_lag_ms=100.0)
    assert abs(synced["ttft_mean_s"] - one["ttft_mean_s"]) < abs(
        blind["ttft_mean_s"] - one["ttft_mean_s"])


def _info(rid: int) -> RequestInfo:
    return RequestInfo(rid=rid, arrival=0.0, input_tokens=512, output_tokens=8,
                       keys=[rid], block_tokens=512)


def test_a_view_hides_the_others_recent_work_and_restores_every_field() -> None:
    c = cluster(2, decode=1)
    p0: PrefillState = c.prefill[0]
    p0.enqueue(7, 0.0, 2.0, 1, 512)  # replica 1's, placed at t=0
    p0.enqueue(8, 1.0, 3.0, 1, 512)  # replica 0's own
    p0.busy_until = 5.0  # running request 9, replica 1's
    d: DecodeState = c.decode[0]
    d.batch, d.context_tokens, d.reserved_tokens = 2, 1000, 50
    views = ReplicaViews(2, lag_s=1.0)
    views.placed(1, 7, now=0.0)
    views.placed(1, 9, now=0.0)
    views.joined(1, 11, did=0, context=600, reserved=20, now=0.0)
    before = (p0.busy_until, p0.queued_work_s, p0.queue_len, list(p0.queue),
              d.batch, d.context_tokens, d.reserved_tokens)

    def where(rid: int) -> list[int]:
        return [0] if rid in (7, 9) else []

    with views.view(0, c, 0.5, where, running=lambda iid: 9 if iid == 0 else -1):
        assert p0.wait_time(0.5) == pytest.approx(3.0)  # only its own request 8
        assert [q.rid for q in p0.queue] == [8] and p0.queue_len == 1
        assert (d.batch, d.context_tokens, d.reserved_tokens) == (1, 400, 30)
    after = (p0.busy_until, p0.queued_work_s, p0.queue_len, list(p0.queue),
             d.batch, d.context_tokens, d.reserved_tokens)
    assert after == before
    with views.view(1, c, 0.5, where, running=lambda iid: 9):
        assert p0.wait_time(0.5) == pytest.approx(4.5 + 5.0)  # its own: everything
    with views.view(0, c, 1.5, where, running=lambda iid: 9):
        assert p0.wait_time(1.5) == pytest.approx(3.5 + 5.0)  # heard of by now
    assert views.replica_of(_info(5)) == 1


def test_a_join_and_finish_both_unheard_of_leave_no_trace() -> None:
    views = ReplicaViews(2, lag_s=math.inf)
    views.joined(1, 3, did=0, context=10, reserved=5, now=0.0)
    views.finished(1, 3, did=0, context=15, now=2.0)
    c = cluster(1, decode=1)
    with views.view(0, c, 3.0, lambda rid: [], running=lambda iid: -1):
        assert c.decode[0].batch == 0


def test_one_replica_keeps_the_simulation_unchanged() -> None:
    recs = load_trace(bundled_trace(), limit=50)
    sim = Simulation(recs, SimConfig(prefill=2, decode=2, replicas=1, replica_lag_ms=500.0))
    assert not sim.replicas.active
