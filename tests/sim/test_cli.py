import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mooncake_cli.main import main
from mooncake_sim.synth import generate, write_trace


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("trace") / "small.jsonl"
    write_trace(generate("conversation", 300, seed=2), p)
    return p


def test_simulate_json_has_the_documented_keys(small_trace: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["simulate", "--trace", str(small_trace), "--compare", "random,conductor",
               "--prefill", "4", "--decode", "4", "--speed", "2", "--json", str(out),
               "--jobs", "1"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["settings"]["prefill"] == 4 and data["settings"]["speed"] == 2.0
    assert [r["policy"] for r in data["results"]] == ["random", "conductor"]
    for r in data["results"]:
        for key in ("policy", "requests", "completed", "rejected", "ttft_mean_s", "ttft_p50_s",
                    "ttft_p90_s", "ttft_p99_s", "tbt_p90_ms", "slo_attainment",
                    "token_hit_ratio", "prefill_gpu_seconds", "prefill_exec_mean_s",
                    "ttft_wait_mean_s", "wall_seconds"):
            assert key in r
        assert r["requests"] == 300
    table = capsys.readouterr().out
    assert "conductor" in table and "TTFT mean" in table
    header, _, *rows = table.splitlines()
    wait_at = header.split().index("wait")  # each column before it: as many words per row
    for r, row in zip(data["results"], rows, strict=False):
        assert row.split()[wait_at: wait_at + 2] == [f"{r['ttft_wait_mean_s']:.2f}", "s"]


def test_routing_only_reaches_every_policy_and_the_settings(small_trace: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(small_trace), "--compare", "conductor,mooncake-paper",
            "--prefill", "4", "--decode", "4", "--speed", "4", "--jobs", "1"]
    assert main([*args, "--json", str(out)]) == 0
    full = json.loads(out.read_text())
    assert full["settings"]["routing_only"] is False
    assert main([*args, "--routing-only", "--json", str(out)]) == 0
    only = json.loads(out.read_text())
    assert only["settings"]["routing_only"] is True
    for r in only["results"]:
        assert r["rejected"] == 0 and r["replicated_tokens"] == 0
        assert r["long_prompts"]["threshold_tokens"] == 65_536
    # the full systems did use a capability routing-only takes away (rejections,
    # replication or fetched reuse above the local-only hit ratio)
    assert any(f["rejected"] or f["replicated_tokens"]
               or f["token_hit_ratio"] > o["token_hit_ratio"]
               for f, o in zip(full["results"], only["results"], strict=True))


def test_shedding_flag_reaches_every_policy_and_the_settings(small_trace: Path,
                                                              tmp_path: Path) -> None:
    """Overloaded (speed 10 on 4 + 4): by default only conductor sheds (``overload``);
    --no-shedding turns it off, --shedding turns it on for mooncake-paper too."""
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(small_trace), "--compare", "conductor,mooncake-paper",
            "--prefill", "4", "--decode", "4", "--speed", "10", "--jobs", "1",
            "--json", str(out)]

    def run(*flag: str) -> tuple[Any, dict[str, int], dict[str, int]]:
        assert main([*args, *flag]) == 0
        doc = json.loads(out.read_text())
        ours, paper = doc["results"]
        return doc["settings"]["shedding"], ours["reject_reasons"], paper["reject_reasons"]

    setting, ours, paper = run()
    assert setting is None and ours.get("overload", 0) > 0 and "overload" not in paper
    setting, ours, paper = run("--no-shedding")
    assert setting is False and "overload" not in ours and "overload" not in paper
    setting, ours, paper = run("--shedding")
    assert setting is True and ours.get("overload", 0) > 0 and paper.get("overload", 0) > 0
    # --capabilities equal offers shedding (and stealing, holding) to every design
    setting, ours, paper = run("--capabilities", "equal")
    assert setting is True and paper.get("overload", 0) > 0
    doc = json.loads(out.read_text())["settings"]
    assert (doc["capabilities"], doc["stealing"], doc["holding"]) == ("equal", True, True)
    # ... and an explicit flag still wins over it
    setting, _, paper = run("--capabilities", "equal", "--no-shedding")
    assert setting is False and "overload" not in paper


def test_simulate_reports_charged_ttft_over_the_lower_bound(
        small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(small_trace), "--prefill", "4", "--decode", "4",
            "--speed", "2", "--jobs", "1", "--json", str(out)]
    bounds = {}
    for policies in ("least-load,conductor", "least-load"):
        assert main([*args, "--compare", policies]) == 0
        doc = json.loads(out.read_text())
        assert doc["settings"]["capabilities"] == "own"  # simulate's default reading
        rows = doc["results"]
        # one bound for every design compared, never above a charged mean
        assert len({r["ttft_lower_bound_s"] for r in rows}) == 1
        for r in rows:
            assert r["ttft_charged_over_bound"] == pytest.approx(
                r["ttft_mean_charged_s"] / r["ttft_lower_bound_s"])
            assert r["ttft_charged_over_bound"] >= 1.0
        bounds[policies] = rows[0]["ttft_lower_bound_s"]
        assert "charged/bound" in capsys.readouterr().out
    # with conductor compared, CPP may split long prompts: the bound is lower
    assert bounds["least-load,conductor"] < bounds["least-load"]


def test_stealing_flag_reaches_every_policy_and_the_settings(small_trace: Path,
                                                              tmp_path: Path) -> None:
    """With noisy predictions under load, conductor steals by default and mooncake-paper
    does not; --no-stealing stops it, --stealing starts it for mooncake-paper too."""
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(small_trace), "--compare", "conductor,mooncake-paper",
            "--prefill", "4", "--decode", "4", "--speed", "4", "--prediction-error", "0.5",
            "--jobs", "1", "--json", str(out)]

    def run(*flag: str) -> tuple[Any, int, int]:
        assert main([*args, *flag]) == 0
        doc = json.loads(out.read_text())
        ours, paper = doc["results"]
        return doc["settings"]["stealing"], ours["steals"], paper["steals"]

    setting, ours, paper = run()
    assert setting is None and ours > 0 and paper == 0
    assert run("--no-stealing") == (False, 0, 0)
    setting, ours, paper = run("--stealing")
    assert setting is True and ours > 0 and paper > 0


