"""The demo's pure parts: what it reads from the example, the replay speed it picks, the
report it prints and plots, and how a failed step is reported (no cluster needed; how it
writes the example into a cluster: tests/cli/test_demo_cluster.py)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from mooncake_cli import demo
from mooncake_cli.main import main
from mooncake_gateway.replay import BLOCK_SALT, block_tokens, prompt_tokens
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace

ROOT = Path(__file__).resolve().parents[2]


def test_example_facts_read_the_shipped_example() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "clusters" / "simulated.yaml").read_text())
    facts = demo.example_facts(doc)
    assert facts.name == doc["metadata"]["name"]
    assert facts.model == doc["spec"]["model"]["name"]
    assert facts.prefill_replicas == doc["spec"]["prefill"]["replicas"]
    assert facts.time_scale == doc["spec"]["engine"]["simulated"]["timeScale"]
    assert facts.tbt_slo_s == doc["spec"]["conductor"]["slo"]["tbtSeconds"]
    # the standards: end-to-end latency is only meaningful at time scale >= 0.5
    assert facts.time_scale >= 0.5


def test_example_facts_prefer_the_served_name_and_refuse_gpu_engines() -> None:
    doc: dict[str, Any] = {"metadata": {"name": "x"},
                           "spec": {"model": {"name": "m", "servedName": "public"}}}
    facts = demo.example_facts(doc)
    assert facts.model == "public" and facts.time_scale == 1.0 and facts.prefill_replicas == 1
    doc["spec"]["engine"] = {"kind": "vllm"}
    with pytest.raises(demo.DemoError, match="simulated"):
        demo.example_facts(doc)


def test_replay_speed_scales_with_load_pool_and_time_scale() -> None:
    records = load_trace(bundled_trace())[:200]
    base = demo.replay_speed(records, 2, 0.8, 1.0)
    assert base > 0
    assert demo.replay_speed(records, 4, 0.8, 1.0) == pytest.approx(2 * base)
    assert demo.replay_speed(records, 2, 0.4, 1.0) == pytest.approx(base / 2)
    # engines twice as fast: requests must come twice as fast for the same modelled load
    assert demo.replay_speed(records, 2, 0.8, 0.5) == pytest.approx(2 * base)


def test_replays_with_other_salts_share_no_prefix() -> None:
    rec = TraceRecord(timestamp_ms=0, input_length=700, output_length=1, hash_ids=[1, 2])
    a = prompt_tokens(rec, {})
    assert a == prompt_tokens(rec, {}, BLOCK_SALT)  # the default is the historic salt
    b = prompt_tokens(rec, {}, 12345)
    assert len(a) == len(b) == 700 and a[:16] != b[:16]
    assert not np.array_equal(block_tokens(1), block_tokens(1, salt=12345))


def _result(policy: str, ttft: float, **kw: Any) -> dict[str, Any]:
    r = {"policy": policy, "requests": 4, "completed": 4, "rejected": 0, "failed": 0,
         "ttft_mean_s": ttft, "ttft_p50_s": ttft, "ttft_p90_s": ttft, "ttft_p99_s": ttft,
         "tbt_mean_ms": 40.0, "tbt_p99_ms": 60.0, "slo_attainment": 1.0,
         "token_hit_ratio": 0.25, "ttft_samples_s": [ttft] * 4}
    r.update(kw)
    return r


def test_report_puts_policies_side_by_side_with_the_ratio() -> None:
    text = demo.format_report([_result("conductor", 1.0),
                               _result("least-load", 4.0, rejected=2, slo_attainment=0.5)])
    lines = text.splitlines()
    assert lines[0].split() == ["conductor", "least-load", "conductor/least-load"]
    ttft = next(line for line in lines if line.startswith("TTFT mean"))
    assert ttft.split()[-1] == "0.25x"
    slo = next(line for line in lines if line.startswith("SLO attainment"))
    assert "100.0%" in slo and "50.0%" in slo and slo.split()[-1] == "2.00x"
    rej = next(line for line in lines if line.startswith("rejected"))
    assert rej.split()[-2:] == ["2", "0.00x"]


def test_the_report_says_how_the_conductor_admitted() -> None:
    paper = demo.admission_note({"on": True, "rule": "prediction", "ttft_miss_risk": None})
    assert "paper's rule" in paper and "margin" not in paper
    margin = demo.admission_note({"on": True, "rule": "prediction", "ttft_miss_risk": 0.01})
    assert "paper's rule" in margin and "ttftMissRisk 0.01" in margin
    assert "current-load" in demo.admission_note({"on": True, "rule": "current-load"})
    off = demo.admission_note({"on": False, "rule": "prediction"})
    assert "admitted every request" in off
    # a gateway that did not say: not claimed to refuse
    assert "admitted every request" in demo.admission_note({})


def test_report_shows_nothing_served_as_a_dash() -> None:
    nan = math.nan
    text = demo.format_report([_result("conductor", 1.0),
                               _result("random", nan, completed=0, ttft_p50_s=nan)])
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT mean"))
    assert ttft.split()[-2:] == ["-", "-"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "ttft.png"
    demo.plot_ttft([_result("conductor", 1.0), _result("least-load", 3.0)], 30.0, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_prints_plain_lines_in_logs() -> None:
    out = io.StringIO()
    con = demo.Console(total=1, stream=out)
    show = con.progress("conductor", 20)
    for i in range(1, 21):
        show(i)
    lines = out.getvalue().splitlines()
    assert 1 < len(lines) <= 11 and lines[-1].strip().startswith("conductor: 20/20")


def test_a_failed_step_names_the_step_the_object_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_DEMO_CHART", str(tmp_path / "no-chart"))
    assert main(["demo", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "failed: the chart is not at" in err
    assert "object:" in err and "what to do:" in err


def test_an_unknown_baseline_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--baseline", "no-such-policy"]) == 1
    err = capsys.readouterr().err
    assert "unknown baseline policy" in err and "least-load" in err


def test_a_bad_setting_is_one_line_not_a_traceback(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["demo", "--requests", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mooncake-operator demo: requests: ") and "Traceback" not in err
    monkeypatch.setenv("MOONCAKE_DEMO_POLL_S", "soon")
    assert main(["demo"]) == 2
    assert "poll_s" in capsys.readouterr().err
