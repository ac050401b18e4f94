"""The reliability page's own words about live overload (``benchmarks/chaos.py``) follow
the runs: which SLO the admitted requests missed is read from the rows, not written in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    name = "chaos_benchmark"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_page_names_the_slo_the_admitted_missed_more() -> None:
    split = _script()._miss_split
    ttft_heavy = [{"within_ttft": 0.6, "within_tbt": 0.99},
                  {"within_ttft": 0.7, "within_tbt": 0.97}]
    assert split(ttft_heavy) == "mostly TTFT: TTFT 30.0%–40.0% of them, TBT 1.0%–3.0%"
    tbt_heavy = [{"within_ttft": 0.97, "within_tbt": 0.75}]
    assert split(tbt_heavy) == "mostly TBT: TBT 25.0% of them, TTFT 3.0%"


def test_the_page_reads_how_late_the_admitted_prefills_came_from_the_rows() -> None:
    words = _script()._prediction_error
    assert words([{"within_ttft": 0.5}]) == ""  # runs from before it was recorded
    rows = [{"prefill_predictions": {"answered": 300, "ratio_p50": 1.22, "ratio_p90": 1.6}},
            {"prefill_predictions": {"answered": 280, "ratio_p50": 1.07, "ratio_p90": 1.3}},
            {"prefill_predictions": {"answered": 0}}]
    text = words(rows)
    assert "answered 1.07–1.22× later than predicted at the median (p90 up to 1.60×)" in text
    assert "1.22× later" in words(rows[:1])


def test_the_suite_stops_before_a_cluster_when_the_store_cannot_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    monkeypatch.setattr(script.procs, "shared_library_installed", lambda soname: False)

    def no_cluster(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(script, "local_cluster", no_cluster)
    assert script.main(["--faults", "none", "--overload", ""]) == 2
    err = capsys.readouterr().err
    assert "libibverbs.so.1 is missing" in err and "apt-get install libibverbs1" in err
