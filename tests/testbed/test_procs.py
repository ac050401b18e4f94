"""The process harness hands out ports that stay free, and restarts a worker whose port was
taken between choosing it and binding it (the CI failure of stop 24)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from mooncake_testbed import procs


def _occupy() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((procs.HOST, procs.free_port()))
    s.listen()
    return s, int(s.getsockname()[1])


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    lo, hi = procs.PORT_RANGE
    ports = [procs.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(lo <= p <= hi for p in ports)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        eph_lo, _ = (int(x) for x in f.read().split())
    assert hi < eph_lo
    for p in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((procs.HOST, p))


def test_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    held, taken = _occupy()
    with held:
        # none handed out yet, so the held port is passed over for being in use alone; the
        # draws after it walk down from it (a neighbour may be in use too)
        monkeypatch.setattr(procs, "_handed_out", set())
        picks = iter([taken, *range(taken - 1, procs.PORT_RANGE[0] - 1, -1)])
        monkeypatch.setattr(procs._port_rng, "randint", lambda a, b: next(picks))
        assert procs.free_port() != taken


@pytest.fixture()
def occupied() -> Iterator[int]:
    s, port = _occupy()
    with s:
        yield port


def test_worker_on_a_taken_port_given_explicitly_fails_with_its_log(occupied: int) -> None:
    ports = (procs.free_port(), occupied, procs.free_port())
    with pytest.raises(RuntimeError, match=procs.ADDRESS_IN_USE), \
            procs.run_worker("--time-scale", "0", ports=ports):
        pass


def test_worker_whose_free_port_was_taken_starts_again_on_new_ones(
        occupied: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real = procs.free_port
    handed = iter([procs.free_port(), occupied])  # the replay port is taken: the race in CI

    def racing() -> int:
        return next(handed, None) or real()

    monkeypatch.setattr(procs, "free_port", racing)
    with procs.run_worker("--time-scale", "0") as w:
        assert occupied not in (w.port, w.kv_port, w.replay_port)
        assert procs.http_json(w.url + "/health")[0] == 200
