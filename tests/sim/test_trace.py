import json
import subprocess
import sys
from pathlib import Path

import pytest
from mooncake_sim.trace import (
    TraceError,
    TraceRecord,
    arrival_tick_ms,
    bundled_trace,
    load_trace,
    reuse_ceiling,
    spread_arrivals,
    trace_stats,
)

GOOD = [
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 10, "input_length": 512, "output_length": 1, "hash_ids": [9]},
]


def write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_and_ceiling(tmp_path: Path) -> None:
    recs = load_trace(write(tmp_path, [json.dumps(x) for x in GOOD]))
    assert [r.input_length for r in recs] == [600, 1100, 512]
    # request 2 reuses blocks 1,2 (1024 tokens) of 2212 input tokens in all
    tok, blk = reuse_ceiling(recs)
    assert tok == pytest.approx(1024 / 2212)
    assert blk == pytest.approx(2 / 6)
    st = trace_stats(recs)
    assert st.requests == 3 and st.duration_s == pytest.approx(0.01) and st.distinct_blocks == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": []}',
         "'input_length' must not be negative"),
        ('{"timestamp": 5, "input_length": 1600, "output_length": 1, "hash_ids": [1, 2]}',
         "2 hash_ids cannot cover input_length 1600"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
         "'hash_ids' must be a list of integers"),
        ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "'timestamp' must be a number"),
        ('{"timestamp": 5, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
        ('{"timestamp": 5, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}',
         "whole number"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "timestamps must not decrease"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    p = write(tmp_path, [json.dumps(GOOD[0]) for _ in range(1)] + [
        '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [5]}', line])
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert f"{p}:3" in str(err.value)
    assert message in str(err.value)


def test_empty_and_missing(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, [""]))
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("cmd", ["simulate --trace", "trace-stats"])
def test_cli_exit_2_without_traceback(tmp_path: Path, cmd: str) -> None:
    bad = write(tmp_path, [json.dumps(GOOD[0]), "{oops"])
    r = subprocess.run([sys.executable, "-m", "mooncake_cli", *cmd.split(), str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{bad}:2: not valid JSON" in r.stderr


def test_bundled_trace_matches_the_published_statistics() -> None:
    recs = load_trace(bundled_trace())
    st = trace_stats(recs)
    assert st.requests == 12_031
    assert st.avg_input == pytest.approx(12_035, abs=1)
    assert st.reuse_ceiling_tokens == pytest.approx(0.374, abs=0.001)


def test_lines_off_the_fast_path_read_as_before(tmp_path: Path) -> None:
    """Well-formed lines are read by a lean check, every other by the full one: a
    length written as a whole float is still a length, a boolean is still no block id,
    and both paths give equal records."""
    plain = dict(GOOD[1])
    floaty = {**plain, "timestamp": 11.5, "input_length": 1100.0, "output_length": 5.0}
    recs = load_trace(write(tmp_path, [json.dumps(plain), json.dumps(floaty)]))
    assert recs[0].input_length == recs[1].input_length == 1100
    assert recs[0].hash_ids == recs[1].hash_ids == (1, 2, 3)
    assert recs[1].timestamp_ms == 11.5
    for bad, message in [({**plain, "hash_ids": [1, True, 3]}, "list of integers"),
                         ({**plain, "output_length": True}, "must be a number"),
                         ({**plain, "timestamp": float("nan")}, "'timestamp' must be")]:
        with pytest.raises(TraceError, match=message):
            load_trace(write(tmp_path, [json.dumps(plain), json.dumps(bad)]))


def _at(*stamps: float) -> list[TraceRecord]:
    return [TraceRecord(timestamp_ms=t, input_length=10, output_length=1, hash_ids=(i,))
            for i, t in enumerate(stamps)]


def test_the_arrival_tick_is_the_median_step_of_grouped_timestamps() -> None:
    # most requests share an instant: the tick is the median gap between instants
    assert arrival_tick_ms(_at(0, 0, 0, 3000, 3000, 5999, 5999, 9000)) == 3000.0
    # arrivals recorded apart have no tick, nor does a single instant
    assert arrival_tick_ms(_at(0, 37, 90, 130)) == 0.0
    assert arrival_tick_ms(_at(0, 0, 0, 0, 5, 9, 11, 12, 13)) == 0.0  # half grouped: apart
    assert arrival_tick_ms(_at(5, 5, 5)) == 0.0
    assert arrival_tick_ms(load_trace(bundled_trace())) == 3000.0


def test_spread_arrivals_moves_each_within_its_tick_and_keeps_everything_else() -> None:
    recs = _at(0, 0, 0, 3000, 3000)
    moved = spread_arrivals(recs, 3000.0, seed=3)
    assert [r.timestamp_ms for r in moved] == sorted(r.timestamp_ms for r in moved)
    by_id = {r.hash_ids: r for r in moved}
    for r in recs:
        m = by_id[r.hash_ids]
        assert r.timestamp_ms <= m.timestamp_ms < r.timestamp_ms + 3000.0
        assert (m.input_length, m.output_length) == (r.input_length, r.output_length)
    assert len({r.timestamp_ms for r in moved}) == 5  # no two at one instant now
    assert spread_arrivals(recs, 3000.0, seed=3) == moved  # the seed decides
    assert spread_arrivals(recs, 0.0) == recs
    with pytest.raises(ValueError, match="tick_ms must be >= 0"):
        spread_arrivals(recs, -1.0)
