"""Holding (:mod:`mooncake_conductor.holding`): who holds, until when, and admission
counting the time a held request already waited."""

from typing import Any

import pytest
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.holding import HoldingConfig, hold_deadline
from mooncake_conductor.state import ClusterState
from pydantic import ValidationError

from .helpers import cluster, request

NO_CPP = {"cpp": {"enabled": False}}


def _decode_full() -> ClusterState:
    """Two idle prefill instances; the one decode instance has no KV room left."""
    c = cluster(2, decode=1)
    d = c.decode[0]
    d.batch, d.context_tokens, d.capacity_tokens = 1, 1000, 2000
    return c


def _conductor(policy: str = "conductor", **cfg: Any) -> Conductor:
    params = NO_CPP if policy == "conductor" else {}
    return Conductor(ConductorConfig(policy=policy, params=params, **cfg))


def test_the_deadline_is_the_latest_start_that_meets_the_ttft_slo() -> None:
    assert hold_deadline(10.0, 30.0, 2.0, 0.5) == pytest.approx(37.5)


def test_a_request_refused_only_for_decode_room_is_held_until_its_deadline() -> None:
    cond = _conductor()
    req = request(list(range(8)), arrival=5.0)
    d = cond.schedule(req, _decode_full(), 5.0)
    assert d.reject_reason == "tbt-slo" and d.placement.reject_reason is None
    until = cond.hold_until(req, d, 5.0)
    assert until == pytest.approx(5.0 + 30.0 - d.placement.prefill_s - d.placement.transfer_s)
    assert cond.hold_until(req, d, until) is None  # past the deadline the refusal stands


@pytest.mark.parametrize(("policy", "cfg", "holds"), [
    ("conductor", {}, True),
    ("mooncake-paper", {}, False),
    ("conductor", {"holding": {"enabled": False}}, False),
    ("mooncake-paper", {"holding": {"enabled": True}}, True),
    ("conductor", {"admission": False}, False),  # nothing is refused to hold
    # the paper's selector does not count placed requests: released together they would
    # pile onto the same room, so it holds only when asked to
    ("conductor", {"decode_selector": "tbt-slo"}, False),
    ("conductor", {"decode_selector": "tbt-slo", "holding": {"enabled": True}}, True),
])
def test_who_holds(policy: str, cfg: dict[str, Any], holds: bool) -> None:
    cond = _conductor(policy, **cfg)
    req = request(list(range(8)))
    d = cond.schedule(req, _decode_full(), 0.0)
    assert cond.capabilities.holding is holds
    assert (cond.hold_until(req, d, 0.0) is not None) is holds


def test_a_prefill_side_refusal_is_never_held() -> None:
    cond = _conductor(slo={"ttft_s": 0.01, "tbt_s": 0.1})  # no prompt meets 10 ms
    req = request(list(range(8)))
    d = cond.schedule(req, _decode_full(), 0.0)
    assert d.placement.reject_reason == "ttft-slo"
    assert cond.hold_until(req, d, 0.0) is None


def test_admission_counts_the_time_already_waited() -> None:
    cond = _conductor()
    req = request(list(range(8)), arrival=0.0)
    c = cluster(2, decode=1)
    fresh = cond.schedule(req, c, 0.0)
    assert not fresh.rejected
    late = _conductor().schedule(req, cluster(2, decode=1), 30.0 - fresh.placement.ttft_s / 2)
    assert late.reject_reason == "ttft-slo"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValidationError):
        HoldingConfig(enabled="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        HoldingConfig(unknown=1)  # type: ignore[call-arg]
