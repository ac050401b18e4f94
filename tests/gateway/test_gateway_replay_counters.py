"""The replay's counters across gateway restarts (``replay.CounterIncrease``): a total is
never negative, a restart loses at most what was counted since the last read, and a
counter owner seen late is counted from its first read or, if it started during the run,
from zero."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_gateway.replay import COUNTERS, CounterIncrease

STARTED = 1000.0


def _state(owner: str, since: float, prefill_s: float, prompt: int = 0) -> dict[str, Any]:
    tokens = dict.fromkeys(COUNTERS, 0.0)
    tokens.update(prefill_seconds=prefill_s, prompt=prompt, engine_prompt=prompt,
                  engine_cached=prompt // 2)
    return {"policy": "conductor", "counters": {"id": owner, "since": since},
            "tokens": tokens}


def test_a_restart_mid_run_counts_from_zero_and_never_goes_negative() -> None:
    c = CounterIncrease(STARTED)
    c.add(_state("a", 10.0, 1200.0, 50_000))  # before the run: a long-lived gateway
    c.add(_state("a", 10.0, 1230.0, 51_000))
    # the gateway restarts: its counters start again from zero under a new owner
    c.add(_state("b", STARTED + 40, 5.0, 300))
    c.add(_state("b", STARTED + 40, 12.0, 700))
    got = c.total()
    assert got["prefill_seconds"] == pytest.approx(30.0 + 12.0)  # not 12 - 1200 = -1188
    assert got["prompt"] == 1000 + 700
    assert got["engine_cached"] == 500 + 350
    assert c.policy == "conductor"


def test_a_replica_first_seen_mid_run_counts_from_its_first_read() -> None:
    c = CounterIncrease(STARTED)
    c.add(_state("a", 10.0, 100.0))
    c.add(_state("r2", 20.0, 400.0))  # up before the run; its earlier counts are not ours
    c.add(_state("r2", 20.0, 410.0))
    c.add(_state("a", 10.0, 103.0))
    assert c.total()["prefill_seconds"] == pytest.approx(3.0 + 10.0)


def test_an_old_gateway_without_owner_ids_still_reads_as_before() -> None:
    c = CounterIncrease(STARTED)
    before, after = _state("", 0.0, 7.0, 100), _state("", 0.0, 9.5, 160)
    for s in (before, after):
        del s["counters"]
        c.add(s)
    assert c.total()["prefill_seconds"] == pytest.approx(2.5)
    assert c.total()["prompt"] == 60