def test_holding_flag_reaches_every_policy_and_the_settings(small_trace: Path,
                                                             tmp_path: Path) -> None:
    """One decode instance for eight prefill: conductor's decode side refuses requests and
    it holds them by default; --no-holding stops it and it rejects them (tbt-slo).
    (mooncake-paper's tbt-slo selector prices the running batch only and hardly ever
    refuses here; that the flag reaches every policy is tested in the core.)"""
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(small_trace), "--compare", "conductor,mooncake-paper",
            "--prefill", "8", "--decode", "1", "--speed", "4", "--jobs", "1",
            "--json", str(out)]

    def run(*flag: str) -> tuple[Any, int, int, int]:
        assert main([*args, *flag]) == 0
        doc = json.loads(out.read_text())
        ours, paper = doc["results"]
        return (doc["settings"]["holding"], ours["held"], paper["held"],
                ours["reject_reasons"].get("tbt-slo", 0))

    setting, ours, paper, refused = run()
    assert setting is None and ours > 0 and paper == 0
    setting, ours, paper, refused = run("--no-holding")
    assert (setting, ours, paper) == (False, 0, 0) and refused > 0
    setting, ours, _, _ = run("--holding")
    assert setting is True and ours > 0


def test_preset_works_on_any_trace(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(small_trace), "--preset", "paper-fig5",
                 "--policy", "least-load", "--json", str(out)]) == 0
    s = json.loads(out.read_text())["settings"]
    assert (s["prefill"], s["decode"], s["prefill_cache_tokens"]) == (16, 16, 3_000_000)
    assert s["ttft_slo_s"] == 30.0 and s["tbt_slo_ms"] == 100.0 and s["speed"] > 0


def test_plot(small_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "r.png"
    assert main(["simulate", "--trace", str(small_trace), "--policy", "conductor",
                 "--prefill", "4", "--decode", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "nope"], "unknown policy nope"),
        (["--compare", "random,random"], "listed twice"),
        (["--preset", "nope"], "unknown preset"),
        (["--prefill", "0"], "--prefill must be positive"),
        (["--max-tokens", "0"], "--max-tokens must be positive"),
        (["--speed", "-1"], "--speed must be a positive number"),
        (["--params", "{bad"], "--params is not valid JSON"),
        (["--params", '{"priority_weight": -1}'], "bad setting"),
        (["--params", '{"no_such": 1}'], "bad setting"),
    ],
)
def test_bad_arguments_exit_2(small_trace: Path, args: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(small_trace), *args]) == 2
    assert message in capsys.readouterr().err


def test_max_tokens_reaches_the_run_and_its_settings(small_trace: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(small_trace), "--policy", "conductor",
                 "--prefill", "2", "--decode", "2", "--max-tokens", "4096",
                 "--json", str(out)]) == 0
    assert "max_tokens 4096" in capsys.readouterr().err
    assert json.loads(out.read_text())["settings"]["max_tokens"] == 4096


def test_trace_stats_prints_the_ceiling(small_trace: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mooncake_cli", "trace-stats",
                        str(small_trace)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "requests         300" in r.stdout
    assert "reuse ceiling" in r.stdout


def test_list_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--list-policies"]) == 0
    out = capsys.readouterr().out
    assert "kvcache-centric" in out and "conductor" in out and "sglang-cache-aware" in out
