"""Crash-looping over a window (``mooncake_operator/crashes.py``), not over lifetime
restarts: isolated crashes heal, a burst is reported, a pod seen mid-burst is reported at
once, and ``finishedAt`` dates each crash."""

from __future__ import annotations

import dataclasses

from mooncake_operator.crashes import CrashHistory
from mooncake_operator.observe import PodView, pod_view

WINDOW = 600.0


def _pod(restarts: int, last_crash_at: float | None = None, uid: str = "u1") -> PodView:
    return PodView(name="c-prefill-r-0", uid=uid, role="prefill", revision="r", ordinal=0,
                   restarts=restarts, last_crash_at=last_crash_at)


def test_isolated_crashes_never_add_up_but_a_burst_does() -> None:
    h = CrashHistory(WINDOW, threshold=3)
    assert h.observe([_pod(0)], 0.0) == {"u1": 0}
    # three crashes, each healed, 11 minutes apart: never 3 in a window
    for i, t in enumerate((660.0, 1320.0, 1980.0), 1):
        assert h.observe([_pod(i, t)], t + 5) == {"u1": 1}
    # a burst: three more within two minutes
    got = [h.observe([_pod(3 + i, t)], t + 1)["u1"] for i, t in
           enumerate((2100.0, 2160.0, 2220.0), 1)]
    assert got == [2, 3, 4]  # the 1980 s crash is still in the window for the first two
    # a window after the last crash it has healed
    assert h.observe([_pod(6, 2220.0)], 2220.0 + WINDOW + 1) == {"u1": 0}


def test_a_pod_first_seen_with_restarts_counts_its_latest_crash_as_many_as_it_had() -> None:
    h = CrashHistory(WINDOW, threshold=3)
    assert h.observe([_pod(7, 990.0)], 1000.0) == {"u1": 3}  # an operator that just started
    assert h.observe([_pod(1, 100.0, uid="u2")], 1000.0) == {"u2": 0}  # long healed
    assert h.observe([_pod(7, 990.0)], 990.0 + WINDOW + 1) == {"u1": 0}


def test_a_crash_without_finished_at_is_dated_now_and_pods_gone_are_forgotten() -> None:
    h = CrashHistory(WINDOW, threshold=3)
    h.observe([_pod(0)], 0.0)
    assert h.observe([_pod(2)], 50.0) == {"u1": 2}
    h.observe([_pod(0, uid="u2")], 50.0 + WINDOW + 1)
    assert set(h._pods) == {"u2"}


def test_pod_view_reads_the_latest_termination() -> None:
    pod = {"metadata": {"name": "c-prefill-r-0", "uid": "u1",
                        "labels": {"mooncake.io/role": "prefill"}},
           "status": {"containerStatuses": [
               {"restartCount": 2, "lastState": {"terminated": {
                   "finishedAt": "2026-12-05T10:00:00Z"}}},
               {"restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"finishedAt": "2026-12-05T10:01:30Z"}}},
               {"restartCount": 0, "lastState": {"terminated": {"finishedAt": "garbage"}}},
           ]}}
    v = pod_view(pod)
    assert v is not None
    assert (v.restarts, v.crash_looping) == (5, True)
    assert v.last_crash_at is not None
    assert v.last_crash_at - 1796464800.0 == 90.0  # 2026-12-05T10:00:00Z + 90 s
    assert dataclasses.replace(v, last_crash_at=None).last_crash_at is None
