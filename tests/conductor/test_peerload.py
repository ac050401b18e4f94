"""Foreign load from the other replicas of a scheduler (``mooncake_conductor.peerload``):
folded into every wait and decode check, never re-reported, dropped when stale."""

from __future__ import annotations

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.peerload import (
    DecodeLoad,
    LoadReport,
    PeerLoads,
    PrefillLoad,
    own_report,
)
from mooncake_conductor.state import DecodeState, PrefillState

from .helpers import cluster, queue, request

KEYS = list(range(20))  # 10,240 tokens: ~1.5 s of prefill on an idle instance


def test_foreign_work_counts_in_the_wait_and_survives_the_own_queue() -> None:
    p = PrefillState(iid=0, name="p0")
    queue(p, 2.0)
    p.set_foreign(5.0)
    assert p.wait_time(0.0) == pytest.approx(7.0)
    assert p.own_work_s == pytest.approx(2.0)
    p.set_foreign(1.0)  # a newer report replaces the older: it is not added
    assert p.wait_time(0.0) == pytest.approx(3.0)
    p.pop()  # the own queue empties; the peers' work stays
    assert p.queue == [] and p.wait_time(0.0) == pytest.approx(1.0)
    assert p.own_work_s == 0.0
    p.set_foreign(0.0)
    assert p.wait_time(0.0) == 0.0


def test_foreign_sequences_count_in_the_decode_batch_and_kv() -> None:
    d = DecodeState(iid=0, name="d0", capacity_tokens=1000, batch=2, context_tokens=100)
    d.set_foreign(3, 400, 100)
    assert (d.batch, d.context_tokens, d.reserved_tokens) == (5, 500, 100)
    assert d.kv_usage == pytest.approx(0.6)
    assert d.own == (2, 100, 0)
    d.batch -= 1  # one of ours finishes
    d.set_foreign(0, 0, 0)
    assert (d.batch, d.context_tokens, d.reserved_tokens) == (1, 100, 0)


def _report(work: dict[str, float], batch: dict[str, int] | None = None) -> LoadReport:
    return LoadReport({n: PrefillLoad(w, 1) for n, w in work.items()},
                      {n: DecodeLoad(b, 1000 * b, 10 * b) for n, b in (batch or {}).items()})


def test_fresh_reports_are_summed_by_instance_name_and_stale_ones_count_nothing() -> None:
    c = cluster(2, decode=1)
    c.decode[0].name = "d0"
    peers = PeerLoads(stale_s=2.0)
    peers.update("a", _report({"p0": 3.0}, {"d0": 2}), now=10.0)
    peers.update("b", _report({"p0": 1.0, "p1": 4.0, "gone": 9.0}, {"d0": 1}), now=11.0)
    peers.apply(c, now=11.5)
    assert [p.foreign_work_s for p in c.prefill] == [4.0, 4.0]
    assert c.decode[0].foreign == (3, 3000, 30)
    peers.apply(c, now=12.5)  # a's report is 2.5 s old
    assert peers.fresh(12.5) == ["b"]
    assert [p.foreign_work_s for p in c.prefill] == [1.0, 4.0]
    assert c.decode[0].batch == 1
    peers.forget("b")
    peers.apply(c, now=12.5)
    assert [p.wait_time(12.5) for p in c.prefill] == [0.0, 0.0]
    assert c.decode[0].batch == 0


def test_a_replica_reports_only_its_own_load() -> None:
    """What a replica heard is never passed on: two replicas would echo each other's
    load back and forth, each round larger."""
    c = cluster(2, decode=1)
    c.decode[0].name = "d0"
    queue(c.prefill[0], 2.0)
    c.decode[0].batch, c.decode[0].context_tokens = 1, 500
    peers = PeerLoads(stale_s=2.0)
    peers.update("a", _report({"p0": 3.0, "p1": 1.0}, {"d0": 4}), now=0.0)
    peers.apply(c, now=0.0)
    rep = own_report(c)
    assert set(rep.prefill) == {"p0"} and rep.prefill["p0"].work_s == pytest.approx(2.0)
    assert rep.decode["d0"] == DecodeLoad(1, 500, 0)


def test_the_report_round_trips_and_bad_fields_are_named() -> None:
    rep = _report({"p0": 1.5}, {"d0": 2})
    assert LoadReport.from_json(rep.to_json()) == rep
    for bad, field in (({"prefill": {"p0": {"work_s": -1, "requests": 1}}}, "prefill.p0.work_s"),
                       ({"prefill": {"p0": {"work_s": 1}}}, "prefill.p0.requests"),
                       ({"decode": {"d0": {"batch": "2", "context_tokens": 0,
                                           "reserved_tokens": 0}}}, "decode.d0.batch"),
                       ({"decode": []}, "decode"), ([], "object")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            LoadReport.from_json(bad)


def test_a_peers_queue_moves_the_next_request_and_admission_counts_it() -> None:
    conductor = Conductor(ConductorConfig(policy="conductor", slo={"ttft_s": 5.0}))
    c = cluster(2, decode=1)
    alone = conductor.schedule(request(KEYS), c, 0.0)
    assert not alone.rejected
    chosen = alone.placement.prefill
    peers = PeerLoads(stale_s=2.0)
    peers.update("a", _report({f"p{chosen}": 3.0}), now=0.0)
    peers.apply(c, now=0.0)
    moved = conductor.schedule(request(KEYS, rid=1), c, 0.0)
    assert moved.placement.prefill == 1 - chosen
    # both instances busy beyond the TTFT SLO with the peer's work: refused
    peers.update("a", _report({"p0": 6.0, "p1": 6.0}), now=0.0)
    peers.apply(c, now=0.0)
    full = conductor.schedule(request(KEYS, rid=2), c, 0.0)
    assert full.rejected and full.reject_reason == "ttft-slo"
