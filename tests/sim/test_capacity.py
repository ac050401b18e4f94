"""Effective capacity: the bisection, the compute-bound limit, the P/D sweep and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mooncake_cli.main import main
from mooncake_conductor.cost import CostModel, CostModelConfig
from mooncake_sim.capacity import (
    MAX_BRACKET_STEPS,
    compute_bound_speed,
    ideal_reuse_prefill_times,
    pd_splits,
    search_capacity,
    search_capacity_batched,
)
from mooncake_sim.synth import generate, write_trace
from mooncake_sim.trace import TraceRecord

BLOCK = 512


def step(threshold: float, low: float = 0.5) -> tuple[list[float], object]:
    calls: list[float] = []

    def attainment(speed: float) -> float:
        calls.append(speed)
        return 1.0 if speed <= threshold else low

    return calls, attainment


@pytest.mark.parametrize("start", [0.1, 1.0, 2.5, 7.0, 60.0])
def test_bisection_finds_the_threshold_from_either_side(start: float) -> None:
    calls, f = step(2.5)
    out = search_capacity(f, start, target=0.9, rel_tol=0.01)  # type: ignore[arg-type]
    assert out.bracketed
    assert 2.5 / 1.01 <= out.capacity_speed <= 2.5
    assert [p.speed for p in out.probes] == calls
    assert all(p.ok == (p.speed <= 2.5) for p in out.probes)
    # every ok probe is at or below the answer, every miss above it
    assert max(p.speed for p in out.probes if p.ok) == out.capacity_speed
    assert min(p.speed for p in out.probes if not p.ok) > out.capacity_speed


def test_the_target_is_a_share_met_not_exceeded() -> None:
    # 90% exactly meets a 0.9 target; 89.9% does not
    out = search_capacity(lambda s: 0.9 if s <= 3 else 0.899, 1.0, target=0.9, rel_tol=0.01)
    assert 3 / 1.01 <= out.capacity_speed <= 3


def test_nothing_meets_the_target_gives_zero() -> None:
    out = search_capacity(lambda s: 0.0, 1.0)
    assert out.capacity_speed == 0.0 and not out.bracketed
    assert len(out.probes) == MAX_BRACKET_STEPS + 1
    assert out.probes[-1].speed == pytest.approx(2.0 ** -MAX_BRACKET_STEPS)


def test_always_meeting_the_target_is_only_a_lower_bound() -> None:
    out = search_capacity(lambda s: 1.0, 1.0)
    assert not out.bracketed
    assert out.capacity_speed == pytest.approx(2.0 ** MAX_BRACKET_STEPS)


def test_the_probe_budget_is_respected() -> None:
    _, f = step(2.5)
    out = search_capacity(f, 1.0, rel_tol=1e-9, max_probes=6)  # type: ignore[arg-type]
    assert len(out.probes) == 6 and out.bracketed
    assert out.capacity_speed <= 2.5


@pytest.mark.parametrize("kwargs", [{"start": 0.0}, {"start": math.inf}, {"target": 0.0},
                                    {"target": 1.5}, {"rel_tol": 0.0}])
def test_bad_search_arguments(kwargs: dict[str, float]) -> None:
    args = {"start": 1.0, **kwargs}
    with pytest.raises(ValueError):
        search_capacity(lambda s: 1.0, **args)  # type: ignore[arg-type]


def batched(threshold: float) -> tuple[list[list[float]], object]:
    rounds: list[list[float]] = []

    def attainments(speeds: list[float]) -> list[float]:
        rounds.append(list(speeds))
        return [1.0 if s <= threshold else 0.5 for s in speeds]

    return rounds, attainments


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("start", [0.1, 1.0, 2.5, 7.0, 60.0])
def test_wider_rounds_find_the_same_threshold_in_fewer_rounds(start: float, width: int) -> None:
    rounds, f = batched(2.5)
    out = search_capacity_batched(f, start, width, target=0.9, rel_tol=0.01)  # type: ignore[arg-type]
    assert out.bracketed
    assert 2.5 / 1.01 <= out.capacity_speed <= 2.5
    assert all(len(r) <= width for r in rounds) and max(map(len, rounds)) == width
    assert [p.speed for p in out.probes] == [s for r in rounds for s in r]
    assert out.rounds == len(rounds)
    assert max(p.speed for p in out.probes if p.ok) == out.capacity_speed
    assert min(p.speed for p in out.probes if not p.ok) > out.capacity_speed
    one = search_capacity(lambda s: 1.0 if s <= 2.5 else 0.5, start, target=0.9, rel_tol=0.01)
    assert len(rounds) < len(one.probes)  # each round of the plain search is one probe


def test_a_round_is_decided_by_its_first_miss() -> None:
    # attainment rises again from 4 on (it should not): the ok at 4 above the miss at 2 is
    # kept in the probes but decides nothing
    def f(speeds: list[float]) -> list[float]:
        return [1.0 if s <= 1.5 or s >= 4 else 0.5 for s in speeds]

    out = search_capacity_batched(f, 1.0, 3, target=0.9, rel_tol=0.01)
    assert [(p.speed, p.ok) for p in out.probes[:3]] == [(1.0, True), (2.0, False), (4.0, True)]
    assert out.bracketed
    assert 1.5 / 1.01 <= out.capacity_speed <= 1.5


@pytest.mark.parametrize("max_probes", [1, 2, 5])
def test_wide_rounds_keep_the_probe_budget(max_probes: int) -> None:
    _, f = batched(2.5)
    out = search_capacity_batched(f, 1.0, 3, rel_tol=1e-9,  # type: ignore[arg-type]
                                  max_probes=max_probes)
    assert len(out.probes) == max_probes
    assert out.capacity_speed <= 2.5


def test_a_wide_search_keeps_the_bracket_limits_and_a_budget_per_round() -> None:
    always = search_capacity_batched(lambda s: [1.0] * len(s), 1.0, 64)
    assert max(p.speed for p in always.probes) == 2.0 ** MAX_BRACKET_STEPS
    assert len(always.probes) == MAX_BRACKET_STEPS + 1 and not always.bracketed
    # eight a round still reaches the tolerance: the default budget counts rounds
    _, f = batched(3.0)
    out = search_capacity_batched(f, 1.0, 8, rel_tol=0.001)  # type: ignore[arg-type]
    assert out.bracketed and 3.0 / 1.001 <= out.capacity_speed <= 3.0
    assert len(out.probes) > 24


def test_width_must_be_positive() -> None:
    with pytest.raises(ValueError, match="width"):
        search_capacity_batched(lambda s: [1.0] * len(s), 1.0, 0)


def rec(t_ms: float, n: int, hashes: tuple[int, ...]) -> TraceRecord:
    return TraceRecord(timestamp_ms=t_ms, input_length=n, output_length=10, hash_ids=hashes)


def test_ideal_reuse_counts_only_leading_blocks_seen_before() -> None:
    cm = CostModel(CostModelConfig())
    records = [
        rec(0, 1000, (1, 2)),        # cold
        rec(1000, 1200, (1, 2, 3)),  # reuses blocks 1 and 2: 1024 tokens
        rec(2000, 1500, (9, 2, 3)),  # block 9 is new: nothing reused, whatever follows
        rec(3000, 300, (1,)),        # one block, shorter than 512 tokens: all 300 reused
    ]
    times = ideal_reuse_prefill_times(records, cm)
    assert times == pytest.approx([
        cm.prefill_compute_time(1000, 0),
        cm.prefill_compute_time(1200, 2 * BLOCK),
        cm.prefill_compute_time(1500, 0),
        cm.prefill_compute_time(300, 300),
    ])
    # the limit: instances x span / work
    work = sum(times)
    assert compute_bound_speed(records, 4, cm) == pytest.approx(4 * 3.0 / work)
    # the cheapest half of the requests: the two smallest prefill times
    cheapest = sorted(times)[:2]
    assert compute_bound_speed(records, 4, cm, share=0.5) == pytest.approx(4 * 3.0 / sum(cheapest))
    # the TTFT SLO to drain after the last arrival: span / (work / pool - drain)
    assert compute_bound_speed(records, 1, cm, drain_s=0.1) == pytest.approx(
        3.0 / (work - 0.1))
    assert compute_bound_speed(records, 1, cm, drain_s=work) == math.inf
    assert compute_bound_speed(records[:1], 4, cm) == math.inf  # no span, no rate


def test_pd_splits() -> None:
    assert pd_splits(4) == [(1, 3), (2, 2), (3, 1)]
    assert pd_splits(8, 3) == [(1, 7), (4, 4), (7, 1)]
    assert pd_splits(6, 4) == [(1, 5), (5, 1)]
    with pytest.raises(ValueError):
        pd_splits(1)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("trace") / "small.jsonl"
    write_trace(generate("conversation", 150, seed=3), p)
    return p


def test_capacity_cli_json(small_trace: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap.json"
    rc = main(["capacity", "--trace", str(small_trace), "--policy", "round-robin,conductor",
               "--prefill", "2", "--decode", "2", "--tolerance", "0.05", "--jobs", "1",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["target"] == 0.9 and doc["settings"]["requests"] == 150
    assert [r["policy"] for r in doc["results"]] == ["round-robin", "conductor"]
    for r in doc["results"]:
        for key in ("policy", "capacity_speed", "limit_speed", "of_bound", "limit_target_speed",
                    "rejected_work_share", "probes", "bracketed", "at_capacity"):
            assert key in r
        assert "ratio" not in r  # capacity over the all-requests limit can pass 100%
        assert r["of_bound"] == pytest.approx(r["capacity_speed"] / r["limit_target_speed"])
        assert 0 <= r["rejected_work_share"] <= 1
        assert (r["rejected_work_share"] > 0) == (r["at_capacity"]["rejected"] > 0)
        assert "rejected_ids" not in r["at_capacity"]
        ok = [p["speed"] for p in r["probes"] if p["ok"]]
        miss = [p["speed"] for p in r["probes"] if not p["ok"]]
        assert r["capacity_speed"] == max(ok)
        if r["bracketed"]:
            assert min(s for s in miss if s > r["capacity_speed"]) <= r["capacity_speed"] * 1.05
        assert r["at_capacity"]["slo_attainment"] >= 0.9
        # no policy beats the bound: the cheapest 90% with ideal reuse, drained within the SLO
        assert r["capacity_speed"] <= r["limit_target_speed"]
        assert r["of_bound"] <= 1.0
    # the same pool, the same limit, whatever the policy
    assert doc["results"][0]["limit_speed"] == doc["results"][1]["limit_speed"]
    table = capsys.readouterr().out
    assert "capacity" in table and "conductor" in table
    assert "of bound" in table and "of limit" not in table
    # the fair reading by default: every design offered shedding, stealing and holding
    assert doc["settings"]["capabilities"] == "equal"
    assert (doc["settings"]["shedding"], doc["settings"]["stealing"],
            doc["settings"]["holding"]) == (True, True, True)


def test_capacity_can_still_give_each_design_its_own_capabilities(
        small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "own.json"
    assert main(["capacity", "--trace", str(small_trace), "--policy", "kvcache-centric",
                 "--prefill", "2", "--decode", "2", "--tolerance", "0.1", "--jobs", "1",
                 "--capabilities", "own", "--holding", "--json", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["capabilities"] == "own"
    assert (settings["shedding"], settings["stealing"], settings["holding"]) == (None, None, True)
    assert "each design's own" in capsys.readouterr().err


def test_the_bound_holds_for_every_admission_design_on_a_loaded_pool(
        small_trace: Path, tmp_path: Path) -> None:
    # one prefill instance: the designs that shed reject the costliest prompts at capacity,
    # where capacity over the all-requests limit passed 100%; over the bound it cannot
    out = tmp_path / "one.json"
    assert main(["capacity", "--trace", str(small_trace), "--policy",
                 "kvcache-centric,mooncake-paper,conductor", "--prefill", "1", "--decode", "2",
                 "--tolerance", "0.05", "--jobs", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert any(r["capacity_speed"] > r["limit_speed"] for r in results)  # past "100%"
    for r in results:
        assert 0 < r["of_bound"] <= 1.0, r["policy"]
        assert r["capacity_speed"] <= r["limit_target_speed"]


def test_one_search_on_two_processes_probes_two_speeds_a_round(small_trace: Path,
                                                               tmp_path: Path) -> None:
    runs = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"cap{jobs}.json"
        assert main(["capacity", "--trace", str(small_trace), "--policy", "least-load",
                     "--prefill", "2", "--decode", "2", "--tolerance", "0.05",
                     "--jobs", jobs, "--json", str(out)]) == 0
        runs[jobs] = json.loads(out.read_text())["results"][0]
    one, two = runs["1"], runs["2"]
    assert (one["probes_per_round"], two["probes_per_round"]) == (1, 2)
    assert one["rounds"] == len(one["probes"]) and two["rounds"] < len(two["probes"])
    assert one["bracketed"] and two["bracketed"]
    # the same replay at the same speed, in a worker process or here
    both = {p["speed"] for p in one["probes"]} & {p["speed"] for p in two["probes"]}
    assert both  # the start at least
    for speed in both:
        assert ([p["slo_attainment"] for p in one["probes"] if p["speed"] == speed]
                == [p["slo_attainment"] for p in two["probes"] if p["speed"] == speed])
    # each found the capacity within the tolerance of the other's bracket
    for a, b in ((one, two), (two, one)):
        miss = min(p["speed"] for p in b["probes"]
                   if not p["ok"] and p["speed"] > b["capacity_speed"])
        assert a["capacity_speed"] <= miss
    assert two["at_capacity"]["slo_attainment"] >= 0.9


def test_pd_sweep_reports_each_split_and_the_best(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    assert main(["capacity", "--trace", str(small_trace), "--policy", "least-load",
                 "--pd-sweep", "4", "--tolerance", "0.1", "--jobs", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    splits = [(r["prefill"], r["decode"]) for r in doc["results"]]
    assert splits == [(1, 3), (2, 2), (3, 1)]
    best = max(doc["results"], key=lambda r: r["capacity_speed"])
    assert doc["best"] == [{"policy": "least-load", "prefill": best["prefill"],
                            "decode": best["decode"], "capacity_speed": best["capacity_speed"]}]
    # more prefill instances, a proportionally higher compute-bound limit
    limits = [r["limit_speed"] for r in doc["results"]]
    assert limits[1] == pytest.approx(2 * limits[0]) and limits[2] == pytest.approx(3 * limits[0])


@pytest.mark.parametrize(("args", "message"), [
    (["--policy", "nope"], "unknown policy"),
    (["--target", "1.5"], "--target"),
    (["--tolerance", "0"], "--tolerance"),
    (["--pd-sweep", "1"], "--pd-sweep"),
    (["--prefill", "0"], "--prefill must be positive"),
])
def test_bad_capacity_arguments_exit_2(small_trace: Path, args: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--trace", str(small_trace), *args]) == 2
    assert message in capsys.readouterr().err


def test_capacity_plot(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "cap.png"
    assert main(["capacity", "--trace", str(small_trace), "--policy", "least-load",
                 "--prefill", "2", "--decode", "2", "--tolerance", "0.1", "--jobs", "1",
                 "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
