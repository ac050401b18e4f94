"""The pod runner reads probe results with the kubelet's thresholds."""

from __future__ import annotations

from mooncake_localcluster.readiness import Readiness, probe_timeout_s


def _run(readiness: Readiness, results: str, probe: dict[str, object]) -> str:
    """Readiness after each result ('+' success, '-' failure), as a string of R / n."""
    return "".join("R" if readiness.record(r == "+", probe) else "n" for r in results)


def test_defaults_take_three_failures_to_go_unready_and_one_success_back() -> None:
    r = Readiness()
    assert not r.ready
    assert _run(r, "-+--+---+", {}) == "nRRRRRRnR"


def test_a_success_breaks_a_run_of_failures() -> None:
    r = Readiness()
    assert _run(r, "+--+--+", {"failureThreshold": 3}) == "RRRRRRR"


def test_thresholds_come_from_the_probe() -> None:
    probe = {"failureThreshold": 1, "successThreshold": 2}
    assert _run(Readiness(), "++-+-++", probe) == "nRnnnnR"


def test_a_restart_starts_not_ready_with_nothing_counted() -> None:
    r = Readiness()
    _run(r, "+--", {})
    r.restart()
    assert not r.ready
    # the two failures before the restart no longer count towards the next three
    assert _run(r, "+-", {}) == "RR"
    assert _run(r, "--", {}) == "Rn"


def test_timeout_comes_from_the_probe() -> None:
    assert probe_timeout_s({}) == 1.0
    assert probe_timeout_s({"timeoutSeconds": 5}) == 5.0
